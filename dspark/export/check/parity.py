"""`dspark-export check`: does a bundle compute what the PyTorch reference computes?

At export time, `record_check_data` decodes through the fresh bundle (ONNX Runtime with its weights mapped, no
fp32 copy) until it has real inputs of every graph (prefill, draft, heads, verify), closes it, then evaluates the
PyTorch modules on exactly those inputs and runs the PyTorch reference decoder (weights at the bundle's
precision): the bundle and the reference are never in memory together. Everything lands in BUNDLE/check/.
`check_bundle` later needs only the bundle: ONNX Runtime vs the stored reference outputs through Polygraphy's
comparator with per-output tolerances, then end-to-end greedy decoding (DSpark and AR) against the stored
reference tokens.
"""
from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from polygraphy.comparator import Comparator, RunResults
from polygraphy.comparator.compare import SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult
from polygraphy.logger import G_LOGGER

from dspark.acceptance import Verdict, judge, measure
from dspark.bundle import Manifest, check_reference
from dspark.errors import DSparkError
from dspark.files import read_json
from dspark.export.check.trt_lint import lint_bundle
from dspark.export.graphs import SAMPLER_INPUTS, SAMPLER_OUTPUTS, DraftGraph, HeadsGraph, SamplerGraph, VerifierGraph
from dspark.models.reference import generate_ar, generate_dspark
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.backend import SAMPLING_OUTPUTS
from dspark.runtime.fused_verifier import FusedVerifier
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.sampling import judged_tokens

CHECK_DIR = "check"
CHECK_PROMPT = "Natalia sold clips to 48 friends in April and half as many in May. How many clips in total?"
CHECK_TOKENS = 32
CAPTURE = {"verifier": 2, "draft": 1, "heads": 1}  # first prefill + first verify, one draft, one heads call

# Per-output tolerances (rtol, atol); integer and boolean outputs must match exactly.
TOLERANCES = {
    "taps": (1e-3, 2e-3), "logits": (1e-3, 2e-3), "new_kv": (1e-3, 1e-3), "hidden": (1e-3, 1e-3),
    "new_draft_kv": (1e-3, 1e-3),
    "draft_probs": (1e-3, 1e-5), "probs": (1e-3, 1e-5), "survival": (1e-4, 1e-5), "conf_logits": (1e-3, 1e-4),
    "logprobs": (1e-3, 2e-3),
}
LOGPROB_FLOOR = -1e4  # -inf (a token filtered out) is compared as this: a finite value against it fails


# ----------------------------------------------------------------------------------------- export side (torch)


