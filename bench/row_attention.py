"""A prototype of the fused verifier with its attention written as MatMul / Softmax over the cache, against the
fused graphs the runtime has (ONNX Runtime CPU, in-process, the demo bundle and an int8-activation copy of it).

Why: ONNX Runtime's CPU GroupQueryAttention refuses several positions per request at batch > 1 and computes a
one-position step on another path than a longer one. With int8 activations that rounding becomes other tokens, so
an int8 verifier either runs each request's attention in a lane of its own (exact, a GroupQueryAttention call per
request and layer) or batches it (fast, inexact between step shapes). Attention written with MatMul, Softmax and a
ScatterND into the cache (bound in place) gives a query row the same bits whatever rows and requests share the call,
as long as every key sits at its own position's column: this script builds that graph from a bundle's portable
verifier, runs every step shape on it (batched, no lanes, no padding row), checks greedy DSpark against AR and
batch 8 against batch 1 token for token, and times engine rounds at concurrency 1 and 8 for each graph, taking turns.

The cache is the runtime's as it is ([slots, kv heads, capacity, head dim] per layer), so attention runs over the
whole capacity (--max-context): what a product version needs is a cache whose bound width follows the live lengths.

    python bench/row_attention.py --bundle ~/.cache/dspark/bundles/<demo bundle> --out bench/results/row_attention.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx_ir as ir

from bundle_concurrency import tokens_per_s
from common import ROOT, dev_rows, machine, write_json

from dspark.bundle import Manifest, sha256_file  # noqa: E402
from dspark.export.quantize.weight_stream import load_skeleton  # noqa: E402
from dspark.export.twins.fused_lanes import fused_spec, rope_tables  # noqa: E402
from dspark.export.twins.graph_copy import write_own_data  # noqa: E402
from dspark.export.twins.ort_fused import FUSED_FILE, MS, _FusedVerifier, _inv_freq, _weight  # noqa: E402
from dspark.runtime import DecodeOptions, Runtime  # noqa: E402
from dspark.runtime.backend import ON_DEMAND, STEP_OUTPUTS  # noqa: E402
from dspark.runtime.decoder import Decoder  # noqa: E402
from dspark.runtime.fused_verifier import FusedVerifier, _HostArray  # noqa: E402
from dspark.runtime.kv import IN_CACHE  # noqa: E402


class RowAttentionVerifier(_FusedVerifier):
    """The fused verifier with one lane whose attention is MatMul / Softmax over the cache (see the docstring)."""

    def _lengths_and_rope(self):
        b = self.b
        inv_freq = _weight(b, _inv_freq(self.g))
        one = b.const(np.array([1], np.int64), "one")
        tokens = b.input("tokens")
        past_len = b.add("ReduceSum", [b.input("past_mask"), one], keepdims=1)[0]  # [B, 1]
        steps = b.add("Range", [b.const(np.array(0, np.int64), "zero"),
                                b.add("Squeeze", [b.add("Shape", [tokens], start=1, end=2)[0]])[0],
                                b.const(np.array(1, np.int64), "step")])[0]
        positions = b.add("Add", [past_len, steps])[0]  # [B, S]: each row's position in its request
        end = b.add("Add", [b.add("ReduceMax", [positions], keepdims=0)[0], b.const(np.array(1, np.int64), "e1")])[0]
        self.cos, self.sin = rope_tables(b, end, inv_freq)  # [end, hd/2]
        self.positions = positions
        width = b.add("Shape", [b.input("past.0.key")], start=2, end=3)[0]  # the cache's columns
        columns = b.add("Range", [b.const(np.array(0, np.int64), "zero"), b.add("Squeeze", [width])[0],
                                  b.const(np.array(1, np.int64), "step")])[0]
        limit = b.add("Unsqueeze", [b.add("Add", [positions, one])[0], b.const(np.array([2], np.int64), "a2")])[0]
        valid = b.add("Less", [columns, limit])[0]  # [B, S, W]: a row sees its request's keys up to itself
        neg = b.const(np.array(-np.inf, np.float32), "neg_inf")
        mask = b.add("Where", [valid, b.const(np.array(0.0, np.float32), "zero_f"), neg])[0]
        mask = b.add("Unsqueeze", [mask, b.const(np.array([1, 2], np.int64), "a12")])[0]  # [B, 1, 1, S, W]
        batch = b.add("Shape", [tokens], start=0, end=1)[0]
        seq = b.add("Shape", [tokens], start=1, end=2)[0]
        kvh = b.const(np.array([self.kv_heads], np.int64), "kvh")
        grid = b.add("Concat", [batch, kvh, seq, one], axis=0)[0]
        b_idx = b.add("Reshape", [b.add("Range", [b.const(np.array(0, np.int64), "zero"), b.add("Squeeze", [batch])[0],
                                                  b.const(np.array(1, np.int64), "step")])[0],
                                  b.const(np.array([-1, 1, 1, 1], np.int64), "b_shape")])[0]
        h_idx = b.const(np.arange(self.kv_heads, dtype=np.int64).reshape(1, -1, 1, 1), "h_idx")
        p_idx = b.add("Unsqueeze", [positions, b.const(np.array([1, 3], np.int64), "a13")])[0]
        parts = [b.add("Expand", [v, grid])[0] for v in (b_idx, h_idx, p_idx)]
        self.scatter_at = b.add("Concat", parts, axis=3)[0]  # [B, Hkv, S, 3]: (request, head, position)
        self.mask = mask
        return ()

    def _rope(self, x: ir.Value, heads: int) -> ir.Value:
        """RoPE of x [B, S, heads * hd] at each row's position (rotate-half)."""
        return self.b.add("RotaryEmbedding", [x, self.positions, self.cos, self.sin], domain=MS, interleaved=0,
                          num_heads=heads)[0]

    def _attention(self, i: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None) -> ir.Value:
        b, hd, kvh = self.b, self.hd, self.kv_heads
        heads = self.gqa["num_heads"]
        group = heads // kvh
        if k is None:  # q, k and v packed
            q, k, v = b.add("Split", [q, b.const(np.array([heads * hd, kvh * hd, kvh * hd], np.int64), "qkv")], 3,
                            axis=2)
        q = b.add("Reshape", [self._rope(q, heads), b.const(np.array([0, 0, heads, hd], np.int64), "qh")])[0]
        k = b.add("Reshape", [self._rope(k, kvh), b.const(np.array([0, 0, kvh, hd], np.int64), "kh")])[0]
        v = b.add("Reshape", [v, b.const(np.array([0, 0, kvh, hd], np.int64), "kh")])[0]
        present = []
        for new, kind in ((k, "key"), (v, "value")):  # written at their positions, into the bound cache
            new = b.add("Transpose", [new], perm=[0, 2, 1, 3])[0]
            present.append(b.add("ScatterND", [b.input(f"past.{i}.{kind}"), self.scatter_at, new],
                                 names=[f"present.{i}.{kind}"])[0])
        q = b.add("Reshape", [q, b.const(np.array([0, 0, kvh, group, hd], np.int64), "qg")])[0]
        q = b.add("Transpose", [q], perm=[0, 2, 3, 1, 4])[0]  # [B, Hkv, G, S, hd]
        q = b.add("Reshape", [q, b.const(np.array([0, 0, -1, hd], np.int64), "qf")])[0]  # [B, Hkv, G*S, hd]
        q = b.add("Mul", [q, b.const(np.array(self.gqa["scale"], np.float32), "scale")])[0]
        scores = b.add("MatMul", [q, b.add("Transpose", [present[0]], perm=[0, 1, 3, 2])[0]])[0]
        shape5 = b.add("Concat", [b.add("Shape", [scores], start=0, end=2)[0],
                                  b.const(np.array([group, -1], np.int64), "gs"),
                                  b.add("Shape", [scores], start=3, end=4)[0]], axis=0)[0]
        scores = b.add("Add", [b.add("Reshape", [scores, shape5])[0], self.mask])[0]  # [B, Hkv, G, S, W]
        probs = b.add("Softmax", [scores], axis=-1)[0]
        flat = b.add("Concat", [b.add("Shape", [q], start=0, end=3)[0], b.const(np.array([-1], np.int64), "m1")],
                     axis=0)[0]
        probs = b.add("Reshape", [probs, flat])[0]  # [B, Hkv, G*S, W]
        out = b.add("MatMul", [probs, present[1]])[0]  # [B, Hkv, G*S, hd]
        out = b.add("Reshape", [out, b.const(np.array([0, 0, group, -1, hd], np.int64), "og")])[0]
        out = b.add("Transpose", [out], perm=[0, 3, 1, 2, 4])[0]  # [B, S, Hkv, G, hd]
        return b.add("Reshape", [out, b.const(np.array([0, 0, -1], np.int64), "of")])[0]


