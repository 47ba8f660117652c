"""The bundle's weights: streamed from the checkpoint (bounded memory), stored at the chosen precision, and the
vocabulary matrix stored once for all graphs."""
from __future__ import annotations

import json

import onnx
import onnx_ir as ir
import pytest
import torch
from safetensors.torch import save_file

from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle
from dspark.export.trace.onnx_export import export_bundle
from dspark.export.trace.passes import cast_matmuls
from dspark.models.pair import load_pair
from support.tiny import tiny_hf, tiny_tokenizer_folder

VOCAB = 2100  # large enough that the graph optimizer's constant folding leaves the vocabulary matrix alone
HIDDEN = 32


def _external(bundle, graph: str) -> dict[str, tuple[str, int, int, int, tuple[int, ...]]]:
    """initializer -> (location, offset, length, data type, dims) for the graph's external tensors."""
    model = onnx.load(str(bundle / f"{graph}.onnx"), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            out[t.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]), t.data_type,
                           tuple(t.dims))
    return out


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny Llama (tied embeddings) saved in bf16, as released checkpoints are, as an HF folder with several
    safetensors shards and their index."""
    folder = tmp_path_factory.mktemp("target")
    hf = tiny_hf("llama", vocab=VOCAB, layers=3, seed=3).to(torch.bfloat16)
    hf.save_pretrained(folder, max_shard_size="100KB")
    tiny_tokenizer_folder(folder, VOCAB - 4)  # the spare ids give the drafter its mask token
    assert (folder / "model.safetensors.index.json").exists()
    return folder


@pytest.fixture(scope="module")
def bundles(target_folder, tmp_path_factory):
    out = {}
    for precision in ("fp32", "bf16"):
        pair = load_pair(str(target_folder), "random:5", lazy=True)
        assert pair.target.layers[0].self_attn.q_proj.weight.is_meta  # the target was never loaded
        out[precision] = export_bundle(pair, tmp_path_factory.mktemp(precision) / "bundle", max_context=128,
                                       quiet=True, precision=precision)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_streamed_bundle_passes_check(bundles, precision):
    report = check_bundle(bundles[precision])
    assert report.passed, [r for r in report.rows if not r.passed] or report.e2e
    assert json.loads((bundles[precision] / "manifest.json").read_text())["precision"] == precision


def test_matrices_are_stored_at_the_bundle_precision(bundles):
    types = {p: {v[3] for v in _external(bundles[p], "verifier").values() if len(v[4]) == 2} for p in bundles}
    assert types["fp32"] == {onnx.TensorProto.FLOAT}
    assert types["bf16"] == {onnx.TensorProto.BFLOAT16}
    stored = {p: sum(n for _, _, n in {v[:3] for g in ("verifier", "draft", "heads")
                                       for v in _external(bundles[p], g).values()}) for p in bundles}
    assert stored["bf16"] < 0.55 * stored["fp32"]


def test_vocabulary_matrix_is_stored_once(bundles):
    """Tied embeddings: the verifier's and the draft's embedding and the verifier's and the heads' LM head are one
    [V, d] matrix, stored once and referred to by all three graphs."""
    bundle = bundles["fp32"]
    refs = {g: _external(bundle, g) for g in ("verifier", "draft", "heads")}
    vocab = {g: {v[:3] for v in r.values() if v[4] in ((VOCAB, HIDDEN), (HIDDEN, VOCAB))} for g, r in refs.items()}
    assert all(len(v) == 1 for v in vocab.values()), vocab
    assert len(set.union(*vocab.values())) == 1
    placed = {v[:3] for r in refs.values() for v in r.values()}
    assert {loc for loc, _, _ in placed} == {"weights.data"}
    spans = sorted((off, off + n) for _, off, n in placed)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # every stored tensor is distinct
    assert spans[-1][1] <= (bundle / "weights.data").stat().st_size


def test_a_bad_shard_index_is_refused_before_loading(target_folder, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in target_folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DSparkError, match="not a .safetensors file there"):
        load_pair(str(broken), "random", lazy=True)


def test_a_checkpoint_missing_a_tensor_is_refused(target_folder, tmp_path):
    folder = tmp_path / "missing"
    folder.mkdir()
    for f in target_folder.iterdir():
        if not f.name.startswith("model"):
            (folder / f.name).write_bytes(f.read_bytes())
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}, str(folder / "model.safetensors"))
    with pytest.raises(DSparkError, match="has no tensor model.layers.0"):
        load_pair(str(folder), "random", lazy=True)


def test_tensorrt_builds_use_the_stored_precision_as_is(bundles):
    """A strongly typed TensorRT build of a bf16 bundle runs its matmuls on the stored bf16 weights: no widened
    copy, no fp32 matmul left with a constant weight."""
    model = ir.load(str(bundles["bf16"] / "verifier.onnx"))
    stored = {v.name for v in model.graph.initializers.values() if v.dtype == ir.DataType.BFLOAT16}
    assert cast_matmuls(model, "bf16") > 0
    weights = [n.inputs[1] for n in model.graph if n.op_type == "MatMul" and n.inputs[1].is_initializer()]
    assert weights and all(w.dtype == ir.DataType.BFLOAT16 for w in weights)
    assert {w.name for w in weights} <= stored
    assert not [n for n in model.graph if n.op_type == "Cast" and not n.outputs[0].uses()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mapped_weights_decode_the_same_tokens_as_packed(bundles, precision):
    """ONNX Runtime with the weights used from the mapped bundle file (no fp32 copy) computes what the packed
    sessions compute: the same greedy tokens, DSpark and AR, and check passes in that mode too."""
    from dspark.runtime import DecodeOptions, Runtime

    prompt = list(range(5, 17))
    tokens = {}
    for mode in ("packed", "mapped"):
        with Runtime(bundles[precision], weights=mode) as rt:
            assert rt.backend.weights == mode
            tokens[mode] = [rt.generate([prompt], DecodeOptions(max_tokens=12, policy=p))[0].token_ids
                            for p in ("ar", "all")]
    assert tokens["mapped"] == tokens["packed"]
    assert check_bundle(bundles[precision], weights="mapped").passed


def test_auto_weights_mode_maps_a_bundle_too_large_to_widen(bundles, monkeypatch):
    from dspark.bundle import Manifest
    from dspark.runtime import ort_backend

    bundle = bundles["bf16"]
    manifest = Manifest.read(bundle)
    stored = sum(p.stat().st_size for p in bundle.iterdir() if p.name.endswith(".data"))
    widened = 2 * stored  # bf16 -> fp32
    monkeypatch.setattr(ort_backend, "available_memory", lambda: int(widened / ort_backend.FIT_SHARE) + 1)
    assert ort_backend.weights_mode(bundle, manifest) == "packed"
    monkeypatch.setattr(ort_backend, "available_memory", lambda: int(widened / ort_backend.FIT_SHARE) - 4096)
    assert ort_backend.weights_mode(bundle, manifest) == "mapped"
    assert ort_backend.weights_mode(bundle, manifest, "packed") == "packed"  # asked for: no second guessing
    with pytest.raises(DSparkError, match="unknown weights mode"):
        ort_backend.weights_mode(bundle, manifest, "fp8")


@pytest.fixture(scope="module")
def draft_folder(target_folder, tmp_path_factory):
    """A DeepSpec-format drafter of the tiny target, saved in bf16 with a token ranking (draft_vocab.json)."""
    from dspark.models.checkpoint import save_draft
    from dspark.models.draft_vocab import write_ranking

    pair = load_pair(str(target_folder), "random:9")
    folder = save_draft(pair.drafter, tmp_path_factory.mktemp("draft") / "drafter", include_shared=False)
    write_ranking(folder, list(range(VOCAB - 1, 0, -3)), 1000, VOCAB, "test")
    return folder


def test_a_draft_checkpoint_streams_like_the_target_and_shortlists(target_folder, draft_folder, tmp_path):
    """The drafter's own weights stay in its checkpoint until written (the export holds neither model), and a
    draft vocabulary of such a drafter gathers its rows when written: the bundle passes check. 600 ids are
    enough that the heads' constants over them leave the graph file for weights.data."""
    pair = load_pair(str(target_folder), str(draft_folder), lazy=True)
    assert pair.drafter.layers[0].mlp.down_proj.weight.is_meta and pair.drafter.fc.weight.is_meta
    assert pair.drafter.inv_freq.device.type == "cpu"  # buffers come from the config, not the checkpoint
    bundle = export_bundle(pair, tmp_path / "bundle", max_context=128, quiet=True, precision="auto",
                           draft_vocab=600)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["draft"]["draft_vocab"] == 600
    assert manifest["precision"] == "bf16"  # auto: the target checkpoint's own
    report = check_bundle(bundle)
    assert report.passed, [r for r in report.rows if not r.passed] or report.e2e


