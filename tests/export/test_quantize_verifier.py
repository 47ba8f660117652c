"""A quantized verifier (and draft backbone): a tiny target made from a GGUF keeps the file's own blocks, an HF
target goes through onnxruntime's quantizer; either way DSpark stays exact with respect to the quantized verifier
(greedy equals its own autoregressive output, sampling follows its distribution)."""
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from onnx import numpy_helper

from dspark.bundle import Manifest, sha256_file
from dspark.cli import export_cli
from dspark.errors import DSparkError
from dspark.export.quantize.agreement import LogitsGraph, logits_name
from dspark.export.quantize.nbits_graph import constant_matmul_weights
from dspark.export.quantize.bundle import QuantizeOptions, gguf_source, quantize_bundle
from dspark.runtime import DecodeOptions, Runtime
from support.stats import chi_square_pvalue
from test_bundle_tiny import PROMPT, V, prompts
from test_quantize import sample_paths

SAMPLES = 12000  # half the fp32 bundle's chi-square test

# HF projection -> (llama.cpp name, format) for each layer's matrices of the tiny target
LAYER_FORMATS = {"q_proj": ("attn_q", "Q4_1"), "k_proj": ("attn_k", "Q4_1"), "v_proj": ("attn_v", "Q4_0"),
                 "o_proj": ("attn_output", "Q4_1"), "gate_proj": ("ffn_gate", "Q4_1"), "up_proj": ("ffn_up", "Q4_0"),
                 "down_proj": ("ffn_down", "Q4_1")}
AGREEMENT = dict(agreement_prompts=3, agreement_tokens=8)


def gguf_name(source: str, vocab_sized: bool) -> tuple[str, str]:
    if vocab_sized:
        return "token_embd.weight", "Q8_0"  # tied to the embedding, as SmolLM2's
    layer, proj = re.search(r"layers\.(\d+)\.\w+\.(\w+_proj)", source).groups()
    short, fmt = LAYER_FORMATS[proj]
    return f"blk.{layer}.{short}.weight", fmt


def make_gguf_target(bundle: Path, path: Path) -> None:
    """Turn a tiny fp32 bundle into one exported from a GGUF: quantize its verifier's matrices into a GGUF file
    (Q4_1 and Q4_0 layers, a Q8_0 embedding tied to the LM head) and give the verifier the file's dequantized
    weights, as exporting that GGUF would; record the file as the bundle's target source."""
    model = onnx.load(str(bundle / "verifier.onnx"))
    vocab = Manifest.read(bundle).target["vocab_size"]
    inits = {i.name: i for i in model.graph.initializer}
    writer = GGUFWriter(str(path), "llama")
    for w in constant_matmul_weights(ir.serde.deserialize_model(model)):
        name, fmt = gguf_name(w.source, w.shape[1] == vocab)
        qtype = GGMLQuantizationType[fmt]
        raw = quantize(np.ascontiguousarray(w.weight.T), qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        rows = dequantize(raw, qtype).reshape(w.shape[1], w.shape[0])  # [N, K]
        stored = rows.T if w.node.inputs[1].name == w.source else rows  # a direct [K, N] weight, or one read transposed
        inits[w.source].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(stored), w.source))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    onnx.save(model, str(bundle / "verifier.onnx"), save_as_external_data=True, location="verifier.onnx.data")
    manifest = Manifest.read(bundle)
    manifest.graphs["verifier"].sha256 = sha256_file(bundle / "verifier.onnx")
    manifest.sources["target"] = {"name": "tiny-gguf", "file": str(path), "sha256": sha256_file(path)}
    manifest.write(bundle)