def record_check_data(pair, bundle: Path, max_tokens: int = CHECK_TOKENS, into: Path | None = None) -> None:
    """Record check/ of `bundle` (into another folder with `into`, which becomes check/ afterwards)."""
    manifest = Manifest.read(bundle)
    # The weights stay mapped from the bundle file (no fp32 copy): the recording only has to fit beside nothing.
    rt = Runtime(bundle, backend=OrtBackend(bundle, manifest, weights="mapped"))
    captured: dict[str, list[dict]] = {k: [] for k in CAPTURE}
    rt.backend.heads_greedy = None  # record the portable heads' calls (the greedy twin is checked on them)
    for name, graph in (("verifier", rt.backend.verifier), ("draft", rt.backend.draft), ("heads", rt.backend.heads)):
        graph.run = _recording(graph.run, captured[name], CAPTURE[name])
    prompt_ids = rt.encode(CHECK_PROMPT)
    for _ in rt.decoder([prompt_ids], DecodeOptions(max_tokens=max_tokens)):
        if all(len(captured[k]) >= n for k, n in CAPTURE.items()):
            break  # every graph's inputs are in: the reference tokens come from PyTorch, not from this decode
    specs_of, stop = rt.manifest.graphs, tuple(rt.manifest.stop_token_ids)
    precision = rt.manifest.precision
    rt.close()  # the bundle's sessions go before the PyTorch weights come in: never both in memory
    del rt
    gc.collect()  # the recording wrappers and their graphs form cycles: free the sessions now
    pair.realize(precision)
    modules = {"verifier": VerifierGraph(pair.target), "draft": DraftGraph(pair.drafter),
               "heads": HeadsGraph(pair.drafter)}
    out_dir = Path(into) if into is not None else bundle / CHECK_DIR
    out_dir.mkdir(exist_ok=True)
    for name, calls in captured.items():
        specs = specs_of[name]
        fixed = [t.name for t in specs.inputs if "." not in t.name]
        for i, feeds in enumerate(calls):
            args = [torch.from_numpy(np.array(feeds[n])) for n in fixed]
            past = [torch.from_numpy(np.array(feeds[t.name])) for t in specs.inputs if "." in t.name]
            with torch.no_grad():
                outs = modules[name](*args) if name == "heads" else modules[name](*args, past)
            np.savez(out_dir / f"{name}_{i}_inputs.npz", **{k: np.array(v) for k, v in feeds.items()})
            reference = {o.name: v.numpy() for o, v in zip(specs.outputs, outs)}
            np.savez(out_dir / f"{name}_{i}_reference.npz", **reference)
            if name == "verifier" and "sampler" in specs_of and "logits" in reference:
                sampled = sampler_feeds(feeds, reference["logits"], i)
                with torch.no_grad():
                    outs = SamplerGraph()(*(torch.from_numpy(sampled[n]) for n in SAMPLER_INPUTS))
                np.savez(out_dir / f"sampler_{i}_inputs.npz", **sampled)
                np.savez(out_dir / f"sampler_{i}_reference.npz",
                         **{n: v.numpy() for n, v in zip(SAMPLER_OUTPUTS, outs)})
    ds = generate_dspark(pair.target, pair.drafter, [prompt_ids], max_tokens, stop_ids=stop)[0]
    ar = generate_ar(pair.target, [prompt_ids], max_tokens, stop_ids=stop)[0]
    (out_dir / "expected.json").write_text(json.dumps(
        {"prompt": CHECK_PROMPT, "prompt_ids": prompt_ids, "max_new_tokens": max_tokens,
         "reference_dspark": ds.token_ids, "reference_ar": ar.token_ids}) + "\n")


def sampler_feeds(verifier_feeds: dict, logits: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Inputs of the sampler graph on a recorded verifier call's logits, with every sampling parameter set (and
    tokens emitted before, for the penalties): what `dspark-export check` runs the sampler on."""
    rng = np.random.default_rng(seed)
    b, rows, v = logits.shape
    tokens, index = np.asarray(verifier_feeds["tokens"]), np.asarray(verifier_feeds["logit_index"])
    counts = np.zeros((b, v), np.float32)
    np.add.at(counts, (np.repeat(np.arange(b), tokens.shape[1]), tokens.reshape(-1)), 1.0)
    bias = np.zeros((b, v), np.float32)
    bias[:, rng.integers(0, v, size=4)] = rng.uniform(-3.0, 3.0, size=4).astype(np.float32)
    return {"logits": logits.astype(np.float32),
            "draft_next": judged_tokens(tokens, index),
            "verify_len": np.asarray(verifier_feeds["verify_len"]), "temperature": np.full(b, 0.8, np.float32),
            "accept_noise": rng.uniform(1e-6, 1.0, (b, rows)).astype(np.float32),
            "sample_noise": rng.uniform(1e-6, 1.0, b).astype(np.float32),
            "draft_probs": np.asarray(verifier_feeds["draft_probs"], np.float32), "counts": counts,
            "prompt_seen": (counts > 0).astype(np.float32), "logit_bias": bias,
            "repetition_penalty": np.full(b, 1.2, np.float32), "presence_penalty": np.full(b, 0.3, np.float32),
            "frequency_penalty": np.full(b, 0.2, np.float32), "top_k": np.full(b, min(40, max(2, v // 3)), np.int64),
            "top_p": np.full(b, 0.9, np.float32), "min_p": np.full(b, 0.02, np.float32)}


def _recording(run, sink: list, limit: int):
    def wrapped(feeds):
        if len(sink) < limit:
            sink.append({k: (v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else np.array(v))
                         for k, v in feeds.items()})
        return run(feeds)
    return wrapped


# ------------------------------------------------------------------------------------------ check side (no torch)


@dataclass
class CheckRow:
    graph: str
    call: str
    output: str
    max_abs_err: float
    max_rel_err: float
    tolerance: str
    passed: bool


@dataclass
class CheckReport:
    bundle: str
    rows: list[CheckRow]
    e2e: dict
    lint: list[dict] | None = None
    verdict: Verdict | None = None  # the acceptance-collapse alarm's (dspark.acceptance)

    @property
    def passed(self) -> bool:
        return (all(r.passed for r in self.rows) and all(v["passed"] for v in self.e2e.values())
                and not self.lint and not (self.verdict is not None and self.verdict.failed))

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "passed": self.passed, "graphs": [asdict(r) for r in self.rows],
                "e2e": self.e2e, "trt_lint": self.lint,
                "acceptance": None if self.verdict is None else self.verdict.to_dict()}


def compare_outputs(graph: str, call: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[CheckRow]:
    """Polygraphy's comparator over the two result sets, with our per-output tolerances."""

    G_LOGGER.module_severity = G_LOGGER.ERROR
    got, want = _floored(got), _floored(want)
    rtol = {k: _tolerance(k)[0] for k in want}
    atol = {k: _tolerance(k)[1] for k in want}
    results = RunResults([("onnxruntime", [IterationResult(got, runner_name="onnxruntime")]),
                          ("pytorch-reference", [IterationResult(want, runner_name="pytorch-reference")])])
    with np.errstate(divide="ignore", invalid="ignore"):  # polygraphy's relative-error stats divide 0 by 0
        verdict = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(rtol=rtol, atol=atol))
    passed = bool(verdict)
    per_output = {}
    for accuracy in verdict:  # one AccuracyResult per compare function
        for iters in accuracy.values():
            for it in iters:
                for name, res in it.items():
                    per_output[name] = bool(res)
    rows = []
    for name, ref in want.items():
        a, b = got[name].astype(np.float64), ref.astype(np.float64)
        err = np.abs(a - b)
        rel = err / np.maximum(np.abs(b), 1e-12)
        r, t = _tolerance(name)
        rows.append(CheckRow(graph, call, name, float(err.max()) if err.size else 0.0,
                             float(rel.max()) if rel.size else 0.0,
                             "exact" if (r, t) == (0.0, 0.0) else f"rtol {r:g} atol {t:g}",
                             per_output.get(name, passed)))
    return rows