def test_a_checkpoint_knows_the_precision_of_its_matrices(tmp_path):
    from dspark.models.tensors import CheckpointTensors

    def precision(**tensors):
        folder = tmp_path / "_".join(f"{k}{v.dtype}" for k, v in tensors.items()).replace("torch.", "")
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        return CheckpointTensors(folder).precision()

    bf16, fp16, fp32 = (torch.zeros(4, 4, dtype=t) for t in (torch.bfloat16, torch.float16, torch.float32))
    norm = torch.ones(4)  # vectors stay fp32 in every bundle: they do not decide
    assert precision(w=bf16, v=bf16.clone(), n=norm) == "bf16"
    assert precision(w=fp16, n=norm) == "fp16"
    assert precision(w=fp32) == "fp32"
    assert precision(w=bf16, v=fp16) == "fp32"  # mixed: the safe choice
    assert precision(w=torch.zeros(4, 4, dtype=torch.int8)) == "fp32"


def test_weight_store_drops_queued_writes_when_the_export_fails(tmp_path):
    """A failing export (an error, Ctrl-C) waits only for the write under way, not for every queued one."""
    import threading

    import numpy as np

    from dspark.export.trace.weights import WeightStore

    started, release, read = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        read.append("slow")
        return np.zeros(4, np.float32)

    def quick(i):
        def array():
            read.append(i)
            return np.zeros(4, np.float32)
        return array

    with pytest.raises(KeyboardInterrupt):
        with WeightStore(tmp_path) as store:
            store.place(("slow",), slow, ir.DataType.FLOAT, [4], "slow")
            for i in range(5):
                store.place((i,), quick(i), ir.DataType.FLOAT, [4], f"w{i}")
            started.wait(5)
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt
    assert read == ["slow"]
    assert store.file.closed

    with WeightStore(tmp_path) as store:  # on success every write lands
        for i in range(5):
            store.place((i,), quick(i), ir.DataType.FLOAT, [4], f"w{i}")
    assert (tmp_path / store.name).stat().st_size > 4 * 16


