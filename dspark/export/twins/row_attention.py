"""The fused verifier with its attention written as MatMul / Softmax over the cache's columns ("row attention"):
every step shape of any number of requests in one call, each query row computed alike whatever rows share it.

ONNX Runtime's CPU GroupQueryAttention refuses several positions per request at batch > 1 and computes a
one-position step on another path than a longer one; a verifier whose MatMulNBits round activations to int8 turns
that rounding into other tokens, so the GroupQueryAttention graph runs such steps request by request (lanes,
dspark.export.twins.fused_lanes). Here a layer's attention is

    q, k, v [B, S, *] --> RotaryEmbedding at each row's position
        k, v --> ScatterND into past.{l}.* at (request, head, position)  = present.{l}.* (bound in place)
        q [B, Hkv, G*S, hd] x present.key^T [B, Hkv, hd, W] --> + mask (column <= own position) --> Softmax
            --> x present.value [B, Hkv, W, hd] --> [B, S, heads * hd]

over the cache's whole width W. A score is a dot product of one query and one key; a masked column's weight is
exactly 0 and adds nothing to the sums, whatever W, the batch or the step's length (checked bit for bit on ONNX
Runtime 1.24's CPU kernels): a request's tokens do not depend on the requests beside it or on how many positions a
step verifies, int8 activations included. Its cost grows with W, which is why the runtime's host caches are as
wide as the longest live request (dspark.runtime.kv.HostKV.fit), not the session's capacity.

The graph says what it is in its metadata (ATTENTION_KEY = "rows"), which the runtime reads.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dspark.export.twins.fused_lanes import rope_tables
from dspark.export.twins.ort_fused import MS, _FusedVerifier, _inv_freq, _weight
from dspark.runtime.fused_verifier import ATTENTION_KEY


class RowAttentionVerifier(_FusedVerifier):
    """_FusedVerifier with one lane and the attention above; the rest of the layer is the same graph."""

    padded = False  # every row is computed alike: no _PadToTwo

    def _lengths_and_rope(self) -> tuple[ir.Value, ...]:
        """Each row's position, the RoPE tables up to the last, the mask of the columns each row sees and where the
        step's new K/V go in the cache."""
        b = self.b
        zero, one, step = (b.const(np.array(v, np.int64), n) for v, n in ((0, "zero"), ([1], "one"), (1, "step")))
        tokens = b.input("tokens")
        past_len = b.add("ReduceSum", [b.input("past_mask"), one], keepdims=1)[0]  # [B, 1]
        seq = b.add("Shape", [tokens], start=1, end=2)[0]
        self.positions = b.add("Add", [past_len, b.add("Range", [zero, b.add("Squeeze", [seq])[0], step])[0]])[0]
        end = b.add("Add", [b.add("ReduceMax", [self.positions], keepdims=0)[0], step])[0]
        self.cos, self.sin = rope_tables(b, end, _weight(b, _inv_freq(self.g)))
        width = b.add("Shape", [b.input("past.0.key")], start=2, end=3)[0]
        columns = b.add("Range", [zero, b.add("Squeeze", [width])[0], step])[0]
        limit = b.add("Unsqueeze", [b.add("Add", [self.positions, one])[0], b.const(np.array([2], np.int64), "a2")])[0]
        seen = b.add("Where", [b.add("Less", [columns, limit])[0], b.const(np.array(0.0, np.float32), "zero_f"),
                               b.const(np.array(-np.inf, np.float32), "neg_inf")])[0]  # [B, S, W]
        self.mask = b.add("Unsqueeze", [seen, b.const(np.array([1, 2], np.int64), "a12")])[0]  # [B, 1, 1, S, W]
        batch = b.add("Shape", [tokens], start=0, end=1)[0]
        grid = b.add("Concat", [batch, b.const(np.array([self.kv_heads], np.int64), "kvh"), seq, one], axis=0)[0]
        request = b.add("Reshape", [b.add("Range", [zero, b.add("Squeeze", [batch])[0], step])[0],
                                    b.const(np.array([-1, 1, 1, 1], np.int64), "b_shape")])[0]
        head = b.const(np.arange(self.kv_heads, dtype=np.int64).reshape(1, -1, 1, 1), "h_idx")
        position = b.add("Unsqueeze", [self.positions, b.const(np.array([1, 3], np.int64), "a13")])[0]
        at = [b.add("Expand", [v, grid])[0] for v in (request, head, position)]
        self.scatter_at = b.add("Concat", at, axis=3)[0]  # [B, Hkv, S, 3]
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
        by_group = b.add("Concat", [b.add("Shape", [scores], start=0, end=2)[0],
                                    b.const(np.array([group, -1], np.int64), "gs"),
                                    b.add("Shape", [scores], start=3, end=4)[0]], axis=0)[0]
        scores = b.add("Add", [b.add("Reshape", [scores, by_group])[0], self.mask])[0]  # [B, Hkv, G, S, W]
        weights = b.add("Softmax", [scores], axis=-1)[0]
        flat = b.add("Concat", [b.add("Shape", [q], start=0, end=3)[0], b.const(np.array([-1], np.int64), "m1")],
                     axis=0)[0]
        out = b.add("MatMul", [b.add("Reshape", [weights, flat])[0], present[1]])[0]  # [B, Hkv, G*S, hd]
        out = b.add("Reshape", [out, b.const(np.array([0, 0, group, -1, hd], np.int64), "og")])[0]
        out = b.add("Transpose", [out], perm=[0, 3, 1, 2, 4])[0]  # [B, S, Hkv, G, hd]
        return b.add("Reshape", [out, b.const(np.array([0, 0, -1], np.int64), "of")])[0]

    def _model(self) -> ir.Model:
        model = super()._model()
        model.metadata_props[ATTENTION_KEY] = "rows"
        return model