def row_attention_bundle(src: Path, dst: Path) -> Path:
    """A copy of `src` (files hard-linked) whose verifier_fused.onnx is the row-attention graph."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, dst / f.name)
    for name in ("manifest.json", FUSED_FILE, f"{FUSED_FILE}.data"):
        (dst / name).unlink(missing_ok=True)
    manifest = Manifest.read(src)
    spec = manifest.graphs["verifier"]
    path = Manifest.path(dst, spec.file)
    t = manifest.target
    model = RowAttentionVerifier(load_skeleton(path), t, path.parent, 1).build(list(manifest.draft["target_layer_ids"]))
    write_own_data(model, dst, f"{FUSED_FILE}.data")
    ir.save(model, dst / FUSED_FILE)
    fused = fused_spec(spec, FUSED_FILE, t["num_layers"], t["num_kv_heads"], t["head_dim"], 1)
    fused.sha256 = sha256_file(dst / FUSED_FILE)
    manifest.graphs["verifier_fused"] = fused
    manifest.write(dst)
    return dst


class RowFused(FusedVerifier):
    """Every step on the row-attention graph: batched, in place; a prefill's cache as wide as its prompt."""

    def run(self, feeds: dict, fetch: list[str] | None = None) -> dict:
        batch, positions = feeds["tokens"].shape
        wanted = (*STEP_OUTPUTS, *(name for name in fetch or () if name in ON_DEMAND))
        if np.any(feeds["past_mask"]):
            self.steps["fused"] += 1
            out = self.fused.run(feeds, {present: feeds[past] for past, present in self.caches}, list(wanted))
            return {**{name: out[name] for name in wanted}, "new_kv": IN_CACHE}
        self.steps["prefill"] += 1
        past = feeds[self.caches[0][0]]
        empty = np.zeros((batch, past.shape[1], positions, past.shape[3]), dtype=np.float32)
        feeds = {**feeds, "past_mask": np.zeros((batch, 0), dtype=np.int64), **{p: empty for p, _ in self.caches}}
        out = self.fused.run(feeds, fetch=[*wanted, *(present for _, present in self.caches)])
        new = np.stack([out[present].numpy() for _, present in self.caches])
        return {**{name: out[name] for name in wanted},
                "new_kv": _HostArray(new.reshape(self.layers, 2, *new.shape[1:]))}


