"""dspark against the CPU runtimes a user would pick instead, in one run on the same token ids.

Methods (each in its own worker process, so each has its own peak RSS; they take turns prompt by prompt, so drift
of a shared VM's speed hits them alike):

  llama.cpp       llama-cpp-python on the GGUF the bundle was converted from (--gguf; its own quantization)
  genai-LABEL     an ONNX Runtime GenAI model folder made by its builder (--genai LABEL=FOLDER)
  dspark-LABEL    a dspark bundle (--bundle LABEL=FOLDER), autoregressive and with DSpark (--policy), each a method;
                  with --portable, a bundle with a fused verifier also runs on its portable one ("LABEL portable")

Greedy, batch 1, the chat template applied once by the first bundle's tokenizer; every method stops at the bundle's
stop tokens or --max-tokens. Reported per method: tokens/s (median over prompts) with the prefill included and
excluded, tau, agreement with the first bundle's autoregressive output, peak RSS, and the physical floor: the weight
bytes one autoregressive token reads against this machine's measured copy bandwidth. Then a batch phase (--batch,
default 8): each method that batches (dspark; GenAI with right-padded rows; not llama-cpp-python, whose API
decodes one sequence) decodes the first --batch prompts as one batch, methods taking turns --batch-reps times:
tokens/s with the prefill included, and whether each output equals the method's own batch-1 output.

  python bench/peers.py --bundle fp32=B32 --bundle gguf=BQ --genai int4=G4 --genai fp32=G32 [--per-domain 3]
  (the results of the last run: bench/results/peers.{json,png})
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time
from pathlib import Path

import numpy as np

from common import ROOT, bandwidth_gb_s, dev_rows, machine, pyplot, write_json
from cpu_decode import decode_one


# -- workers: one per method, in its own process --------------------------------------------------------------

class DsparkDecoder:
    def __init__(self, folder: str, policy: str, threads: int, verifier: str = "auto"):
        from dspark.bundle import Manifest
        from dspark.runtime import Runtime
        from dspark.runtime.ort_backend import OrtBackend

        backend = OrtBackend(Path(folder), Manifest.read(Path(folder)), threads=threads, verifier=verifier)
        self.rt, self.policy = Runtime(folder, backend=backend), policy

    def __call__(self, ids: list[int], max_new: int) -> dict:
        _, res, times = decode_one(self.rt, ids, max_new, policy=self.policy)
        return {"tokens": res.token_ids, "total_s": times.total, "prefill_s": times.prefill,
                "tau": res.tau if res.committed else None}

    def batch(self, prompts: list[list[int]], max_new: int) -> dict:
        from dspark.runtime import DecodeOptions

        t0 = time.perf_counter()
        res = self.rt.generate(prompts, DecodeOptions(max_tokens=max_new, policy=self.policy,
                                                       batch_size=len(prompts)))
        taus = [r.tau for r in res if r.committed]
        return {"tokens": [r.token_ids for r in res], "total_s": time.perf_counter() - t0,
                "tau": float(np.mean(taus)) if taus else None}


class LlamaCppDecoder:
    def __init__(self, gguf: str, threads: int, stop: list[int], context: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False)
        self.stop = set(stop)

    def __call__(self, ids: list[int], max_new: int) -> dict:
        self.llm.reset()
        out, t0, first = [], time.perf_counter(), None
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if tok in self.stop or len(out) >= max_new:
                break
        end = time.perf_counter()
        return {"tokens": out, "total_s": end - t0, "prefill_s": first - t0, "tau": None}


class GenaiDecoder:
    def __init__(self, folder: str, threads: int, stop: list[int], context: int):
        import onnxruntime_genai as og

        self.og, self.model, self.stop, self.context = og, og.Model(folder), set(stop), context
        config = json.loads((Path(folder) / "genai_config.json").read_text())
        self.pad = int(config["model"].get("pad_token_id", 0))

    def __call__(self, ids: list[int], max_new: int) -> dict:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=min(len(ids) + max_new, self.context))
        t0 = time.perf_counter()
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        out, first = [], None
        while not gen.is_done():
            gen.generate_next_token()
            tok = int(gen.get_next_tokens()[0])
            if first is None:
                first = time.perf_counter()
            out.append(tok)
            if tok in self.stop or len(out) >= max_new:
                break
        end = time.perf_counter()
        return {"tokens": out, "total_s": end - t0, "prefill_s": first - t0, "tau": None}

    def batch(self, prompts: list[list[int]], max_new: int) -> dict:
        """One generator over the prompts right-padded with the pad token (GenAI masks them: its outputs equal
        its batch-1 ones), until every row stopped or reached max_new."""
        og = self.og
        longest = max(len(p) for p in prompts)
        tokens = np.full((len(prompts), longest), self.pad, dtype=np.int32)
        for row, p in enumerate(prompts):
            tokens[row, :len(p)] = p
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, batch_size=len(prompts),
                                  max_length=min(longest + max_new, self.context))
        t0 = time.perf_counter()
        gen = og.Generator(self.model, params)
        gen.append_tokens(tokens)
        out, done = [[] for _ in prompts], [False] * len(prompts)
        while not gen.is_done() and not all(done):
            gen.generate_next_token()
            for row, tok in enumerate(gen.get_next_tokens()):
                if not done[row]:
                    out[row].append(int(tok))
                    done[row] = int(tok) in self.stop or len(out[row]) >= max_new
        return {"tokens": out, "total_s": time.perf_counter() - t0, "tau": None}


def worker(kind: str, args: tuple, conn) -> None:
    try:
        decode = {"dspark": DsparkDecoder, "llama.cpp": LlamaCppDecoder, "genai": GenaiDecoder}[kind](*args)
        decode([1, 2, 3], 4)  # warm-up
        conn.send({"ready": True})
    except Exception as e:  # reported by the parent as this method's error
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    while (job := conn.recv()) is not None:
        kind, *job = job
        if kind == "batch" and not hasattr(decode, "batch"):
            conn.send({"error": "no batched generation through this API"})
            continue
        out = decode(*job) if kind == "one" else decode.batch(*job)
        out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        conn.send(out)


# -- the physical floor ----------------------------------------------------------------------------------------

def bundle_step_bytes(folder: Path, graph: str = "verifier.onnx") -> int:
    """Weight bytes one autoregressive verifier step reads: every initializer of the graph (external data
    included) except the embedding table, of which it reads one row (a tied LM head reads the same table: counted
    then). Initializers are counted once per stored span."""
    import onnx

    model = onnx.load(str(folder / graph), load_external_data=False)
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    read_elsewhere = {i for n in model.graph.node if n.op_type != "Gather" for i in n.input}
    spans, total = set(), 0
    for t in model.graph.initializer:
        if t.name in gathered and t.name not in read_elsewhere:
            continue
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            span = (info.get("location"), int(info.get("offset", 0)), int(info.get("length", 0)))
            if span not in spans:
                spans.add(span)
                total += span[2]
        else:
            total += len(t.raw_data) or np.prod(t.dims, dtype=np.int64) * 4
    return int(total)


def gguf_step_bytes(path: Path) -> int:
    """The GGUF's tensor bytes (token_embd counted: SmolLM2 ties it as the output matrix, read every token)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    return int(sum(t.n_bytes for t in reader.tensors if t.name != "token_embd.weight" or "output.weight" not in names))


