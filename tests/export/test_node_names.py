"""Every node of every graph a bundle holds is named by where it belongs: a path (target/layers.1/mlp/up_proj/MatMul,
fused/layers.1/attn/GroupQueryAttention), unique in its model, in the traced graphs, their ONNX Runtime twins and
the graphs quantize rewrites."""
import shutil
from collections import Counter

import onnx
import pytest

from dspark.bundle import Manifest
from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
from dspark.export.stamp import LAYER
from support.tiny import tiny_bundle


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of the graph, of its subgraphs (If branches) and of its functions."""
    found, graphs = [], [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            found.append(node)
            for a in node.attribute:
                graphs += [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
    return found + [node for f in model.functions for node in f.node]


def _names(bundle) -> dict[str, list[str]]:
    """graph -> its node names, for every graph of the bundle; checks each is a unique path."""
    out = {}
    for graph, spec in Manifest.read(bundle).graphs.items():
        nodes = _nodes(onnx.load(str(bundle / spec.file), load_external_data=False))
        names = [n.name for n in nodes]
        assert all(names), f"{graph}: unnamed {[n.op_type for n in nodes if not n.name][:5]}"
        assert all("/" in name for name in names), f"{graph}: not namespaced {[n for n in names if '/' not in n][:5]}"
        twice = [name for name, count in Counter(names).items() if count > 1]
        assert not twice, f"{graph}: named twice {twice[:5]}"
        assert not any(p.key == LAYER for n in nodes for p in n.metadata_props)  # (the exporter's own mark)
        out[graph] = names
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """A tiny Llama bundle (head_dim 16: a fused verifier), and a copy whose heads are quantized, its verifier kept
    as GGUF blocks (Q4_1 minimum terms, block sums) and its draft by onnxruntime (the fused twin then in lanes)."""
    import test_quantize_verifier as gguf_tests

    root = tmp_path_factory.mktemp("names")
    *_, fp32 = tiny_bundle(root / "fp32", family="llama", vocab=24, layers=2, block_size=4, seed=5, hidden=64)
    q = root / "q"
    shutil.copytree(fp32, q)
    vocab, gguf_tests.V = gguf_tests.V, 24  # that module's tiny vocabulary, for this bundle only
    try:
        gguf_tests.make_gguf_target(q, root / "tiny.gguf")
    finally:
        gguf_tests.V = vocab
    quantize_bundle(q, ["heads"], QuantizeOptions(min_elements=0, agreement_prompts=0))
    quantize_bundle(q, ["verifier", "draft"], QuantizeOptions(bits=4, min_elements=0, agreement_prompts=0))
    return fp32, q


def test_every_node_is_named_by_where_it_belongs(bundles):
    fp32, q = bundles
    names = _names(fp32)
    assert set(names) == {"verifier", "draft", "heads", "verifier_fused", "heads_greedy", "sampler"}
    assert "target/layers.1/self_attn/q_proj/MatMul" in names["verifier"]  # a stamped layer's own path
    assert "target/layers.1/mlp/down_proj/MatMul" in names["verifier"]
    assert any(n.startswith("dims/batch/") for n in names["verifier"])  # the shared dimension sizes
    assert any(n.startswith("verifier/") for n in names["verifier"])  # the graph's own code (acceptance)
    assert any(n.startswith("drafter/layers.0/self_attn/") for n in names["draft"])
    assert any(n.startswith("ConfidenceTruncate/") for n in names["heads"])  # its function's body
    assert any(n.endswith("/greedy") for n in names["heads_greedy"])
    assert "fused/layers.1/attn/GroupQueryAttention" in names["verifier_fused"]
    assert "fused/target/layers.1/mlp/up_proj/MatMul" in names["verifier_fused"]  # copied: its portable name


def test_quantized_graphs_and_their_twins_name_the_new_nodes_too(bundles):
    fp32, q = bundles
    names = _names(q)
    verifier = names["verifier"]
    assert "target/layers.1/self_attn/q_proj/MatMulNBits" in verifier
    assert "target/layers.1/self_attn/q_proj/mins/Add" in verifier  # a Q4_1 minimum term
    assert any("/blocksum32/" in n for n in verifier)
    assert any(n.endswith("/MatMulNBits") for n in names["draft"]) and any(
        n.endswith("/MatMulNBits") for n in names["heads"])
    fused = names["verifier_fused"]
    assert "fused/layers.1/qkv_proj/MatMulNBits" in fused and "fused/layers.1/gate_up_proj/MatMulNBits" in fused
    assert "fused/layers.1/attn/ScatterND" in fused and "fused/layers.1/attn/Softmax" in fused  # row attention
    assert Manifest.read(q).quantized["verifier"]["matmuls"][0] == "target/layers.0/self_attn/q_proj/MatMul"
