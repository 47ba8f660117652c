"""One traced layer stamped once per layer writes the graph a whole-model trace writes."""
from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dspark.export.stamp import DOMAIN, LayerStack
from dspark.export.trace import onnx_export
from dspark.models.pair import Pair
from support.tiny import TinyLoaded, tiny_pair, tiny_tokenizer_folder


def _signature(path) -> collections.Counter:
    model = onnx.load(str(path), load_external_data=False)
    assert all(n.domain != DOMAIN for n in model.graph.node)
    assert DOMAIN not in {o.domain for o in model.opset_import}
    assert DOMAIN not in {f.domain for f in model.functions}
    return collections.Counter(
        (n.op_type, n.domain, tuple(sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in n.attribute)))
        for n in model.graph.node)


def _run(path, ex) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {n: a.numpy() for n, a in zip(ex.names, ex.flat_args)})


@pytest.mark.parametrize("family,graph", [("qwen3", "verifier"), ("llama", "draft")])
def test_stamped_graph_is_the_whole_trace(family, graph, tmp_path, monkeypatch):
    hf, target, drafter = tiny_pair(family, vocab=40, layers=4, draft_layers=3, seed=5)
    pair = Pair(loaded=TinyLoaded(hf, tiny_tokenizer_folder(tmp_path / "tok", 40)), target=target, drafter=drafter,
                draft_source="random")
    traced = []
    layer_function = onnx_export.layer_function
    monkeypatch.setattr(onnx_export, "layer_function", lambda stack: traced.append(stack) or layer_function(stack))
    paths, outputs = {}, {}
    for stamp in (True, False):
        ex = getattr(onnx_export, f"{graph}_example")(pair)
        paths[stamp] = tmp_path / f"{stamp}" / f"{graph}.onnx"
        paths[stamp].parent.mkdir()
        onnx_export.export_graph(ex, paths[stamp], stamp=stamp)
        outputs[stamp] = _run(paths[stamp], ex)
    assert len(traced) == 1  # the stamped export traced its layers once, the other not at all
    assert _signature(paths[True]) == _signature(paths[False])
    for a, b in zip(outputs[True], outputs[False]):
        np.testing.assert_array_equal(a, b)


def test_layers_of_different_shapes_are_traced_each():
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    stack = LayerStack(torch.nn.Module(), layers, (), kv_len_input=0, kv_heads=1, head_dim=4)
    assert stack.stampable()
    layers.append(torch.nn.Linear(4, 8))
    assert not stack.stampable()
    assert not LayerStack(torch.nn.Module(), layers[:1], (), 0, 1, 4).stampable()


@pytest.mark.parametrize("graph,kinds", [("verifier", 2), ("draft", 1)])
def test_gemma4_layers_are_stamped_per_kind(graph, kinds, tmp_path, monkeypatch):
    """Sliding and full layers (other shapes, masks and RoPE; saved layer_scalar buffers) are traced once per kind."""
    from support.gemma4 import F, S, tiny_gemma4_pair

    hf, target, drafter = tiny_gemma4_pair(num_hidden_layers=6, layer_types=[S, S, F, S, S, F])
    pair = Pair(loaded=TinyLoaded(hf, tiny_tokenizer_folder(tmp_path / "tok", 96)), target=target, drafter=drafter,
                draft_source="random")
    traced = []
    layer_function = onnx_export.layer_function
    monkeypatch.setattr(onnx_export, "layer_function", lambda stack: traced.append(stack) or layer_function(stack))
    outputs = {}
    for stamp in (True, False):
        ex = getattr(onnx_export, f"{graph}_example")(pair)
        path = tmp_path / f"{stamp}" / f"{graph}.onnx"
        path.parent.mkdir()
        onnx_export.export_graph(ex, path, stamp=stamp)
        outputs[stamp] = _run(path, ex)
        _signature(path)  # no stamp op, domain or function left
    assert len(traced) == kinds
    for a, b in zip(outputs[True], outputs[False]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
