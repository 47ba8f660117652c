"""heads_greedy.onnx: the draft heads of a round in which every request decodes greedily, for ONNX Runtime only.

At temperature 0 the heads' distribution is the one-hot argmax of the logits (dspark.models.sampling.token_probs),
and inverse-CDF sampling of a one-hot returns its index whatever the noise. So this graph takes each position's
draft token straight from ArgMax of its logits, and drops what only sampling needs: the softmax, the CDF and the
scatter of the draft vocabulary's distribution to the full vocabulary, i.e. the `draft_probs` output and the
`temperature` / `draft_noise` inputs. The verifier then gets all-zero draft probabilities and makes the same
decisions as with the one-hot ones: a draft is accepted iff the target's argmax equals it (p(d) / max(q(d), 1e-8)
is 1e8 or 0 against noise in (0, 1]), and the correction is the target's argmax (the residual (p - q)+ of a
one-hot p and a zero q is p).

    heads.onnx:         hidden --> Markov head --> logits --> softmax/CDF(temperature, draft_noise) --> draft tokens,
                                                                 draft_probs (scattered to the full vocabulary)
    heads_greedy.onnx:  hidden --> Markov head --> logits --> ArgMax --> draft tokens (no draft_probs output)
                        both:  --> confidence head --> survival --> ConfidenceTruncate --> verify_len

On SmolLM2's demo drafter (16k draft vocabulary) a heads call takes 3.7 -> 2.1 ms at batch 1 and 19.4 -> 7.3 ms at
batch 8 on 2 CPU cores. The graph is rewritten from heads.onnx (no weight is read) and shares its data files, so a
quantized heads graph gives a quantized greedy one; TensorRT builds keep the portable heads graph.
"""
from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from dspark.bundle import GraphSpec, Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.quantize.weight_stream import load_skeleton
from dspark.export.twins.graph_copy import take_over
from dspark.files import normal_mode
from dspark.runtime.backend import SAMPLING_INPUTS, SAMPLING_OUTPUTS

GREEDY_FILE = "heads_greedy.onnx"


def _keepdims(node: ir.Node) -> int:
    return node.attributes.get_int("keepdims", 1)


def _logits_of_sampler(node: ir.Node) -> ir.Value | None:
    """For the sampling ArgMax of one draft position (ArgMax(Cast(CumSum(Where(greedy, one_hot, softmax)) >= u)),
    the logits its one-hot is the argmax of; None for any other node."""
    if node.op_type != "ArgMax" or _keepdims(node) != 0:
        return None
    chain = []
    value = node.inputs[0]
    for op in ("Cast", "GreaterOrEqual", "CumSum", "Where"):
        prev = value.producer()
        if prev is None or prev.op_type != op:
            return None
        chain.append(prev)
        value = prev.inputs[0]
    one_hot = chain[-1].inputs[1].producer()
    equal = one_hot.inputs[0].producer() if one_hot is not None and one_hot.op_type == "Cast" else None
    if equal is None or equal.op_type != "Equal":
        return None
    argmax = [v.producer() for v in equal.inputs if v.producer() is not None and v.producer().op_type == "ArgMax"]
    if len(argmax) != 1 or _keepdims(argmax[0]) != 1:
        return None
    return argmax[0].inputs[0]


def greedy_heads(model: ir.Model, block_size: int) -> ir.Model:
    """The greedy twin of a heads graph (see the module docstring): `model` (a skeleton read for this) rewritten."""
    graph = model.graph
    samplers = [(node, logits) for node in graph if (logits := _logits_of_sampler(node)) is not None]
    if len(samplers) != block_size:
        raise DSparkError(f"greedy heads: found {len(samplers)} samplers in the heads graph, expected one per draft "
                          f"position ({block_size})")
    for node, logits in samplers:
        _replace(node, ir.node("ArgMax", [logits], {"axis": -1, "keepdims": 0}, name=f"{node.name}/greedy"))
    hidden = next(v for v in graph.inputs if v.name == "hidden")
    for node in [n for n in graph if n.op_type == "Shape" and [i.name for i in n.inputs] == ["draft_noise"]]:
        # without a confidence head the survival is ones shaped like the noise [B, Bk]: Shape(hidden)[:2]
        _replace(node, ir.node("Shape", [hidden], {"end": 2, "start": 0}, name=f"{node.name}/greedy"))
    graph.outputs[:] = [o for o in graph.outputs if o.name not in SAMPLING_OUTPUTS]
    for node in reversed(list(graph)):  # drop what only the sampling outputs needed
        if not any(_read(o) for o in node.outputs):
            graph.remove(node, safe=True)
    read = sorted(v.name for v in graph.inputs if v.name in SAMPLING_INPUTS and v.uses())
    if read:
        raise DSparkError(f"greedy heads: the rewritten graph still reads {read}")
    graph.inputs[:] = [v for v in graph.inputs if v.name not in SAMPLING_INPUTS]  # the others kept even if unused
    for name, value in list(graph.initializers.items()):
        if not _read(value):
            del graph.initializers[name]
    for node in graph:  # a value nothing reads is not described
        for value in node.outputs:
            if not _read(value):
                value.type, value.shape, value.doc_string = None, None, None
                value.metadata_props.clear()
    graph.name, graph.doc_string = "heads_greedy", None
    graph.metadata_props.clear()  # (torch's record of the export describes the heads graph, not this one)
    return model


def _replace(old: ir.Node, new: ir.Node) -> None:
    """`new` in place of `old`, its outputs under the old outputs' names."""
    old.graph.insert_before(old, new)
    for was, now in zip(old.outputs, new.outputs):
        take_over(was, now)
    old.graph.remove(old, safe=True)


def _read(value: ir.Value) -> bool:
    return bool(value.uses()) or value.is_graph_output()


def greedy_spec(heads: GraphSpec, file: str) -> GraphSpec:
    return GraphSpec(file=file, inputs=[t for t in heads.inputs if t.name not in SAMPLING_INPUTS],
                     outputs=[t for t in heads.outputs if t.name not in SAMPLING_OUTPUTS])


def add_greedy_heads(folder: Path, manifest: Manifest) -> GraphSpec:
    """Write the greedy twin of folder's heads graph next to it (sharing its data files) and enter it in
    `manifest` (the caller writes the manifest)."""
    spec = manifest.graphs["heads"]
    path = Manifest.path(folder, spec.file)
    heads = load_skeleton(path)
    model = greedy_heads(heads, manifest.block_size)
    target = folder / GREEDY_FILE
    target.unlink(missing_ok=True)  # may be a hard link into another copy of the bundle
    ir.save(model, target)  # every weight stays where heads.onnx keeps it
    normal_mode(target)
    greedy = greedy_spec(spec, GREEDY_FILE)
    greedy.sha256 = sha256_file(target)
    manifest.graphs["heads_greedy"] = greedy
    return greedy