@pytest.fixture(scope="module")
def gguf_bundle(tiny_bundle_v6, tmp_path_factory):
    """The tiny bundle made a GGUF target's, then quantized: verifier from the GGUF's blocks, draft backbone by
    onnxruntime at 4 bits."""
    root = tmp_path_factory.mktemp("gguf-bundle")
    fp32, quantized = root / "fp32", root / "q"
    shutil.copytree(tiny_bundle_v6[3], fp32)
    make_gguf_target(fp32, root / "tiny.gguf")
    shutil.copytree(fp32, quantized)
    records = quantize_bundle(quantized, ["verifier", "draft"], QuantizeOptions(bits=4, min_elements=0, **AGREEMENT))
    return fp32, quantized, records


def test_the_verifier_keeps_the_gguf_blocks_exactly(gguf_bundle):
    fp32, q, records = gguf_bundle
    blocks = records["verifier"]["gguf_blocks"]
    assert blocks["formats"] == {"Q8_0": 1, "Q4_1": 10, "Q4_0": 4}
    assert blocks["names_agree"] >= 14  # the layers' names say what they are (a tied LM head's may not)
    assert blocks["max_abs_weight_diff"] == {"Q8_0": 0.0, "Q4_1": 0.0, "Q4_0": 0.0}
    assert "onnxruntime_quantizer" not in records["verifier"]  # every matrix came from the file
    assert records["verifier"]["matmulnbits"] == {"4-bit, accuracy_level 0": 14, "8-bit, accuracy_level 4": 1}
    assert records["draft"]["matmulnbits"] == {"4-bit, accuracy_level 4": 10}  # the draft side: int8 activations
    assert records["draft"]["onnxruntime_quantizer"]["matmuls"]
    ops = Counter(n.op_type for n in onnx.load(str(q / "verifier.onnx"), load_external_data=False).graph.node)
    assert ops["MatMulNBits"] == 15 and ops["ReduceSum"] >= 2 * 3  # Q4_1 minimum terms, one block sum per input
    man = Manifest.read(q)
    assert set(man.quantized) == {"verifier", "draft"} and man.graphs["verifier"].sha256 == sha256_file(
        q / "verifier.onnx")
    assert "sps_table" not in man.calibration
    agreement = records["verifier"]["agreement"]
    assert agreement["prompts"] == 3 and agreement["positions"] == 24 and 0.5 <= agreement["top1"] <= 1.0
    assert not Manifest.read(fp32).quantized  # the source bundle is untouched