def genai_step_bytes(folder: Path) -> int:
    """The ONNX files' bytes of a GenAI builder folder (its embedding is tied or read as the LM head: counted)."""
    return int(sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith((".onnx", ".onnx.data"))))


# -- the run ---------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", required=True, help="LABEL=FOLDER (the first: reference output)")
    ap.add_argument("--policy", default="schedule+gate", help="DSpark policy of the dspark methods")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the first bundle's source, when it was one)")
    ap.add_argument("--genai", action="append", default=[], help="LABEL=FOLDER of an ORT GenAI builder output")
    ap.add_argument("--per-domain", type=int, default=3)
    ap.add_argument("--prompts", help="JSONL prompts (default: the dev prompts)")
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--portable", action="store_true",
                    help="Also run each bundle that has a fused verifier on its portable verifier")
    ap.add_argument("--batch", type=int, default=8,
                    help="Then every method that batches decodes the first N prompts as one batch (0: skip)")
    ap.add_argument("--batch-reps", type=int, default=3, help="Passes of the batch phase (methods take turns)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/peers.json"))
    args = ap.parse_args()

    from dspark.bundle import Manifest
    from dspark.tokenizer import ChatTokenizer

    bundles = dict(b.split("=", 1) for b in args.bundle)
    first = Path(next(iter(bundles.values())))
    manifest = Manifest.read(first)
    stop = list(manifest.stop_token_ids)
    tok = ChatTokenizer(first)
    rows = dev_rows(args.prompts, per_domain=args.per_domain)
    ids = [tok.encode_chat(r["prompt"]) for r in rows]
    source = str(manifest.sources.get("target", {}).get("file", ""))
    gguf = args.gguf or (source if source.endswith(".gguf") and Path(source).exists() else None)

    methods: dict[str, tuple[str, tuple]] = {}
    floors: dict[str, int] = {}
    for label, folder in bundles.items():
        fused = "verifier_fused" in Manifest.read(Path(folder)).graphs
        variants = [("", "auto", "verifier_fused.onnx" if fused else "verifier.onnx")]
        if fused and args.portable:
            variants.append((" portable", "portable", "verifier.onnx"))
        for suffix, verifier, graph in variants:
            for mode, policy in (("AR", "ar"), ("DSpark", args.policy)):
                name = f"dspark-{label}{suffix} {mode}"
                methods[name] = ("dspark", (folder, policy, args.threads, verifier))
                floors[name] = bundle_step_bytes(Path(folder), graph)
    if gguf:
        methods["llama.cpp"] = ("llama.cpp", (gguf, args.threads, stop, args.context))
        floors["llama.cpp"] = gguf_step_bytes(Path(gguf))
    for g in args.genai:
        label, folder = g.split("=", 1)
        methods[f"genai-{label}"] = ("genai", (folder, args.threads, stop, args.context))
        floors[f"genai-{label}"] = genai_step_bytes(Path(folder))

    ctx = mp.get_context("spawn")
    workers, errors = {}, {}
    for name, (kind, wargs) in methods.items():  # started one at a time: loading does not overlap decoding
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(kind, wargs, child), daemon=True)
        proc.start()
        reply = parent.recv()
        if "error" in reply:
            errors[name] = reply["error"]
            print(f"{name}: {reply['error']}", flush=True)
            proc.join()
            continue
        workers[name] = (proc, parent)

    runs: dict[str, list[dict]] = {name: [] for name in workers}
    for i, p in enumerate(ids):
        for name, (_, conn) in workers.items():
            conn.send(("one", p, args.max_tokens))
            runs[name].append(conn.recv())
        print(f"prompt {i + 1}/{len(ids)}: " + ", ".join(
            f"{n} {len(r[-1]['tokens']) / r[-1]['total_s']:.1f}" for n, r in runs.items()), flush=True)
    batched = batch_phase(workers, ids[:args.batch], args.max_tokens, args.batch_reps) if args.batch > 1 else {}
    for proc, conn in workers.values():
        conn.send(None)
        proc.join(timeout=30)

    bandwidth = bandwidth_gb_s()
    reference = runs.get(f"dspark-{next(iter(bundles))} AR")
    summary = {}
    for name, rs in runs.items():
        with_prefill = [len(r["tokens"]) / r["total_s"] for r in rs]
        decode_only = [(len(r["tokens"]) - 1) / max(r["total_s"] - r["prefill_s"], 1e-9) for r in rs]
        taus = [r["tau"] for r in rs if r["tau"]]
        row = {"tokens_per_s_median": statistics.median(with_prefill),
               "decode_tokens_per_s_median": statistics.median(decode_only),
               "per_prompt_tokens_per_s": with_prefill, "tokens": sum(len(r["tokens"]) for r in rs),
               "tau": float(np.mean(taus)) if taus else None, "peak_rss_gb": max(r["peak_rss_gb"] for r in rs),
               "weight_bytes_per_token": floors[name],
               "floor_tokens_per_s": bandwidth * 1e9 / floors[name]}
        row["decode_over_floor"] = row["floor_tokens_per_s"] / row["decode_tokens_per_s_median"]
        if name.endswith(" DSpark"):  # exactness: DSpark against the same bundle's own autoregressive output
            own = runs.get(name.replace(" DSpark", " AR"), [])
            row["equals_own_ar"] = f"{sum(r['tokens'] == a['tokens'] for r, a in zip(rs, own))}/{len(own)}"
        if reference:
            same = [r["tokens"] == a["tokens"] for r, a in zip(rs, reference)]
            agree = [_prefix(r["tokens"], a["tokens"]) / max(len(a["tokens"]), 1) for r, a in zip(rs, reference)]
            row["equals_reference_ar"] = f"{sum(same)}/{len(same)}"
            row["mean_prefix_agreement"] = float(np.mean(agree))
        if name in batched:
            row["batch"] = _batch_row(batched[name], ids[:args.batch], rs, reference)
        summary[name] = row
        print(f"{name:24s} {row['tokens_per_s_median']:6.1f} tok/s (decode {row['decode_tokens_per_s_median']:6.1f},"
              f" floor {row['floor_tokens_per_s']:6.1f}), tau {row['tau']}, RSS {row['peak_rss_gb']:.2f} GB, "
              f"= ref AR {row.get('equals_reference_ar')}", flush=True)
    out = write_json(args.out, {"machine": machine(), "bandwidth_gb_s": bandwidth, "bundles": bundles,
                                "gguf": gguf, "genai": args.genai, "policy": args.policy,
                                "prompts": len(ids), "max_new_tokens": args.max_tokens, "threads": args.threads,
                                "batch": args.batch, "batch_reps": args.batch_reps,
                                "errors": errors, "summary": summary, "runs": runs})
    plot(summary, out.with_suffix(".png"))
    print(out)


