"""A GGUF file's own blocks as MatMulNBits: each format's weights as ONNX Runtime computes them equal the gguf
reader's dequantization, graph weights are found by value (transposed, row-permuted, through a Transpose), and a
graph rewritten with them multiplies like the fp32 graph."""
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from onnx import helper, numpy_helper

from dspark.errors import DSparkError
from dspark.export.quantize.gguf_blocks import FORMATS as ALL_FORMATS
from dspark.export.quantize.gguf_blocks import VALUE_RANGE, GgufMatrix, read_matrices, sub_blocks, to_nbits
from dspark.export.quantize.gguf_map import match_weights, row_hashes
from dspark.export.quantize.nbits_graph import NBitsWriter, constant_matmul_weights, probe_weight

FORMATS = ("Q8_0", "Q4_0", "Q4_1")


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]]):
    """A GGUF holding each float matrix [N, K] quantized to the given format; returns {name: dequantized}."""
    writer = GGUFWriter(str(path), "llama")
    dequantized = {}
    for name, (qtype, w) in tensors.items():
        t = GGMLQuantizationType[qtype]
        raw = quantize(w, t) if qtype not in ("F32", "F16") else w
        writer.add_tensor(name, raw, raw_dtype=t)
        dequantized[name] = dequantize(raw, t).reshape(w.shape) if qtype not in ("F32", "F16") else w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def random_matrix(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[0, :32] = 0.0  # a constant block (Q4_1: d = 0)
    w[1, :32] = 0.25  # a constant non-zero block
    return w


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    rng = np.random.default_rng(3)
    tensors = {f"blk.0.{part}.weight": (fmt, random_matrix(rng, n, k))
               for part, fmt, (n, k) in zip(("attn_q", "ffn_up", "ffn_down"), FORMATS, ((64, 96), (96, 64), (48, 96)))}
    tensors["blk.0.attn_norm.weight"] = ("F32", rng.standard_normal(64).astype(np.float32))
    tensors["token_embd.weight"] = ("Q8_0", random_matrix(rng, 40, 64))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path, tensors)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_held_exactly(gguf_file, fmt):
    path, dequantized = gguf_file
    matrices = {m.name: m for m in read_matrices(path)[0]}
    m = next(m for m in matrices.values() if m.qtype == fmt)
    want = dequantized[m.name]
    assert np.array_equal(m.dequantize(), want)
    nbits = to_nbits(m)
    assert nbits.bits == (8 if fmt == "Q8_0" else 4) and nbits.block_size == 32
    assert np.array_equal(nbits.dequantize(), want)  # the numpy formula of the op
    assert np.array_equal(probe_weight(nbits), want)  # what the CPU kernel multiplies by


def test_q4_1_float_zero_points_are_close_but_not_exact(gguf_file):
    path, dequantized = gguf_file
    m = next(m for m in read_matrices(path)[0] if m.qtype == "Q4_1")
    got = probe_weight(to_nbits(m, "float-zp"))
    want = dequantized[m.name]
    err = np.abs(got - want)
    assert err.max() > 0  # -m/d does not round-trip: the inexact form
    assert err[2:].max() < 1e-5 * np.abs(want).max()  # only rounding where the block has a spread
    assert np.all(got[1, :32] == 0) and np.all(want[1, :32] == 0.25)  # d = 0, m != 0: no zero point expresses it