@pytest.mark.parametrize("batch", [None, 1, 4])
def test_greedy_dspark_equals_the_quantized_verifiers_own_ar(gguf_bundle, batch):
    _, q, _ = gguf_bundle
    rt = Runtime(q)
    ps = prompts(8, seed=9)
    options = DecodeOptions(max_tokens=20, batch_size=batch)
    ar = [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
    ds = rt.generate(ps, options)
    assert [r.token_ids for r in ds] == ar
    assert any(a > 0 for r in ds for a in r.accepted)


def quantized_joint(fp32, bundle, prompt, depth):
    """P(t_1..t_depth | prompt) at temperature 1 under the bundle's verifier graph itself (its logits)."""
    graph = LogitsGraph(bundle, Manifest.read(bundle), logits_name(fp32))
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in joint.items():
            z = graph.logits(prompt + list(prefix))[-1].astype(np.float64)
            probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            nxt.update({prefix + (v,): p * float(probs[v]) for v in range(V)})
        joint = nxt
    return joint


def test_sampling_follows_the_quantized_verifier(gguf_bundle):
    fp32, q, _ = gguf_bundle
    expected = quantized_joint(fp32, q, PROMPT, 3)
    stop = set(Runtime(q).manifest.stop_token_ids)
    keep = {k: p for k, p in expected.items() if not stop.intersection(k[:2])}
    samples, results = sample_paths(q, SAMPLES, 404)
    assert len(samples) > 0.5 * SAMPLES
    assert chi_square_pvalue(samples, keep) > 1e-3
    assert np.mean([a for r in results for a in r.accepted]) > 0.1


def test_an_hf_target_goes_through_onnxruntimes_quantizer(tiny_bundle_v6, tmp_path):
    q = tmp_path / "q"
    shutil.copytree(tiny_bundle_v6[3], q)
    rec = quantize_bundle(q, ["verifier"], QuantizeOptions(bits=4, block_size=16, min_elements=0, **AGREEMENT))
    rec = rec["verifier"]
    assert "gguf_blocks" not in rec  # no GGUF behind this bundle
    # fp32 activations for the 4-bit weights (exactness), int8 for the 8-bit head (ONNX Runtime's fast path)
    assert rec["onnxruntime_quantizer"]["matmuls"] == {"4-bit, accuracy_level 0": 14, "8-bit, accuracy_level 4": 1}
    rt = Runtime(q)
    ps = prompts(6, seed=4)
    ar = [r.token_ids for r in rt.generate(ps, DecodeOptions(max_tokens=16, policy="ar"))]
    assert [r.token_ids for r in rt.generate(ps, DecodeOptions(max_tokens=16))] == ar


def test_cli_prints_the_agreement_and_refuses_bad_requests(gguf_bundle, tmp_path):
    fp32 = gguf_bundle[0]
    b = tmp_path / "b"
    shutil.copytree(fp32, b)
    runner = CliRunner()
    out = runner.invoke(export_cli, ["quantize", str(b), "--graphs", "verifier", "--min-elements", "0",
                                     "--agreement-prompts", "2", "--agreement-tokens", "4"])
    assert out.exit_code == 0, out.output
    assert "GGUF blocks" in out.output and "top-1 agreement" in out.output
    assert Manifest.read(b).quantized["verifier"]["agreement"]["positions"] == 8
    for args, message in ((["--graphs", "verifier,nothing"], "nothing"), (["--graphs", "verifier"], "already"),
                          (["--graphs", "draft", "--block-size", "24"], "power of two")):
        out = runner.invoke(export_cli, ["quantize", str(b), *args])
        assert out.exit_code == 2 and message in out.output, out.output
    with pytest.raises(DSparkError, match="not the GGUF"):
        gguf_source(Manifest.read(fp32), str(fp32 / "verifier.onnx"))
    assert gguf_source(Manifest.read(fp32), "off") is None


def test_a_reference_too_big_to_pack_is_scored_mapped_one_verifier_at_a_time(gguf_bundle, monkeypatch):
    """A reference whose weights would not fit widened to fp32 (Qwen3-4B bf16: 16 GB) is scored with its weights
    mapped, on the quantized bundle's own greedy text, and never beside the quantized verifier."""
    import weakref

    from dspark.export.quantize import agreement

    fp32, q, _ = gguf_bundle
    live, modes = weakref.WeakSet(), {}

    class Spy(LogitsGraph):
        def __init__(self, folder, manifest, logits, threads=None, weights="packed"):
            assert not list(live)  # the other verifier is gone
            super().__init__(folder, manifest, logits, threads, weights)
            live.add(self)
            modes[Path(folder)] = weights

    monkeypatch.setattr(agreement, "LogitsGraph", Spy)
    packed = agreement.measure_agreement(fp32, q, prompts=3, max_tokens=8)
    assert packed.text_from == "reference" and modes == {Path(fp32): "packed", Path(q): "packed"}
    monkeypatch.setattr(agreement, "weights_mode", lambda folder, manifest: "mapped")
    mapped = agreement.measure_agreement(fp32, q, prompts=3, max_tokens=8)
    assert mapped.text_from == "quantized" and modes == {Path(fp32): "mapped", Path(q): "packed"}
    assert mapped.positions == packed.positions == 24 and 0.5 <= mapped.top1 <= 1.0


def test_quantize_scores_a_mapped_reference_on_the_finished_staged_bundle(gguf_bundle, tmp_path, monkeypatch):
    """Quantizing a bundle too big to pack (a 12B bf16 one) decodes the staged quantized bundle for the agreement
    text: it must be complete (graphs, twins, manifest) by then, and the record lands in the manifest."""
    from dspark.export.quantize import agreement

    b = tmp_path / "b"
    shutil.copytree(gguf_bundle[0], b)
    monkeypatch.setattr(agreement, "weights_mode", lambda folder, manifest: "mapped")
    records = quantize_bundle(b, ["verifier"], QuantizeOptions(bits=4, min_elements=0, **AGREEMENT))
    assert records["verifier"]["agreement"]["text_from"] == "quantized"
    manifest = Manifest.read_checked(b)
    manifest.check_files(b, full=True)
    assert manifest.quantized["verifier"]["agreement"] == records["verifier"]["agreement"]


@pytest.fixture(scope="module")
def fusable_gguf(tmp_path_factory):
    """A tiny Llama pair whose verifier can be fused (head_dim 16) made a GGUF target's, not quantized."""
    from support.tiny import tiny_bundle

    root = tmp_path_factory.mktemp("fusable-gguf")
    *_, bundle = tiny_bundle(root / "bundle", family="llama", vocab=24, layers=2, block_size=4, seed=5, hidden=64)
    make_gguf_target(bundle, root / "tiny.gguf")
    return bundle


def test_the_demo_quantizes_its_own_bundle_for_cpu_once(fusable_gguf, gguf_bundle, tmp_path):
    from dspark.demo import add_missing_twins, bundle_label, quantize_for_cpu
    from dspark.export.quantize.bundle import relevel_bundle

    bundle = tmp_path / "demo"
    shutil.copytree(fusable_gguf, bundle)
    said = []
    quantize_for_cpu(bundle, said.append, min_elements=0, **AGREEMENT)
    manifest = Manifest.read(bundle)
    assert manifest.quantized["heads"]["bits"] == 8
    blocks = manifest.quantized["verifier"]["gguf_blocks"]
    assert set(blocks["formats"]) == {"Q4_1", "Q4_0", "Q8_0"} and set(blocks["max_abs_weight_diff"].values()) == {0}
    assert manifest.quantized["verifier"]["layer_accuracy_levels"] == [4]  # int8 activations, as llama.cpp's
    add_missing_twins(bundle, manifest, said.append)  # (as the demo does next)
    assert Runtime(bundle).backend.verifier.rows  # row attention: batches stay batched, each request exact
    assert "verifier on the GGUF's own" in bundle_label(manifest) and "8-bit heads" in bundle_label(manifest)
    assert any("GGUF blocks" in line for line in said)
    before = (bundle / "manifest.json").read_bytes()
    quantize_for_cpu(bundle, said.append)  # once: a quantized bundle is left as it is
    assert (bundle / "manifest.json").read_bytes() == before
    options = DecodeOptions(max_tokens=12, policy="all", batch_size=2)
    with Runtime(bundle) as rt:
        assert [r.token_ids for r in rt.generate(prompts(3), options)] == \
            [r.token_ids for r in rt.generate(prompts(3), DecodeOptions(max_tokens=12, policy="ar"))]
    # a demo bundle quantized before the demo rounded activations: its levels change, its weights stay
    manifest = Manifest.read(bundle)
    relevel_bundle(bundle, manifest, ["verifier"], QuantizeOptions(accuracy_level=0))
    data = (bundle / f"{manifest.graphs['verifier'].file}.data").stat().st_ino
    said.clear()
    quantize_for_cpu(bundle, said.append)
    assert Manifest.read(bundle).quantized["verifier"]["layer_accuracy_levels"] == [4]
    assert any("activations to int8" in line for line in said)
    assert (bundle / f"{manifest.graphs['verifier'].file}.data").stat().st_ino == data
    # a target no fused verifier takes (head_dim 8) keeps fp32 activations, which its portable verifier keeps exact
    other = tmp_path / "unfusable"
    shutil.copytree(gguf_bundle[0], other)
    quantize_for_cpu(other, said.append, min_elements=0, **AGREEMENT)
    assert Manifest.read(other).quantized["verifier"]["layer_accuracy_levels"] == [0]
