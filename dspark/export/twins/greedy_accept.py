"""The fused verifier's acceptance when every request of a step is greedy: argmax comparisons only.

The copied acceptance (dspark.models.sampling.verify_logits) computes a softmax over the vocabulary at every row,
the row after the accepted prefix and its CDF for the draw, whatever the temperatures; at temperature 0 those only
reach the tokens through argmaxes. There the rule is: row j accepts the draft it judges (d_{j+1} =
tokens[logit_index[j] + 1]) while that draft is the row's argmax, within verify_len; the next token is the argmax
of the row after the accepted prefix. (A rejected greedy row's residual is the one-hot argmax: the draft's mass
sits elsewhere, so the correction is the argmax too; draft_probs and the noise never change a greedy decision.)
The fused graph takes that branch in an If on "every temperature is greedy" and keeps the copied acceptance for
every other step, so a greedy step skips the vocabulary-wide work (its CDF was about 1 ms of a SmolLM2 step at 8
rows) and decides exactly as the copied acceptance does, ArgMax ties included (the first index, both ways).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from dspark.export.twins.graph_copy import GraphBuilder
from dspark.noise import GREEDY_EPS

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


def greedy_or_copied(b: GraphBuilder, logits: ir.Value, copied: Callable[[], tuple[ir.Value, ir.Value]],
                     like: tuple[ir.Value, ir.Value]) -> tuple[ir.Value, ir.Value]:
    """(accepted, next_token) of the step: an If whose then-branch is the greedy rule on `logits` [B, rows, V] and
    whose else-branch is what `copied` adds (the portable verifier's acceptance, copied). like: the portable
    graph's accepted and next_token, whose types the branches' outputs take."""
    cond = b.add("Less", [b.add("ReduceMax", [b.input("temperature")], keepdims=0)[0],
                          b.const(np.array(GREEDY_EPS, np.float32), "greedy_eps")])[0]
    outer, b.nodes = b.nodes, []
    greedy = [b.add("Identity", [v])[0] for v in _greedy(b, logits)]
    then_nodes, b.nodes = b.nodes, []
    sampled = [b.add("Identity", [v])[0] for v in copied()]
    else_nodes, b.nodes = b.nodes, outer
    for outputs in (greedy, sampled):
        for value, portable in zip(outputs, like):
            value.type = portable.type
    then_graph = ir.Graph([], greedy, nodes=then_nodes, name="acceptance_greedy")
    else_graph = ir.Graph([], sampled, nodes=else_nodes, name="acceptance_sampled")
    accepted, next_token = b.add("If", [cond], 2, then_branch=then_graph, else_branch=else_graph)
    return accepted, next_token


def _greedy(b: GraphBuilder, logits: ir.Value) -> tuple[ir.Value, ir.Value]:
    one = b.const(np.array([1], np.int64), "one")
    axis1 = b.const(np.array(1, np.int64), "axis1")
    if logits.dtype not in (None, FLOAT):  # the copied acceptance takes logits.float()
        logits = b.add("Cast", [logits], to=FLOAT)[0]
    best = b.add("ArgMax", [logits], axis=-1, keepdims=0)[0]  # [B, rows]
    tokens = b.input("tokens")
    last = b.add("Sub", [b.add("Shape", [tokens], start=1, end=2)[0], one])[0]
    judged = b.add("Min", [b.add("Add", [b.input("logit_index"), one])[0], last])[0]
    drafts = b.add("GatherElements", [tokens, judged], axis=1)[0]  # d_{j+1} at row j (the last row: padding)
    rows = b.add("Range", [b.const(np.array(0, np.int64), "zero"),
                           b.add("Squeeze", [b.add("Shape", [best], start=1, end=2)[0]])[0],
                           b.const(np.array(1, np.int64), "step")])[0]
    proposed = b.add("Less", [b.add("Unsqueeze", [rows, b.const(np.array([0], np.int64), "axis0")])[0],
                              b.add("Unsqueeze", [b.input("verify_len"), one])[0]])[0]
    ok = b.add("And", [b.add("Equal", [drafts, best])[0], proposed])[0]
    misses = b.add("CumSum", [b.add("Cast", [b.add("Not", [ok])[0]], to=FLOAT)[0], axis1])[0]
    leading = b.add("Cast", [b.add("Equal", [misses, b.const(np.array(0.0, np.float32), "zero_f")])[0]], to=INT64)[0]
    accepted = b.add("ReduceSum", [leading, one], keepdims=0)[0]  # [B]
    at = b.add("Unsqueeze", [accepted, one])[0]
    next_token = b.add("Squeeze", [b.add("GatherElements", [best, at], axis=1)[0], one])[0]
    return accepted, next_token