def runtime(bundle: Path, rows: bool) -> Runtime:
    rt = Runtime(bundle, spin=True)
    if rows:
        v = rt.backend.verifier
        rt.backend.verifier = RowFused(v.fused, v._load_portable)
    return rt


def int8_copy(src: Path, dst: Path) -> Path:
    """src with int8 activations in its verifier's layers (dspark-export quantize --accuracy-level 4)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    subprocess.run([shutil.which("dspark-export") or "dspark-export", "quantize", str(dst), "--graphs", "verifier",
                    "--accuracy-level", "4"], check=True, capture_output=True)
    return dst


def greedy(rt: Runtime, prompts: list[list[int]], batch: int, policy: str, tokens: int, context: int) -> list:
    out = []
    for start in range(0, len(prompts), batch):
        dec = Decoder(rt.backend, rt.manifest, prompts[start:start + batch],
                      DecodeOptions(max_tokens=tokens, policy=policy, batch_size=batch), capacity=context)
        got = [[] for _ in prompts[start:start + batch]]
        for event in dec:
            got[event.request] += list(event.token_ids)
        out += got
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "row_attention.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/row_attention"))
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    int8 = int8_copy(args.bundle, args.work / "int8")
    variants = {  # name: (bundle, row attention)
        "fp32_gqa": (args.bundle, False), "int8_gqa_lanes": (int8, False),
        "fp32_rows": (row_attention_bundle(args.bundle, args.work / "fp32_rows"), True),
        "int8_rows": (row_attention_bundle(int8, args.work / "int8_rows"), True),
    }
    rt0 = Runtime(args.bundle)
    prompts = [rt0.encode(r["prompt"]) for r in dev_rows(None, per_domain=3)][:8]
    rt0.close()
    exact = {}
    for name, (bundle, rows) in variants.items():
        rt = runtime(bundle, rows)
        ar = greedy(rt, prompts, 1, "ar", 48, args.max_context)
        checks = {"dspark_b1": greedy(rt, prompts, 1, "all", 48, args.max_context),
                  "ar_b8": greedy(rt, prompts, 8, "ar", 48, args.max_context),
                  "dspark_b8": greedy(rt, prompts, 8, "all", 48, args.max_context)}
        exact[name] = {k: sum(a == b for a, b in zip(ar, got)) for k, got in checks.items()} | {"prompts": len(ar)}
        print(name, exact[name], flush=True)
        rt.close()
    speed = {name: {"c1": [], "c8": []} for name in variants}
    for rep in range(args.reps):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            rt = runtime(*variants[name])
            for c in (1, 8):
                speed[name][f"c{c}"].append(tokens_per_s(rt, prompts, [c], args.max_tokens, args.max_context)[c])
            rt.close()
        print(json.dumps({"rep": rep, "speed": speed}), flush=True)
    report = {"bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "greedy_equal_to_ar_b1": exact,
              "engine_tokens_per_s": {name: {c: {"median": round(float(np.median(v)), 2), "runs": [round(x, 2)
                                                                                               for x in v]}
                                             for c, v in by.items()} for name, by in speed.items()}}
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("greedy_equal_to_ar_b1", "engine_tokens_per_s")}, indent=1))


if __name__ == "__main__":
    main()