def batch_phase(workers: dict, prompts: list[list[int]], max_new: int, reps: int) -> dict[str, list[dict]]:
    """Every method decodes all `prompts` as one batch, methods taking turns, `reps` times."""
    runs: dict[str, list[dict]] = {}
    for rep in range(reps):
        for name, (_, conn) in workers.items():
            conn.send(("batch", prompts, max_new))
            out = conn.recv()
            if "error" in out:
                continue
            runs.setdefault(name, []).append(out)
        print(f"batch {len(prompts)}, pass {rep + 1}/{reps}: " + ", ".join(
            f"{n} {sum(map(len, r[-1]['tokens'])) / r[-1]['total_s']:.1f}" for n, r in runs.items()), flush=True)
    return runs


def _batch_row(runs: list[dict], prompts: list, singles: list[dict], reference: list[dict] | None) -> dict:
    """tokens/s of the batch (prefill included; median over passes) and whether each prompt's output equals the
    method's own batch-1 output and the reference's."""
    rates = [sum(map(len, r["tokens"])) / r["total_s"] for r in runs]
    last = runs[-1]["tokens"]
    row = {"size": len(prompts), "tokens_per_s_median": statistics.median(rates), "tokens_per_s": rates,
           "equals_own_batch1": f"{sum(t == s['tokens'] for t, s in zip(last, singles))}/{len(last)}",
           "tau": runs[-1]["tau"]}
    if reference:
        row["equals_reference_ar"] = f"{sum(t == a['tokens'] for t, a in zip(last, reference))}/{len(last)}"
    return row


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    names = list(summary)
    batched = [n for n in names if "batch" in summary[n]]
    fig, axes = plt.subplots(1, 2 if batched else 1, figsize=(15 if batched else 10, 0.45 * len(names) + 1.5),
                             squeeze=False, gridspec_kw={"width_ratios": [2, 1]} if batched else None)
    ax = axes[0][0]
    y = np.arange(len(names))
    ax.barh(y - 0.2, [summary[n]["decode_tokens_per_s_median"] for n in names], 0.4, label="decode tok/s")
    ax.barh(y + 0.2, [summary[n]["tokens_per_s_median"] for n in names], 0.4, label="with prefill")
    ax.scatter([summary[n]["floor_tokens_per_s"] for n in names], y, marker="|", s=200, color="k",
               label="bandwidth floor (weights read per token)")
    ax.set_yticks(y, names)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s, batch 1, greedy (median over prompts)")
    ax.legend(loc="lower right")
    if batched:
        bx = axes[0][1]
        bx.barh(y, [summary[n]["batch"]["tokens_per_s_median"] if n in batched else 0 for n in names], 0.5)
        bx.set_yticks(y, [""] * len(names))
        size = summary[batched[0]]["batch"]["size"]
        bx.set_xlabel(f"tokens/s, one batch of {size} prompts (prefill included; median of passes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
