"""Servers side by side under the same closed-loop load: `dspark serve` with its default flags and with named
configurations, and, where given, llama.cpp's `llama-server` and vLLM's OpenAI server. Every server is started
first and stays up; then at each concurrency level the servers take turns, pass by pass, the order reversed
every pass, over the same chat requests (dev prompts, greedy, streamed, the same token budget). Reports per
server and level: tokens/s, requests/s, TTFT / inter-token / end-to-end P50 and P99, errors, the server's RSS;
what `dspark serve` chose at startup; whether every dspark server's greedy text equals `dspark run`'s.

    python bench/serve_peers.py --bundle ~/.cache/dspark/bundles/<demo bundle> \\
        --dspark "ar=--policy ar" --dspark "before=--policy all --batch-size 4" \\
        [--llama-server "BIN -m FILE.gguf -np 8 -c 4096"] [--vllm "PYTHON -m vllm.entrypoints.openai.api_server ..."]

A peer's command gets `--host 127.0.0.1 --port P` appended; it must serve /v1/chat/completions and /health.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import ROOT, dev_rows, machine, pyplot, write_json

import httpx  # noqa: E402

from serve_load import parse_goodput, phase, summarize  # noqa: E402

MODEL = "bench"


@dataclass
class Server:
    name: str
    command: list[str]
    port: int
    log: Path
    dspark: bool
    process: subprocess.Popen | None = None
    chose: str | None = None  # dspark's startup line: slots and policy, and why
    rss: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise SystemExit(f"{self.name} exited: {self.log.read_text()[-2000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants (vLLM serves from child processes)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def dspark_server(name: str, flags: str, args, port: int, logs: Path) -> Server:
    cmd = [sys.executable, "-c", "from dspark.cli import main_cli; main_cli()", "serve", str(args.bundle),
           "--port", str(port), "--model-name", MODEL, "--max-queue", "256", "--log-level", "warning",
           "--no-access-log", *shlex.split(flags)]
    return Server(name, cmd, port, logs / f"{name}.log", dspark=True)


def peer_server(name: str, command: str, port: int, logs: Path) -> Server:
    cmd = [*shlex.split(command), "--host", "127.0.0.1", "--port", str(port)]
    return Server(name, cmd, port, logs / f"{name}.log", dspark=False)


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, text, usage = [], [], None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "status": response.status_code, "start": start, "end": time.perf_counter()}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
                        text.append(choice["delta"]["content"])
    except httpx.TransportError as e:
        return {"ok": False, "status": type(e).__name__, "start": start, "end": time.perf_counter()}
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(stamps)
    ok = bool(stamps)
    return {"ok": ok, "ttft": stamps[0] - start if ok else None, "e2e": end - start, "tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "itl": (stamps[-1] - stamps[0]) / max(tokens - 1, 1) if ok else None, "text": "".join(text),
            "gaps": np.diff(stamps).tolist(), "start": start, "end": end}


async def closed_loop(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> list[dict]:
    todo = list(range(n))
    results = []

    async def worker(client):
        while todo:
            i = todo.pop(0)
            results.append({**await one_request(client, prompts[i % len(prompts)], max_tokens),
                            "prompt": i % len(prompts)})

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def reference_texts(bundle: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """What `dspark run` gives for each prompt as a chat request (greedy, one request at a time)."""
    from dspark.runtime import DecodeOptions, Runtime

    rt = Runtime(bundle)
    try:
        return [r.text for r in rt.generate([rt.encode(p) for p in prompts],
                                            DecodeOptions(max_tokens=max_tokens, batch_size=1))]
    finally:
        rt.close()


def startup_line(server: Server) -> str | None:
    for line in server.log.read_text().splitlines():
        if line.startswith("dspark serve: ") and "batch slots" in line:
            return line[len("dspark serve: "):]
    return None


def run_levels(args, servers: list[Server], prompts: list[str]) -> list[dict]:
    points = []
    for level in args.concurrency:
        n = max(args.requests, 2 * level)
        for k in range(args.passes):
            for server in (servers if k % 2 == 0 else servers[::-1]):
                run = closed_loop(server.url, prompts, level, n, args.max_tokens)
                results, tau = phase(server.url, run) if server.dspark else (asyncio.run(run), None)
                server.rss.append(tree_rss_mb(server.process.pid))
                point = {"server": server.name, "level": level, "pass": k, **summarize(results, tau, args.goodput),
                         "errors": sum(not r["ok"] for r in results), "rss_mb": round(server.rss[-1], 1),
                         "error_kinds": [r.get("status", "no text streamed") for r in results if not r["ok"]],
                         "texts": [(r["prompt"], r.get("text")) for r in results]}
                points.append(point)
                print(json.dumps({key: v for key, v in point.items() if key != "texts"}), flush=True)
    return points


def medians(points: list[dict], servers: list[Server], levels: list[int]) -> dict:
    table = {}
    for server in servers:
        table[server.name] = {}
        for level in levels:
            rows = [p for p in points if p["server"] == server.name and p["level"] == level]
            table[server.name][level] = {
                "tokens_per_s": float(np.median([p["tokens_per_s"] for p in rows])),
                "requests_per_s": float(np.median([p["requests_per_s"] for p in rows])),
                "itl_p99_s": float(np.median([p["itl_s"].get("p99", np.nan) for p in rows])),
                "ttft_p99_s": float(np.median([p["ttft_s"].get("p99", np.nan) for p in rows])),
                "errors": int(sum(p["errors"] for p in rows)),
                "tau": [p["tau"] for p in rows]}
    return table


def plot(table: dict, levels: list[int], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_level in table.items():
        axes[0].plot(levels, [by_level[c]["tokens_per_s"] for c in levels], "o-", label=name)
        axes[1].plot(levels, [by_level[c]["itl_p99_s"] * 1e3 for c in levels], "o-", label=name)
    for ax, title in zip(axes, ("throughput (tokens/s, median of passes)", "P99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_peers")
    ap.add_argument("--dspark", action="append", default=[], metavar="NAME=FLAGS",
                    help="Another dspark serve configuration (the one with default flags always runs).")
    ap.add_argument("--llama-server", help="llama-server command line without --host/--port (model 'bench').")
    ap.add_argument("--vllm", help="vLLM OpenAI server command line without --host/--port "
                                   "(--served-model-name bench).")
    ap.add_argument("--prompts", type=int, default=16, help="Dev prompts (one per domain first).")
    ap.add_argument("--requests", type=int, default=16, help="Requests per level and pass (at least 2 x level).")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 8, 16])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", type=str,
                    help="SLOs for goodput, as vllm bench serve takes them: ttft:MS tpot:MS e2el:MS.")
    return ap.parse_args()


def main():
    args = parse_args()
    args.goodput = parse_goodput(args.goodput)
    prompts = [r["prompt"] for r in dev_rows(None, per_domain=4)][:args.prompts]
    logs = Path(tempfile.mkdtemp(prefix="serve_peers_"))
    servers = [dspark_server("dspark defaults", "", args, args.port, logs)]
    for k, spec in enumerate(args.dspark, 1):
        name, _, flags = spec.partition("=")
        servers.append(dspark_server(f"dspark {name}", flags, args, args.port + k, logs))
    if args.llama_server:
        servers.append(peer_server("llama-server", args.llama_server, args.port + 50, logs))
    if args.vllm:
        servers.append(peer_server("vllm", args.vllm, args.port + 51, logs))
    started = time.perf_counter()
    try:
        for server in servers:  # one at a time: each loads with the CPU to itself
            server.start()
            deadline = time.monotonic() + 900
            while not server.ready():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{server.name} not ready in 900 s")
                time.sleep(0.5)
            server.chose = startup_line(server) if server.dspark else None
            print(f"{server.name} ready{': ' + server.chose if server.chose else ''}", flush=True)
        points = run_levels(args, servers, prompts)
    finally:
        for server in servers:
            server.stop()
    reference = reference_texts(args.bundle, prompts, args.max_tokens)
    greedy = {}
    for server in servers:
        if server.dspark:
            texts = [(t, reference[i]) for p in points if p["server"] == server.name
                     for i, t in p["texts"] if t is not None]
            greedy[server.name] = {"equal": sum(t == ref for t, ref in texts), "of": len(texts)}
    for p in points:
        del p["texts"]
    table = medians(points, servers, args.concurrency)
    report = {"bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "minutes": round((time.perf_counter() - started) / 60, 1),
              "servers": {s.name: {"command": s.command[2:] if s.dspark else s.command, "chose": s.chose,
                                   "rss_mb_max": round(max(s.rss), 1) if s.rss else None} for s in servers},
              "greedy_equal_to_dspark_run": greedy, "medians": table, "points": points}
    write_json(args.out.with_suffix(".json"), report)
    plot(table, args.concurrency, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "points"}, indent=1))


if __name__ == "__main__":
    main()
