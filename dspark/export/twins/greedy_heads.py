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

import onnx
from onnx import helper

from dspark.bundle import GraphSpec, Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.twins.graph_copy import load_skeleton
from dspark.files import normal_mode
from dspark.runtime.backend import SAMPLING_INPUTS, SAMPLING_OUTPUTS

GREEDY_FILE = "heads_greedy.onnx"


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _logits_of_sampler(producer: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> str | None:
    """For the sampling ArgMax of one draft position (ArgMax(Cast(CumSum(Where(greedy, one_hot, softmax)) >= u)),
    the logits its one-hot is the argmax of; None for any other node."""
    if node.op_type != "ArgMax" or _attr(node, "keepdims", 1) != 0:
        return None
    chain = []
    value = node.input[0]
    for op in ("Cast", "GreaterOrEqual", "CumSum", "Where"):
        prev = producer.get(value)
        if prev is None or prev.op_type != op:
            return None
        chain.append(prev)
        value = prev.input[0]
    one_hot = producer.get(chain[-1].input[1])
    equal = producer.get(one_hot.input[0]) if one_hot is not None and one_hot.op_type == "Cast" else None
    if equal is None or equal.op_type != "Equal":
        return None
    argmax = [producer[v] for v in equal.input if v in producer and producer[v].op_type == "ArgMax"]
    if len(argmax) != 1 or _attr(argmax[0], "keepdims", 1) != 1:
        return None
    return argmax[0].input[0]


def greedy_heads(model: onnx.ModelProto, block_size: int) -> onnx.ModelProto:
    """The greedy twin of a heads graph (see the module docstring); `model` is left unchanged."""
    model = _copy(model)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    nodes, replaced = [], 0
    for node in graph.node:
        logits = _logits_of_sampler(producer, node)
        if logits is None:
            nodes.append(node)
            continue
        nodes.append(helper.make_node("ArgMax", [logits], list(node.output), name=f"{node.name}/greedy", axis=-1,
                                      keepdims=0))
        replaced += 1
    if replaced != block_size:
        raise DSparkError(f"greedy heads: found {replaced} samplers in the heads graph, expected one per draft "
                          f"position ({block_size})")
    nodes = [_shape_from_hidden(n) if list(n.input) == ["draft_noise"] and n.op_type == "Shape" else n
             for n in nodes]  # without a confidence head the survival is ones shaped like the noise [B, Bk]
    outputs = [o for o in graph.output if o.name not in SAMPLING_OUTPUTS]
    needed = {o.name for o in outputs}
    live = []
    for node in reversed(nodes):  # drop what only the sampling outputs needed
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # an If/Loop body's outer-scope reads
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    needed.update(i for n in sub.node for i in n.input)
    live.reverse()
    inputs = [i for i in graph.input if i.name not in SAMPLING_INPUTS]  # kept even where unused
    if needed & set(SAMPLING_INPUTS):
        raise DSparkError(f"greedy heads: the rewritten graph still reads {sorted(needed & set(SAMPLING_INPUTS))}")
    new = helper.make_graph(live, "heads_greedy", inputs, outputs,
                            initializer=[t for t in graph.initializer if t.name in needed],
                            value_info=[v for v in graph.value_info if v.name in needed])
    model.graph.CopyFrom(new)
    return model


def _shape_from_hidden(node: onnx.NodeProto) -> onnx.NodeProto:
    """Shape(draft_noise) -> Shape(hidden)[:2]: both are [B, Bk] (hidden is [B, Bk, d])."""
    return helper.make_node("Shape", ["hidden"], list(node.output), name=f"{node.name}/greedy", start=0, end=2)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


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
    onnx.save(model, str(target))  # every weight stays where heads.onnx keeps it
    normal_mode(target)
    greedy = greedy_spec(spec, GREEDY_FILE)
    greedy.sha256 = sha256_file(target)
    manifest.graphs["heads_greedy"] = greedy
    return greedy