def test_auto_weights_mode_does_not_widen_quantized_blocks(tmp_path, monkeypatch):
    """Only the export's weights.data widens to fp32; a quantized graph's own data (MatMulNBits blocks) is
    counted once, so a 4-bit bundle that fits packed is not mapped (unpacked MatMulNBits runs ~40x slower); a
    fused verifier's concatenated blocks count only when the portable verifier may be loaded beside it."""
    from types import SimpleNamespace

    from dspark.runtime import ort_backend

    (tmp_path / "weights.data").write_bytes(b"\0" * 1000)
    (tmp_path / "verifier.onnx.data").write_bytes(b"\0" * 6000)
    manifest = SimpleNamespace(precision="bf16", graphs={}, quantized_activations=lambda graph: False)
    monkeypatch.setattr(ort_backend, "available_memory", lambda: int(8000 / ort_backend.FIT_SHARE) + 1)
    assert ort_backend.weights_mode(tmp_path, manifest) == "packed"  # 2 x 1000 + 6000 fits
    monkeypatch.setattr(ort_backend, "available_memory", lambda: int(8000 / ort_backend.FIT_SHARE) - 10)
    assert ort_backend.weights_mode(tmp_path, manifest) == "mapped"

    # a fused verifier's concatenated blocks: counted beside the portable verifier's when a step of several
    # requests may load the portable session too, once when the fused graph takes every step
    (tmp_path / "verifier_fused.onnx.data").write_bytes(b"\0" * 3000)
    manifest.graphs = {"verifier_fused": SimpleNamespace(file="verifier_fused.onnx", inputs=[])}
    assert ort_backend.packed_bytes(tmp_path, manifest) == 11000
    manifest.graphs["verifier_fused"].inputs = [SimpleNamespace(name=n) for n in ("tokens", "lane1.past.0.key")]
    assert ort_backend.packed_bytes(tmp_path, manifest) == 8000  # with lanes it takes every step
    manifest.graphs["verifier_fused"].inputs = []
    manifest.quantized_activations = lambda graph: graph == "verifier"
    assert ort_backend.packed_bytes(tmp_path, manifest) == 8000
    monkeypatch.setattr(ort_backend, "available_memory", lambda: int(8000 / ort_backend.FIT_SHARE) + 1)
    assert ort_backend.weights_mode(tmp_path, manifest) == "packed"
