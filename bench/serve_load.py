"""Load benchmark of `dspark serve`: closed-loop concurrency levels and open-loop Poisson arrivals, DSpark and
autoregressive decoding on the same server (per-request policy "ar"), phases taking turns so the VM's drift hits
both alike. Reports throughput (tokens/s, requests/s), TTFT, inter-token and end-to-end latency P50/P90/P99,
success rate and tau; checks greedy server outputs against the in-process runtime, and measures the server's
overhead at concurrency 1 against the same engine (same slots, policy and context) called in-process, the two
taking turns pass by pass over the same requests. A closed-loop point at concurrency c sends max(--requests, 2c)
requests, so c clients are really in flight at once.

    python bench/serve_load.py --bundle ~/.cache/dspark/bundles/<demo bundle> --out bench/results/serve_load
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import ROOT, dev_rows, machine, pyplot, write_json

import httpx  # noqa: E402

from dspark.runtime import DecodeOptions, Runtime  # noqa: E402
from dspark.runtime.engine import Engine, EngineOptions  # noqa: E402
from dspark.runtime.engine_request import RequestOptions  # noqa: E402

POLICIES = ("dspark", "ar")


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve", str(args.bundle),
           "--port", str(port), "--batch-size", str(args.batch_size or "auto"), "--policy", args.policy,
           "--max-context", str(args.max_context), "--max-queue", "256", "--model-name", "bench",
           "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server not ready in 600 s")


async def one_request(client: httpx.AsyncClient, prompt: str, policy: str, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "policy": "ar" if policy == "ar" else "default"}
    start = time.perf_counter()
    stamps, text, usage = [], [], None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "status": response.status_code}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        stamps.append(time.perf_counter())
                        text.append(choice["delta"]["content"])
    except httpx.TransportError as e:
        return {"ok": False, "status": type(e).__name__}
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else 0
    ok = bool(usage) and bool(stamps)
    return {"ok": ok, "ttft": stamps[0] - start if stamps else None, "e2e": end - start, "tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "itl": (stamps[-1] - stamps[0]) / max(tokens - 1, 1) if ok else None, "text": "".join(text),
            "gaps": np.diff(stamps).tolist(),
            "start": start, "end": end}


async def closed_loop(url: str, prompts: list[str], policy: str, concurrency: int, n: int, max_tokens: int):
    todo = list(range(n))
    results = []

    async def worker(client):
        while todo:
            i = todo.pop(0)
            results.append(await one_request(client, prompts[i % len(prompts)], policy, max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


async def open_loop(url: str, prompts: list[str], policy: str, rate: float, n: int, max_tokens: int, seed: int):
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = []
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, prompts[i % len(prompts)], policy, max_tokens)))
        return await asyncio.gather(*tasks)


def metric_sum(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


def percentiles(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 5) for q in (50, 90, 99)}


def summarize(results: list[dict], tau: float | None, goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r["ok"]]
    wall = (max(r["end"] for r in ok) - min(r["start"] for r in ok)) if ok else 0.0
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "success_rate": len(ok) / len(results) if results else 0.0,
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 3) if wall else 0.0,
            "requests_per_s": round(len(ok) / wall, 4) if wall else 0.0, "tau": tau,
            "ttft_s": percentiles(r["ttft"] for r in ok), "itl_s": percentiles(r["itl"] for r in ok),
            "e2e_s": percentiles(r["e2e"] for r in ok),
            "chunk_gap_s": percentiles(g for r in ok for g in r["gaps"]),  # waits between streamed pieces
            **vllm_fields(ok, len(results) - len(ok), wall, goodput or {})}


def tpot(r: dict) -> float:
    """Time per output token after the first (vLLM's TPOT), seconds."""
    return (r["e2e"] - r["ttft"]) / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0


def vllm_fields(ok: list[dict], failed: int, wall: float, goodput: dict[str, float]) -> dict:
    """What `vllm bench serve` reports, under its names: TTFT, TPOT (per request), ITL (every gap between
    streamed pieces; a dspark round's tokens arrive in one) and end-to-end latency (E2EL), in ms: mean, median,
    std, P90, P99; throughputs; and goodput, the requests/s that met every SLO in `goodput` ({"ttft"|"tpot"|
    "e2el": ms}, `--goodput ttft:MS tpot:MS`)."""
    series = {"ttft": [r["ttft"] * 1e3 for r in ok], "tpot": [tpot(r) * 1e3 for r in ok],
              "itl": [g * 1e3 for r in ok for g in r["gaps"]], "e2el": [r["e2e"] * 1e3 for r in ok]}
    out = {"completed": len(ok), "failed": failed, "duration": round(wall, 3),
           "total_input_tokens": sum(r.get("prompt_tokens", 0) for r in ok),
           "total_output_tokens": sum(r["tokens"] for r in ok)}
    out.update({"request_throughput": round(len(ok) / wall, 4) if wall else 0.0,
                "output_throughput": round(out["total_output_tokens"] / wall, 3) if wall else 0.0,
                "total_token_throughput": round((out["total_input_tokens"] + out["total_output_tokens"]) / wall, 3)
                if wall else 0.0})
    for name, values in series.items():
        v = np.array(values) if values else np.zeros(1)
        out.update({f"mean_{name}_ms": round(float(v.mean()), 3), f"median_{name}_ms": round(float(np.median(v)), 3),
                    f"std_{name}_ms": round(float(v.std()), 3), f"p90_{name}_ms": round(float(np.percentile(v, 90)), 3),
                    f"p99_{name}_ms": round(float(np.percentile(v, 99)), 3)})
    if goodput:
        good = [r for r in ok if all(series_value(r, name) <= limit for name, limit in goodput.items())]
        out["request_goodput"] = round(len(good) / wall, 4) if wall else 0.0
        out["goodput_slo_ms"] = goodput
    return out


def series_value(r: dict, name: str) -> float:
    return {"ttft": r["ttft"], "tpot": tpot(r), "e2el": r["e2e"]}[name] * 1e3


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:100` -> {"ttft": 500.0, "tpot": 100.0} (vLLM's --goodput)."""
    slo = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms.replace(".", "", 1).isdigit():
            raise SystemExit(f"--goodput {item}: want ttft:MS, tpot:MS or e2el:MS")
        slo[name] = float(ms)
    return slo


def phase(url: str, run) -> tuple[list[dict], float | None]:
    """Run one load phase; tau over its requests from the server's tau histogram."""
    sum0, count0 = metric_sum(url, "dspark_request_tau_sum"), metric_sum(url, "dspark_request_tau_count")
    results = asyncio.run(run)
    count = metric_sum(url, "dspark_request_tau_count") - count0
    tau = (metric_sum(url, "dspark_request_tau_sum") - sum0) / count if count else None
    return results, round(tau, 4) if tau else None


def in_process_pass(engine: Engine, prompt_ids: list[list[int]], max_tokens: int) -> float:
    """tokens/s of one pass over the prompts, one request at a time, through the engine in this process."""
    tokens, seconds = 0, 0.0
    for ids in prompt_ids:
        start = time.perf_counter()
        request = engine.submit(ids, RequestOptions(max_tokens=max_tokens)).wait()
        seconds += time.perf_counter() - start
        tokens += len(request.token_ids)
    return tokens / seconds


def server_pass(url: str, prompts: list[str], max_tokens: int) -> tuple[float, float]:
    """The same pass through the server (requests sent one at a time, timed the same way: submit to last token),
    and the share of the clients' time that the engine did not account for (HTTP, validation, tokenizing, SSE):
    the server's own request-duration histogram counts from engine submit to the last token."""
    engine_s = metric_sum(url, "dspark_request_duration_seconds_sum")
    results = asyncio.run(closed_loop(url, prompts, "dspark", 1, len(prompts), max_tokens))
    engine_s = metric_sum(url, "dspark_request_duration_seconds_sum") - engine_s
    ok = [r for r in results if r["ok"]]
    client_s = sum(r["e2e"] for r in ok)
    return sum(r["tokens"] for r in ok) / client_s, 1 - engine_s / client_s


def overhead(args, url: str, prompts: list[str]) -> tuple[dict, list[str]]:
    """Server vs the same engine in-process at concurrency 1 (passes taking turns), and the greedy texts of
    Runtime.generate (what `dspark run` gives) for the equality check."""
    rt = Runtime(args.bundle)
    engine = Engine(rt, EngineOptions(batch_size=args.batch_size, policy=args.policy, max_context=args.max_context))
    engine.start().warm_up(rt.encode("Hello"))  # as the server does before /health says ready
    prompt_ids = [rt.encode(p) for p in prompts]  # the chat template, as /v1/chat/completions applies it
    runs: dict[str, list[float]] = {"in_process": [], "server": []}
    outside_engine = []
    for k in range(args.overhead_passes):
        for how in (("in_process", "server") if k % 2 == 0 else ("server", "in_process")):
            if how == "in_process":
                runs[how].append(round(in_process_pass(engine, prompt_ids, args.max_tokens), 3))
            else:
                tps, outside = server_pass(url, prompts, args.max_tokens)
                runs[how].append(round(tps, 3))
                outside_engine.append(round(outside, 4))
        print(json.dumps({"overhead_pass": k, **runs, "outside_engine": outside_engine}), flush=True)
    engine.close()
    texts = [r.text for r in rt.generate(prompts, DecodeOptions(max_tokens=args.max_tokens, batch_size=1))]
    rt.close()
    if not args.overhead_passes:
        return {}, texts
    medians = {how: float(np.median(v)) for how, v in runs.items()}
    pairs = [1 - s / i for s, i in zip(runs["server"], runs["in_process"])]
    return {"tokens_per_s": runs, "median_tokens_per_s": medians,
            "overhead": round(1 - medians["server"] / medians["in_process"], 4),
            "overhead_per_pass": [round(x, 4) for x in pairs],
            "server_time_outside_engine_per_pass": outside_engine}, texts


def load_points(args, url: str, prompts: list[str]) -> list[dict]:
    """Closed-loop levels, then Poisson rates; at each point DSpark and AR take turns (order flips each point)."""
    points = []
    plan = [("closed", c) for c in args.concurrency] + [("poisson", r) for r in args.rates]
    for k, (kind, level) in enumerate(plan):
        for policy in (POLICIES if k % 2 == 0 else POLICIES[::-1]):
            if kind == "closed":
                run = closed_loop(url, prompts, policy, int(level), max(args.requests, 2 * int(level)),
                                  args.max_tokens)
            else:
                run = open_loop(url, prompts, policy, level, args.requests, args.max_tokens, seed=k)
            results, tau = phase(url, run)
            points.append({"kind": kind, "level": level, "policy": policy, **summarize(results, tau, args.goodput),
                           "texts": [r.get("text") for r in results]})
            print(json.dumps({k2: v for k2, v in points[-1].items() if k2 != "texts"}), flush=True)
    return points


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def soak(url: str, pid: int, prompts: list[str], tokens: int, max_tokens: int) -> dict:
    """Generate `tokens` tokens through the server (4 clients), sampling the server's RSS every ~tokens/10."""
    samples, done, k, sent, failed = [], 0, 0, 0, 0
    start = time.perf_counter()
    while done < tokens:
        results = asyncio.run(closed_loop(url, prompts[k:] + prompts[:k], "dspark", 4, 4, max_tokens))
        done += sum(r["tokens"] for r in results if r["ok"])
        sent, failed = sent + len(results), failed + sum(not r["ok"] for r in results)
        k = (k + 4) % len(prompts)
        if not samples or done - samples[-1][0] >= tokens / 10:
            samples.append((done, round(rss_mb(pid), 1)))
    rss = [mb for _, mb in samples[1:]] or [samples[0][1]]  # after the first batch: caches and pools warmed
    return {"tokens": done, "requests": sent, "failed": failed, "seconds": round(time.perf_counter() - start, 1),
            "rss_mb": samples, "rss_spread_after_warmup": round(max(rss) / min(rss) - 1, 4)}


def plot(points: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for policy, style in zip(POLICIES, ("o-", "s--")):
        rows = sorted((p for p in points if p["kind"] == "closed" and p["policy"] == policy),
                      key=lambda p: p["level"])
        levels = [p["level"] for p in rows]
        axes[0].plot(levels, [p["tokens_per_s"] for p in rows], style, label=policy)
        axes[1].plot(levels, [p["itl_s"].get("p99", np.nan) * 1e3 for p in rows], style, label=policy)
        axes[2].plot(levels, [p["ttft_s"].get("p99", np.nan) * 1e3 for p in rows], style, label=policy)
    for ax, title in zip(axes, ("throughput (tokens/s)", "P99 inter-token latency (ms)", "P99 TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_load")
    ap.add_argument("--prompts", type=int, default=8, help="Dev prompts used (one per domain first).")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="Requests per load point and policy.")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4, 8, 16])
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.5, 1.0],
                    help="Poisson arrival rates (requests/s).")
    ap.add_argument("--batch-size", type=lambda s: None if s == "auto" else int(s), default=None,
                    help="Batch slots (default: auto, what dspark serve chooses).")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--policy", default="auto", help="The server's policy (default: auto, what dspark serve chooses).")
    ap.add_argument("--port", type=int, default=18650)
    ap.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", type=str,
                    help="SLOs for goodput, as vllm bench serve takes them: ttft:MS tpot:MS e2el:MS.")
    ap.add_argument("--soak-tokens", type=int, default=0, help="Then generate this many tokens, sampling RSS.")
    ap.add_argument("--overhead-passes", type=int, default=3,
                    help="Passes over the prompts at concurrency 1, in-process and server taking turns.")
    return ap.parse_args()


def main():
    args = parse_args()
    args.goodput = parse_goodput(args.goodput)
    prompts = [r["prompt"] for r in dev_rows(None, per_domain=2)][:args.prompts]
    url = f"http://127.0.0.1:{args.port}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args, args.port, Path(tempfile.gettempdir()) / f"{args.out.name}.server.log")
    started = time.perf_counter()
    try:
        server_overhead, reference = overhead(args, url, prompts) if args.overhead_passes or args.concurrency \
            else ({}, [])
        points = load_points(args, url, prompts)
        soaked = soak(url, server.pid, prompts, args.soak_tokens, args.max_tokens) if args.soak_tokens else None
    finally:
        server.terminate()
        server.wait(120)
    c1 = [p for p in points if p["kind"] == "closed" and p["level"] == 1 and p["requests"] >= len(prompts)]
    equal = {p["policy"]: sum(t == ref for t, ref in zip(p["texts"], reference)) for p in c1}
    for p in points:
        del p["texts"]
    report = {"bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "minutes": round((time.perf_counter() - started) / 60, 1),
              "greedy_equal_to_runtime": {"prompts": len(prompts), **equal},
              "server_overhead_c1": server_overhead, "soak": soaked, "points": points}
    write_json(args.out.with_suffix(".json"), report)
    if points:
        plot(points, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "points"}, indent=1))


if __name__ == "__main__":
    main()
