"""Prometheus metrics of `dspark serve` (prometheus-client, one registry per server): the engine reports through
EngineObserver from its loop thread; the HTTP side counts refused and invalid requests."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark.runtime.engine_request import EngineObserver, Request, RoundStats
from dspark.serve.acceptance_watch import AcceptanceWatch
from dspark.serve.vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class Metrics(EngineObserver):
    def __init__(self, block_size: int, model: str = "", checked_position1: float | None = None,
                 warn: Callable[[str], None] = lambda line: None):
        """`checked_position1`: what `dspark-export check` measured on the bundle (AcceptanceWatch warns once when
        the live figure stays far below it)."""
        self.registry = r = CollectorRegistry()
        self.block_size = block_size
        self.capacity = 0  # target KV positions of all slots (known from the first round)
        self.requests = Counter("dspark_requests", "Requests by outcome (stop, length, cancelled, error, "
                                "rejected_queue_full, rejected_closed, invalid)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("dspark_generation_tokens", "Tokens generated", registry=r)
        self.queue = Gauge("dspark_queue_depth", "Requests waiting for a slot", registry=r)
        self.busy = Gauge("dspark_busy_slots", "Batch slots holding a request", registry=r)
        self.slots = Gauge("dspark_slots", "Batch slots of the engine", registry=r)
        self.kv_used = Gauge("dspark_kv_positions_in_use", "Target KV cache positions held by live requests",
                             registry=r)
        self.kv_capacity = Gauge("dspark_kv_positions_capacity", "Target KV cache positions of all slots",
                                 registry=r)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("dspark_inter_token_latency_seconds", "Time between tokens of a request (a round's "
                             "tokens share its gap)", registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("dspark_request_duration_seconds", "Submit to last token", registry=r,
                             buckets=E2E_BUCKETS)
        self.tau = Histogram("dspark_request_tau", "Tokens committed per round, mean per finished request",
                             registry=r, buckets=tuple(1 + 0.25 * i for i in range(4 * (block_size + 1) + 1)))
        self.verify_len = Histogram("dspark_verify_length", "Drafts verified per request per drafted round",
                                    registry=r, buckets=tuple(range(block_size + 1)))
        self.proposed = Counter("dspark_draft_proposed", "Drafts verified at each block position", ["position"],
                                registry=r)
        self.accepted = Counter("dspark_draft_accepted", "Drafts accepted at each block position", ["position"],
                                registry=r)
        self.rounds = Counter("dspark_rounds", "Decode rounds by kind (drafted, plain, gate_skipped)", ["kind"],
                              registry=r)
        self.ready = Gauge("dspark_ready", "1 once the bundle is loaded and warmed up", registry=r)
        self.acceptance = AcceptanceWatch(r, model, checked_position1, warn)
        self.vllm = VllmMetrics(r, model, LATENCY_BUCKETS, E2E_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- EngineObserver ---------------------------------------------------------------------------------------

    def queue_depth(self, depth: int) -> None:
        self.queue.set(depth)
        self.vllm.waiting.set(depth)

    def round(self, stats: RoundStats) -> None:
        self.busy.set(stats.busy_slots)
        self.queue.set(stats.queue_depth)
        self.kv_used.set(stats.kv_used)
        self.kv_capacity.set(stats.kv_capacity)
        self.capacity = stats.kv_capacity
        self.rounds.labels("gate_skipped" if stats.gate_skipped else "drafted" if stats.drafted else "plain").inc()
        self.vllm.round(stats)
        if stats.drafted:
            self.acceptance.observe(stats.verified, stats.accepted)
        for verified, accepted in zip(stats.verified, stats.accepted):
            self.verify_len.observe(verified)
            for position in range(1, verified + 1):
                self.proposed.labels(str(position)).inc()
                if position <= accepted:
                    self.accepted.labels(str(position)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def tokens(self, count: int, seconds_each: float) -> None:
        for _ in range(count):
            self.itl.observe(seconds_each)
            self.vllm.itl.observe(seconds_each)

    def finished(self, request: Request) -> None:
        self.requests.labels(request.finish_reason).inc()
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.generated_tokens.inc(len(request.token_ids))
        self.e2e.observe(request.finished_at - request.submitted)
        if request.committed:
            self.tau.observe(request.tau)
        self.vllm.finished(request)

    def refused(self, reason: str) -> None:
        self.requests.labels(f"rejected_{reason}").inc()

    def occupancy(self, busy_slots: int, kv_used: int) -> None:
        self.busy.set(busy_slots)
        self.kv_used.set(kv_used)
        self.vllm.running.set(busy_slots)
        self.vllm.kv_usage.set(kv_used / self.capacity if self.capacity else 0.0)