def _floored(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.maximum(v, LOGPROB_FLOOR) if k == "logprobs" else v for k, v in outputs.items()}


def _tolerance(output: str) -> tuple[float, float]:
    """(rtol, atol) of an output; new_kv.{g} (one per target KV group) take new_kv's."""
    return TOLERANCES.get(output.split(".")[0], (0.0, 0.0))


def _graph_runs(backend) -> list[tuple[str, str, object]]:
    """(recorded graph, graph checked, its run) for each graph the backend runs: a fused verifier's portable and
    fused graphs are both checked on the verifier's recorded calls (the fused one's new K/V read from the cache
    it wrote them into)."""
    runs = []
    for name in CAPTURE:
        graph = getattr(backend, name)
        if isinstance(graph, FusedVerifier):
            runs += [(name, name, _every_output(graph.portable)), (name, "verifier_fused", graph.run_gathered)]
        else:
            runs.append((name, name, _every_output(graph)))
    if backend.sampler is not None:  # on sampler inputs made from the recorded verifier calls' logits
        runs.append(("sampler", "sampler", _every_output(backend.sampler)))
    if backend.heads_greedy is not None:  # on the recorded (greedy) heads calls, less what it does not take
        takes = set(backend.heads_greedy.inputs)
        runs.append(("heads", "heads_greedy", lambda feeds: backend.heads_greedy.run(
            {k: v for k, v in feeds.items() if k in takes})))
    return runs


def _every_output(graph):
    """The graph's run, with the outputs given only on demand too (the verifier's logits)."""
    return lambda feeds: graph.run(feeds, fetch=list(graph.outputs))


