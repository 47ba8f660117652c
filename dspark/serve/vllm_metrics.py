"""The same figures under vLLM's Prometheus names (`vllm:*`, labels `model_name` and `engine`), so dashboards and
load tools written for vLLM's OpenAI server read `dspark serve` unchanged. Speculative decoding follows vLLM's
`spec_decode` counters: a draft is one request's drafted round, its draft tokens the drafts verified, and
`..._per_pos{position}` counts acceptances at each 0-based block position."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dspark.runtime.engine_request import Request, RoundStats

FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "abort"}  # vLLM's finished_reason


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model: str, latency_buckets: tuple, e2e_buckets: tuple):
        r, labels = registry, ["model_name", "engine"]
        self.labels = {"model_name": model, "engine": "0"}

        def gauge(name, doc):
            return Gauge(f"vllm:{name}", doc, labels, registry=r).labels(**self.labels)

        def counter(name, doc):
            return Counter(f"vllm:{name}", doc, labels, registry=r).labels(**self.labels)

        def histogram(name, doc, buckets):
            return Histogram(f"vllm:{name}", doc, labels, registry=r, buckets=buckets).labels(**self.labels)

        self.running = gauge("num_requests_running", "Requests in a batch slot")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the target KV cache positions in use (1 = 100%)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = Counter("vllm:request_success", "Finished requests by finished_reason",
                               [*labels, "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", latency_buckets)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency", latency_buckets)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", e2e_buckets)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request", _token_buckets())
        self.request_generation = histogram("request_generation_tokens", "Generated tokens per request",
                                            _token_buckets())
        self.drafts = counter("spec_decode_num_drafts", "Drafted rounds, one per request")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position (0-based)",
                                        [*labels, "position"], registry=r)

    def round(self, stats: RoundStats) -> None:
        self.running.set(stats.busy_slots)
        self.waiting.set(stats.queue_depth)
        self.kv_usage.set(stats.kv_used / stats.kv_capacity if stats.kv_capacity else 0.0)
        for verified, accepted in zip(stats.verified, stats.accepted):
            if verified:
                self.drafts.inc()
                self.draft_tokens.inc(verified)
                self.accepted.inc(accepted)
                for position in range(accepted):
                    self.accepted_per_pos.labels(**self.labels, position=str(position)).inc()

    def finished(self, request: Request) -> None:
        self.success.labels(**self.labels, finished_reason=FINISHED.get(request.finish_reason, "abort")).inc()
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.generation_tokens.inc(len(request.token_ids))
        self.request_prompt.observe(len(request.prompt_ids))
        self.request_generation.observe(len(request.token_ids))
        self.e2e.observe(request.finished_at - request.submitted)


def _token_buckets() -> tuple:
    return tuple(float(b * 10 ** e) for e in range(6) for b in (1, 2, 5))