def test_graph_weights_are_found_by_value_and_rewritten(gguf_file):
    path, dequantized = gguf_file
    matrices, other = read_matrices(path)
    assert other == {} and len(matrices) == 4  # the F32 vector is no matrix
    rng = np.random.default_rng(0)
    perm = rng.permutation(64)
    q = dequantized["blk.0.attn_q.weight"][perm]  # rows reordered (as transformers undoes llama.cpp's rotary order)
    up, down = dequantized["blk.0.ffn_up.weight"], dequantized["blk.0.ffn_down.weight"]
    embed = dequantized["token_embd.weight"]  # read through a Transpose, as a tied LM head is
    inits = [numpy_helper.from_array(np.ascontiguousarray(q.T), "layers.0.self_attn.q_proj.weight.T"),
             numpy_helper.from_array(np.ascontiguousarray(up.T), "layers.0.mlp.up_proj.weight.T"),
             numpy_helper.from_array(np.ascontiguousarray(down.T), "layers.0.mlp.down_proj.weight.T"),
             numpy_helper.from_array(embed, "lm_head.weight")]
    nodes = [helper.make_node("MatMul", ["x", "layers.0.self_attn.q_proj.weight.T"], ["h"], name="q"),
             helper.make_node("MatMul", ["h", "layers.0.mlp.up_proj.weight.T"], ["u"], name="up"),
             helper.make_node("MatMul", ["u", "layers.0.mlp.down_proj.weight.T"], ["d"], name="down"),
             helper.make_node("Transpose", ["lm_head.weight"], ["head_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["h", "head_t"], ["unused"], name="other"),
             helper.make_node("MatMul", ["h", "head_t"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 96])],
                              [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                               for n in ("d", "logits")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    x = rng.standard_normal((2, 3, 96)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    model = ir.serde.deserialize_model(model)
    weights = constant_matmul_weights(model)
    assert [w.node.name for w in weights] == ["q", "up", "down", "other", "head"]
    matches, rest = match_weights([w for w in weights if w.node.name != "other"], matrices)
    assert rest == [] and all(m.name_agrees for m in matches)  # llama.cpp names -> HF names: the cross-check
    by_node = {m.weight.node.name: m for m in matches}
    assert by_node["head"].matrix.name == "token_embd.weight"
    assert np.array_equal(by_node["q"].order, perm)
    writer = NBitsWriter(model, accuracy_level=0)
    for m in matches:
        writer.replace(m.weight.node, to_nbits(m.matrix).take_rows(m.order))
    assert writer.apply() == 4
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulNBits") == 4 and ops.count("ReduceSum") == 1  # one block sum for the Q4_1 input
    assert "t" in [n.name for n in model.graph]  # the Transpose still feeds the MatMul left alone
    proto = ir.to_proto(model).SerializeToString()
    got = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_row_hashes_tell_rows_apart_and_match_equal_rows():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 64)).astype(np.float32)
    w[7] = w[3]
    h = row_hashes(w)
    assert h[7] == h[3] and len(set(h.tolist())) == 199
    nudged = w.copy()
    nudged[5, 10] = np.nextafter(nudged[5, 10], np.float32(np.inf))
    assert row_hashes(nudged)[5] != h[5]


# byte offsets of each format's float16 fields in a block (the rest of a random block is any bytes at all)
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
          "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rng, fmt: str, n: int, k: int) -> np.ndarray:
    """Raw blocks [n, k/B, bytes] of a GGUF format: random bits, with finite float16 scales (gguf's Python package
    cannot quantize to the K-quants; any bit pattern is a valid block)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in HALVES[fmt]:
        halves = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        halves[0, 0] = 0.0  # a zero scale
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // block, 2)
    return raw


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_every_format_equals_the_readers_values_bit_for_bit(fmt):
    rng = np.random.default_rng(len(fmt) * 7 + ord(fmt[1]))
    m = GgufMatrix("blk.0.ffn_up.weight", fmt, 24, 512, random_blocks(rng, fmt, 24, 512))
    want = m.dequantize()
    blocks = sub_blocks(m)
    low, high = VALUE_RANGE[fmt]
    assert blocks.values.min() >= low and blocks.values.max() <= high
    assert blocks.values.min() == low and blocks.values.max() == high  # random bits reach both ends of the range
    nbits = to_nbits(m)
    assert nbits.block_size == blocks.values.shape[-1] and (nbits.mins is not None) == (blocks.mins is not None)
    assert nbits.bits == (4 if high - low <= 15 else 8)
    assert np.array_equal(nbits.dequantize(), want)  # the numpy formula of the op
    assert np.array_equal(probe_weight(nbits), want)  # what the CPU kernel multiplies by


def test_a_block_decoded_wrong_is_seen():
    """The bit-for-bit comparison above can fail: a Q6_K whose high bits were read one shift off differs."""
    rng = np.random.default_rng(5)
    m = GgufMatrix("w", "Q6_K", 4, 256, random_blocks(rng, "Q6_K", 4, 256))
    nbits = to_nbits(m)
    codes = nbits.packed.astype(np.int16)
    nbits.packed = np.clip(codes + ((codes & 1) * 2 - 1), 0, 255).astype(np.uint8)  # every value one off
    assert not np.array_equal(probe_weight(nbits), m.dequantize())


def test_k_quant_files_are_read_by_super_block(tmp_path):
    rng = np.random.default_rng(8)
    path = tmp_path / "k.gguf"
    writer = GGUFWriter(str(path), "qwen3")
    raws = {f"blk.0.{part}.weight": (fmt, random_blocks(rng, fmt, 16, 512))
            for part, fmt in (("attn_q", "Q4_K"), ("attn_v", "Q6_K"), ("ffn_down", "Q5_K"))}
    for name, (fmt, raw) in raws.items():
        writer.add_tensor(name, raw.reshape(16, -1), raw_dtype=GGMLQuantizationType[fmt])
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((16, 64)).astype(np.float16))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    found, other = read_matrices(path)
    assert other == {"blk.0.ffn_up.weight": "F16"}
    for m in found:
        fmt, raw = raws[m.name]
        assert (m.qtype, m.rows, m.cols) == (fmt, 16, 512) and np.array_equal(m.raw, raw)
        assert np.array_equal(probe_weight(to_nbits(m)), m.dequantize())


def test_unsupported_formats_and_bad_files(tmp_path):
    path = tmp_path / "k.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": ("Q4_0", np.ones((32, 64), np.float32)),
                      "blk.0.ffn_up.weight": ("F16", np.ones((32, 64), np.float16))})
    found, other = read_matrices(path)
    assert [m.name for m in found] == ["blk.0.attn_q.weight"] and other == {"blk.0.ffn_up.weight": "F16"}
    bad = GgufMatrix("x", "IQ4_NL", 1, 32, np.zeros((1, 1, 18), np.uint8))
    with pytest.raises(DSparkError, match="IQ4_NL"):
        to_nbits(bad)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(DSparkError, match="cannot read GGUF"):
        read_matrices(tmp_path / "bad.gguf")