def check_bundle(bundle: Path, trt_lint: bool = False, weights: str = "auto", acceptance: bool = False
                 ) -> CheckReport:
    """With `acceptance`, also the collapse alarm's measurement and verdict (dspark.acceptance)."""
    bundle = Path(bundle)
    manifest = Manifest.read(bundle)
    check_dir = bundle / CHECK_DIR
    if not (check_dir / "expected.json").exists():
        raise DSparkError(f"{bundle} has no {CHECK_DIR}/ reference data (`dspark demo` and `dspark-export onnx "
                          f"--no-check` skip it); `dspark-export check` records it from the checkpoints the bundle was "
                          f"converted from")
    check_reference(bundle)  # the recorded data is untrusted input too (doctor reads it through here)
    rt = Runtime(bundle, weights=weights)
    rows: list[CheckRow] = []
    for name, label, run in _graph_runs(rt.backend):
        for i in range(CAPTURE.get(name, CAPTURE["verifier"])):
            inputs, ref = check_dir / f"{name}_{i}_inputs.npz", check_dir / f"{name}_{i}_reference.npz"
            if not inputs.exists():
                continue
            feeds = dict(np.load(inputs))
            try:
                got = {k: v.numpy() for k, v in run(feeds).items()}
            except Exception as e:  # onnxruntime's own error types: a graph that no longer takes its recorded inputs
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise DSparkError(f"{label}.onnx fails on {CHECK_DIR}/{inputs.name}: {first[:300]}") from None
            want = dict(np.load(ref))
            if label == "heads_greedy":
                for output in SAMPLING_OUTPUTS:
                    want.pop(output)
            compared = compare_outputs(label, f"call {i}", got, want)
            if name in manifest.quantized:  # 8-bit draft weights: errors are reported, losslessness is checked e2e
                compared = [replace(r, tolerance=f"report only ({manifest.quantized[name].get('bits', '?')}-bit weights)",
                                    passed=True) for r in compared]
            elif manifest.precision != "fp32":  # same fp32 arithmetic on the same rounded weights: same bounds
                compared = [replace(r, tolerance=f"{r.tolerance}, reference weights rounded to {manifest.precision}")
                            for r in compared]
            rows += compared
    expected = read_json(check_dir / "expected.json")  # checked by check_reference above
    e2e = {}
    own_verifier = "verifier" in manifest.quantized  # exact w.r.t. the quantized verifier, not the fp32 reference
    for mode, key in (("ar", "reference_ar"), ("dspark", "reference_dspark")):
        options = DecodeOptions(max_tokens=expected["max_new_tokens"], policy="ar" if mode == "ar" else "all")
        res = rt.generate([expected["prompt_ids"]], options)[0]
        if own_verifier and mode == "ar":
            own_ar = res.token_ids
            continue
        want = own_ar if own_verifier else expected[key]
        first_diff = next((i for i, (a, b) in enumerate(zip(res.token_ids, want)) if a != b),
                          None if len(res.token_ids) == len(want) else min(len(res.token_ids), len(want)))
        e2e[mode] = {"passed": first_diff is None, "tokens": len(res.token_ids), "first_difference": first_diff,
                     "tau": round(res.tau, 3),
                     "against": "the quantized verifier's own AR" if own_verifier else "PyTorch reference"}
    lint = None
    if trt_lint:
        lint = [asdict(f) for f in lint_bundle(bundle, manifest)]
    verdict = judge(measure(rt), manifest) if acceptance else None
    return CheckReport(str(bundle), rows, e2e, lint, verdict)


def format_report(rep: CheckReport) -> str:
    lines = [f"{'graph':<14} {'call':<7} {'output':<14} {'max abs err':>12} {'max rel err':>12}  {'tolerance':<22} ok"]
    for r in rep.rows:
        lines.append(f"{r.graph:<14} {r.call:<7} {r.output:<14} {r.max_abs_err:>12.3g} {r.max_rel_err:>12.3g}  "
                     f"{r.tolerance:<22} {'yes' if r.passed else 'NO'}")
    for mode, v in rep.e2e.items():
        verdict = "equal" if v["passed"] else f"DIFFERS at token {v['first_difference']}"
        against = v.get("against", "PyTorch reference")
        lines.append(f"greedy {mode:<7} {v['tokens']} tokens vs {against}: {verdict}")
    if rep.verdict is not None:
        lines.append(f"acceptance: {'COLLAPSE: ' if rep.verdict.failed else ''}{rep.verdict.line}")
    if rep.lint is not None:
        lines.append("TensorRT lint: " + ("clean" if not rep.lint else f"{len(rep.lint)} problem(s)"))
        for f in rep.lint:
            lines.append(f"  {f['graph']}: {f['op']} ({f['node']}): {f['problem']}")
    lines.append("PASS" if rep.passed else "FAIL")
    return "\n".join(lines)
