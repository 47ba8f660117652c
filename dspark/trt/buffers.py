"""Buffer plan and stream schedule of the GPU runtime (pure logic, unit-tested without a GPU).

Device buffers are allocated once at the profile maxima and bound once (set_tensor_address). The host only moves
small tensors (token ids, lengths, counts); those live in pinned host memory, double-buffered, so the copies of one
step can be in flight while the host reads the previous step's results. Two micro-batches run in ping-pong: while
micro-batch A's engines run on the compute stream, B's host<->device copies run on the copy stream, and vice versa.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.bundle import Manifest
from dspark.trt.profiles import Profile

HOST_VISIBLE = {  # graph -> tensors the host writes (inputs) or reads (outputs) every step
    "verifier": ({"tokens", "logit_index", "verify_len", "temperature", "accept_noise", "sample_noise"},
                 {"accepted", "next_token"}),
    "draft": ({"ctx_count", "anchor"}, set()),
    "heads": ({"temperature", "draft_noise", "threshold", "budget", "mode", "layout"},
              {"draft_tokens", "verify_len", "survival"}),
}


@dataclass(frozen=True)
class Buffer:
    graph: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    host_visible: bool
    direction: str  # "in" or "out"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass
class BufferPlan:
    buffers: list[Buffer] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def pinned_bytes(self) -> int:
        """Host-visible tensors, two copies each (double buffering), per micro-batch."""
        return 2 * sum(b.nbytes for b in self.buffers if b.host_visible)

    def by_graph(self, graph: str) -> list[Buffer]:
        return [b for b in self.buffers if b.graph == graph]


def plan_buffers(man: Manifest, profiles: dict[str, list[Profile]]) -> BufferPlan:
    """One device buffer per engine I/O tensor at the largest shape any profile allows."""
    plan = BufferPlan()
    for graph, spec in man.graphs.items():
        ins, outs = HOST_VISIBLE.get(graph, (set(), set()))
        maxima = {}
        for prof in profiles[graph]:
            for name, (_, _, hi) in prof.shapes.items():
                prev = maxima.get(name)
                maxima[name] = hi if prev is None else tuple(max(a, b) for a, b in zip(prev, hi))
        for t in spec.inputs:
            plan.buffers.append(Buffer(graph, t.name, maxima[t.name], t.dtype, t.name in ins, "in"))
        for t in spec.outputs:
            shape = tuple(_output_dim(d, maxima, man) for d in t.shape)
            plan.buffers.append(Buffer(graph, t.name, shape, t.dtype, t.name in outs, "out"))
    return plan


def _output_dim(d, maxima: dict, man: Manifest) -> int:
    if isinstance(d, int):
        return d
    bound = {"batch": max(s[0] for n, s in maxima.items() if n in ("tokens", "hidden", "ctx_features")),
             "seq": maxima["tokens"][1] if "tokens" in maxima else man.block_size + 1,
             "ctx": maxima["ctx_features"][1] if "ctx_features" in maxima else 1}
    if d not in bound:
        raise ValueError(f"no bound for output axis {d}")
    return bound[d]


@dataclass(frozen=True)
class Op:
    stream: str  # "compute" or "copy"
    kind: str  # "h2d", "engines", "d2h", "host"
    micro_batch: int
    step: int
    slot: int  # which half of the double-buffered pinned memory
    waits_for: tuple[int, ...] = ()  # indices of earlier ops (events) this op waits on


def pingpong_schedule(steps: int) -> list[Op]:
    """The issue order of `steps` decode steps of two micro-batches (a two-stage software pipeline).

    Compute stream: engines(0, s), engines(1, s), engines(0, s+1), ... While micro-batch 0's engines run, the copy
    stream downloads micro-batch 1's previous results and uploads its next inputs (the host reads and prepares in
    between), and the other way round, so copies and host work hide behind the other micro-batch's engines.
    Pinned slot s % 2 is rewritten only after the host read the results that last used it (step s - 2), and a
    step's inputs wait for the host to have read the previous step's results.
    """
    ops: list[Op] = []
    idx: dict[tuple[str, int, int], int] = {}

    def add(stream: str, kind: str, mb: int, step: int, deps: list[tuple[str, int, int]]) -> None:
        ops.append(Op(stream, kind, mb, step, step % 2, tuple(idx[d] for d in deps if d in idx)))
        idx[(kind, mb, step)] = len(ops) - 1

    def download(mb: int, step: int) -> None:
        add("copy", "d2h", mb, step, [("engines", mb, step)])
        add("host", "host", mb, step, [("d2h", mb, step)])

    def upload(mb: int, step: int) -> None:
        add("copy", "h2d", mb, step, [("host", mb, step - 1), ("host", mb, step - 2)])

    upload(0, 0)
    for step in range(steps):
        add("compute", "engines", 0, step, [("h2d", 0, step), ("engines", 0, step - 1)])
        if step > 0:
            download(1, step - 1)
        upload(1, step)
        add("compute", "engines", 1, step, [("h2d", 1, step), ("engines", 1, step - 1)])
        download(0, step)
        if step + 1 < steps:
            upload(0, step + 1)
    download(1, steps - 1)
    return ops


def simulate(ops: list[Op], cost: dict[str, float]) -> dict:
    """Event-driven timing of a schedule: each stream runs its ops in order, an op starts when its stream is free
    and its dependencies are done. Returns the makespan and how much copy time overlapped engine time."""
    free = {"compute": 0.0, "copy": 0.0, "host": 0.0}
    done: list[float] = []
    intervals: dict[str, list[tuple[float, float]]] = {"compute": [], "copy": []}
    for op in ops:
        start = max([free[op.stream]] + [done[i] for i in op.waits_for])
        end = start + cost[op.kind]
        free[op.stream] = end
        done.append(end)
        if op.stream in intervals:
            intervals[op.stream].append((start, end))
    overlap = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in intervals["copy"] for s2, e2 in intervals["compute"])
    copy_total = sum(e - s for s, e in intervals["copy"])
    return {"makespan": max(done), "copy_time": copy_total, "overlapped": overlap,
            "hidden_fraction": overlap / copy_total if copy_total else 1.0}
