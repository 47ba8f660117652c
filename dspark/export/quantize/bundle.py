"""Weight-only quantization of a bundle's graphs for ONNX Runtime on CPU (MatMulNBits).

At batch 1 every graph is bound by reading its weights; MatMulNBits reads 4- or 8-bit blocks instead of fp32.

- verifier: it defines the output, so a quantized verifier *is* the model decoded; DSpark stays exact with respect
  to it (greedy DSpark equals its own autoregressive output, sampling follows its distribution). For a GGUF target
  it keeps the file's own blocks where MatMulNBits can hold them (dspark.export.quantize.gguf_blocks: Q4_0 ... Q8_0
  and the K-quants Q2_K ... Q6_K exactly, the asymmetric formats with a per-block minimum term), i.e. the model the
  user chose rather than a requantization of its fp32
  dequantization. Other weights go through onnxruntime's quantizer (round to nearest, --bits, --block-size).
  Its top-1 agreement with the fp32 verifier on a few prompts is measured and stored.
- draft, heads: the draft side never changes the tokens a request gets (verification uses the distribution the
  draft side actually sampled from); only acceptance can move.

The graph is read as a skeleton (weight_stream.load_skeleton: external data read from wherever the bundle keeps
it, one weight at a time) and written with its own new external data file `<graph file>.data`; files other graphs
share are left as they are.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnxruntime.capi import _pybind_state as ort_kernels

from dspark.bundle import WEIGHTS, Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.quantize.agreement import measure_agreement
from dspark.export.quantize.gguf_blocks import Q4_1_MODES, NBitsWeight, read_matrices, to_nbits
from dspark.export.quantize.gguf_map import match_weights
from dspark.export.quantize.nbits_graph import ConstWeight, NBitsWriter, constant_matmul_weights, probe_weight
from dspark.export.quantize.weight_stream import DataSink, StoredWeights, compact, load_skeleton
from dspark.export.twins.fused_bundle import forget_step_costs
from dspark.export.twins.ort_graphs import rebuild_twins
from dspark.files import atomic_folder, linked_copy, normal_mode

QUANTIZABLE = ("verifier", "draft", "heads")
MIN_ELEMENTS = {"verifier": 1 << 16, "draft": 1 << 16, "heads": 1 << 20}  # smaller MatMuls stay fp32
PROBE_ROWS, PROBE_COLS = 256, 1024  # the window of each GGUF matrix read back from ONNX Runtime's kernel


@dataclass
class QuantizeOptions:
    bits: int = 8
    block_size: int = 32
    accuracy_level: int | None = None  # MatMulNBits: 0 = fp32 activations, 4 = int8; None: see _level
    head_bits: int = 8  # the vocabulary-sized MatMul (LM head)
    head_accuracy_level: int | None = None  # the vocabulary-sized MatMul's (None: see _level)
    symmetric: bool = True
    gguf: str = "auto"  # "auto": the target's GGUF when the bundle came from one; "off"; or a .gguf path
    q4_1: str = "mins"  # or "float-zp" (MatMulNBits' floating zero points: inexact, slow on CPU; measurement only)
    min_elements: int | None = None  # None: MIN_ELEMENTS of the graph
    agreement_prompts: int = 6  # 0: no agreement run
    agreement_tokens: int = 32
    prompt_file: Path | None = None


def _check_options(manifest: Manifest, graphs: list[str], opts: QuantizeOptions) -> None:
    for g in graphs:
        if g not in QUANTIZABLE:
            raise DSparkError(f"{g!r} is not a graph of a bundle ({', '.join(QUANTIZABLE)})")
    if opts.bits not in (4, 8) or opts.head_bits not in (4, 8):
        raise DSparkError(f"--bits {opts.bits} / --head-bits {opts.head_bits}: MatMulNBits weights are 4 or 8 bits")
    if "heads" in graphs and opts.bits != 8:
        raise DSparkError(f"--bits {opts.bits}: the heads graph takes 8-bit weights only (its vocabulary-sized LM "
                          f"head drafts every token); 4 bits are for --graphs verifier,draft")
    if opts.block_size < 16 or opts.block_size & (opts.block_size - 1):
        raise DSparkError(f"--block-size {opts.block_size}: MatMulNBits blocks are a power of two >= 16")
    for level in (opts.accuracy_level, opts.head_accuracy_level):
        if level is not None and not 0 <= level <= 4:
            raise DSparkError(f"accuracy level {level}: MatMulNBits takes 0..4")
    if opts.q4_1 not in Q4_1_MODES:
        raise DSparkError(f"q4_1={opts.q4_1!r}: one of {', '.join(Q4_1_MODES)}")


def gguf_source(manifest: Manifest, choice: str) -> Path | None:
    """The GGUF file whose blocks the verifier keeps: the bundle's recorded target file when it is a GGUF that is
    still there unchanged ("auto"), none ("off"), or a path the user gives (checked against the recorded hash)."""
    if choice == "off":
        return None
    target = manifest.sources.get("target") or {}
    path = Path(target.get("file") or "") if choice == "auto" else Path(choice)
    if choice == "auto" and (path.suffix != ".gguf" or not path.is_file()):
        return None
    if not path.is_file():
        raise DSparkError(f"--gguf {choice}: no such file")
    if target.get("sha256") and sha256_file(path) != target["sha256"]:
        if choice == "auto":
            return None
        raise DSparkError(f"--gguf {choice}: not the GGUF this bundle was exported from (sha256 differs)")
    return path


def _level(opts: QuantizeOptions, graph: str, bits: int, head: bool, fused: bool) -> int:
    """accuracy_level of one MatMulNBits: as asked, else int8 activations (4), except for the 4-bit layers of a
    verifier without a fused twin (0: fp32 activations).

    int8 activations are what makes a 4-bit step fast: ONNX Runtime's fp32-activation kernel for several rows
    dequantizes blocks into fp32 tiles, and at one row it is still slower than the int8 kernel; the 8-bit kernel's
    fp32 path is tens of times slower. They are also what llama.cpp does (its K-quant and Q4_0 dot products
    quantize activations to 8 bits). But rounding activations turns a kernel's last-bit differences between a
    1-position and a k-position step into different tokens unless every step computes a position alike, which
    only the fused verifier does (dspark.export.twins.ort_fused._PadToTwo; several requests then run one by one). So a
    verifier with no fused twin keeps fp32 activations in its layers, and a verifier with one rounds them; the
    top-1 agreement with fp32 that quantize measures shows what that costs."""
    asked = opts.head_accuracy_level if head else opts.accuracy_level
    if asked is not None:
        return asked
    return 0 if graph == "verifier" and bits == 4 and not fused else 4


def _gguf_blocks(writer: NBitsWriter, weights: list[ConstWeight], path: Path, vocab: int, opts: QuantizeOptions,
                 fused: bool) -> tuple[dict, list[ConstWeight]]:
    """Replace every MatMul whose weight a GGUF matrix holds by that matrix's own blocks; (report, the rest)."""
    matrices, unsupported = read_matrices(path)
    matches, rest = match_weights(weights, matrices)
    worst: dict[str, float] = {}
    for m in matches:
        nbits = to_nbits(m.matrix, opts.q4_1).take_rows(m.order)
        want = m.matrix.dequantize()[m.order]
        if opts.q4_1 != "float-zp" and not np.array_equal(nbits.dequantize(), want):  # the op's formula, everywhere
            raise DSparkError(f"{m.matrix.name}: its {m.matrix.qtype} blocks as MatMulNBits differ from the GGUF "
                              "reader's values (a dspark fault for this format); --gguf off requantizes instead")
        probe = nbits.window(PROBE_ROWS, PROBE_COLS)  # what the kernel multiplies by, on a window
        diff = float(abs(probe_weight(probe) - want[:probe.rows, :probe.cols]).max())
        worst[m.matrix.qtype] = max(worst.get(m.matrix.qtype, 0.0), diff)
        level = _level(opts, "verifier", nbits.bits, m.weight.shape[1] == vocab, fused)
        writer.replace(m.weight.node, nbits, level, m.weight.key)
    formats = Counter(m.matrix.qtype for m in matches)
    return {"gguf": str(path), "formats": dict(sorted(formats.items())),
            "q4_1": opts.q4_1 if "Q4_1" in formats else None,
            "max_abs_weight_diff": worst, "names_agree": sum(m.name_agrees for m in matches),
            "unsupported": unsupported}, rest


def _round_to_nearest(weight: np.ndarray, bits: int, block_size: int, symmetric: bool) -> NBitsWeight:
    """onnxruntime's own MatMulNBits quantizer kernel (round to nearest, per block along K) on one [K, N] weight."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    per_byte = 8 // bits
    packed = np.zeros((n, blocks, -(-block_size // per_byte)), dtype=np.uint8)
    zero_points = np.zeros((n, -(-blocks // per_byte)), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    kernel = {4: ort_kernels.quantize_matmul_4bits, 8: ort_kernels.quantize_matmul_8bits}[bits]
    kernel(packed, np.ascontiguousarray(weight, dtype=np.float32), scales, zero_points, block_size, n, k, symmetric)
    return NBitsWeight(bits, block_size, n, k, packed, scales, None if symmetric else zero_points.reshape(-1))


def _ort_quantize(writer: NBitsWriter, weights: list[ConstWeight], vocab: int, graph: str,
                  opts: QuantizeOptions, fused: bool) -> dict:
    """Round-to-nearest MatMulNBits (onnxruntime's kernel), one weight at a time: the vocabulary-sized MatMul at
    head_bits, the others at bits."""
    kinds: Counter = Counter()
    for w in weights:
        head = w.shape[1] == vocab
        bits = opts.head_bits if head else opts.bits
        level = _level(opts, graph, bits, head, fused)
        writer.replace(w.node, _round_to_nearest(w.weight, bits, opts.block_size, opts.symmetric), level, w.key)
        kinds[(bits, level)] += 1
    return {"matmuls": {f"{bits}-bit, accuracy_level {level}": count for (bits, level), count in sorted(kinds.items())}}


def _quantize_model(bundle: Path, staging: Path, manifest: Manifest, graph: str, opts: QuantizeOptions) -> dict:
    """Write `graph` quantized into staging (its .onnx and a new `<file>.data`), one weight at a time: the graph is
    read as a skeleton, each MatMul weight from a memory map of the bundle's data, and the new data is written as
    it is made. Returns the graph's record."""
    spec = manifest.graphs[graph]
    source = Manifest.path(bundle, spec.file)
    model = load_skeleton(source)
    minimum = MIN_ELEMENTS[graph] if opts.min_elements is None else opts.min_elements
    stored = StoredWeights(source.parent)
    weights = constant_matmul_weights(model, minimum, stored)
    _key_by_weight(weights)
    if not weights:
        raise DSparkError(f"{graph}.onnx has no MatMul with a weight of at least {minimum} elements to quantize")
    record = {"op": "MatMulNBits", "bits": opts.bits, "head_bits": opts.head_bits, "block_size": opts.block_size,
              "symmetric": opts.symmetric,
              "matmuls": [w.node.name for w in weights], "fp32_sha256": spec.sha256}
    target = Manifest.path(staging, spec.file)
    target.unlink(missing_ok=True)  # a hard link to the old bundle's file: unlinked, never written
    sink = DataSink(target.parent, f"{target.name}.data")
    try:
        writer = NBitsWriter(model, 4, store=sink.add)
        gguf = gguf_source(manifest, opts.gguf) if graph == "verifier" else None
        fused = "verifier_fused" in manifest.graphs  # rebuilt from the quantized verifier (rebuild_twins)
        vocab = manifest.target["vocab_size"]
        if gguf is not None:
            record["gguf_blocks"], weights = _gguf_blocks(writer, weights, gguf, vocab, opts, fused)
        if weights:
            record["onnxruntime_quantizer"] = _ort_quantize(writer, weights, vocab, graph, opts, fused)
        writer.apply()
        written = set(writer.written)
        for value in model.graph.initializers.values():  # the weights left as they were: into the new data file,
            if value.name not in written and not _shared(value):  # unless other graphs read them too
                sink.adopt(value, stored)
    finally:
        sink.close()
    ir.save(model, target)
    for path in (target, sink.path):
        normal_mode(path)
    nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
    kinds = Counter(_kind(n) for n in nbits)
    record["matmulnbits"] = dict(sorted(kinds.items()))
    # what the layers (all but the vocabulary-sized head) do with their activations: dspark.bundle's
    # Manifest.quantized_activations
    record["layer_accuracy_levels"] = sorted({_attr(n, "accuracy_level") for n in nbits
                                              if _attr(n, "N") != manifest.target["vocab_size"]})
    record["bits"] = min(int(k.split("-")[0]) for k in kinds)  # the narrowest weights the graph now holds
    return record


def _shared(value: ir.Value) -> bool:
    """A weight in the bundle's shared data file (the vocabulary matrix every graph reads, stored once): left
    there, so a quantized graph's embedding does not take a copy of it (at 12B, 2 GB per graph)."""
    tensor = value.const_value
    return isinstance(tensor, ir.ExternalTensor) and tensor.location == WEIGHTS


def _key_by_weight(weights: list[ConstWeight]) -> None:
    """Key each MatMul by its weight's initializer (a module path such as target.layers.3.mlp.up_proj.weight.T):
    the tensors of the MatMulNBits replacing it are named after the key (<key>.nbits.B, ...), which is how
    dspark.export.twins.ort_fused finds projections."""
    taken: set[str] = set()
    for w in weights:
        key = f"{w.source}.matmul"
        while key in taken:
            key += "_"
        taken.add(key)
        w.key = key


def _attr(node: ir.Node, name: str) -> int:
    return node.attributes.get_int(name, 0)


def _kind(node: ir.Node) -> str:
    return f"{_attr(node, 'bits')}-bit, accuracy_level {_attr(node, 'accuracy_level')}"


def quantize_bundle(bundle: Path, graphs: list[str], opts: QuantizeOptions = QuantizeOptions()) -> dict[str, dict]:
    """Quantize BUNDLE's `graphs` and record them in its manifest ({graph: record}). Graphs, data and manifest are
    written into a copy of the bundle (hard links) that replaces it in one step: readers see the old set or the
    new one, never a mix. A quantized verifier drops the stored SPS table (profiled on the old verifier)."""
    bundle = Path(bundle)
    manifest = Manifest.read_checked(bundle)
    graphs = list(dict.fromkeys(graphs))
    _check_options(manifest, graphs, opts)
    done = [g for g in graphs if g in manifest.quantized]
    if done:
        levels = opts.accuracy_level is not None or opts.head_accuracy_level is not None
        if not levels or len(done) < len(graphs):
            raise DSparkError(f"{done[0]}.onnx is already quantized ({manifest.quantized[done[0]].get('bits', '?')}"
                              f"-bit); --accuracy-level / --head-accuracy-level alone change how its MatMulNBits "
                              f"round activations (quantized graphs only)")
        return relevel_bundle(bundle, manifest, graphs, opts)
    with atomic_folder(bundle) as staging:
        linked_copy(bundle, staging)
        records = {}
        for graph in graphs:
            record = _quantize_model(bundle, staging, manifest, graph, opts)
            manifest.graphs[graph].sha256 = sha256_file(staging / manifest.graphs[graph].file)
            records[graph] = record
        if "verifier" in graphs:
            forget_step_costs(manifest)
        manifest.quantized.update(records)  # (the fused twin's lanes follow the verifier's activations)
        rebuild_twins(staging, manifest, graphs)  # the old ones multiply by the old weights
        _drop_unread_weights(staging, manifest)
        manifest.write(staging)  # (complete: the agreement run may open the staged bundle as a Runtime)
        if "verifier" in graphs and opts.agreement_prompts:
            agreement = measure_agreement(bundle, staging, opts.agreement_prompts, opts.agreement_tokens,
                                          opts.prompt_file).as_dict()
            records["verifier"]["agreement"] = manifest.quantized["verifier"]["agreement"] = agreement
            manifest.write(staging, data_unchanged=True)
    return records


def relevel_bundle(bundle: Path, manifest: Manifest, graphs: list[str], opts: QuantizeOptions) -> dict[str, dict]:
    """Set the accuracy_level of quantized graphs' MatMulNBits (the layers' to opts.accuracy_level, the
    vocabulary-sized head's to opts.head_accuracy_level; None leaves them): only the .onnx files change, the
    weights stay. The twins made from them are rebuilt, a verifier's SPS table dropped, and its agreement record
    with it (measured at the old level)."""
    vocab = manifest.target["vocab_size"]
    with atomic_folder(bundle) as staging:
        linked_copy(bundle, staging)
        records = {}
        for graph in graphs:
            path = Manifest.path(staging, manifest.graphs[graph].file)
            model = load_skeleton(path)
            nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
            for node in nbits:
                level = opts.head_accuracy_level if _attr(node, "N") == vocab else opts.accuracy_level
                if level is not None:
                    node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
            path.unlink()  # a hard link to the old bundle's file: unlinked, never written
            ir.save(model, path)
            normal_mode(path)
            manifest.graphs[graph].sha256 = sha256_file(path)
            record = dict(manifest.quantized[graph])
            record.pop("agreement", None)
            record["matmulnbits"] = dict(sorted(Counter(_kind(n) for n in nbits).items()))
            record["layer_accuracy_levels"] = sorted({_attr(n, "accuracy_level") for n in nbits
                                                      if _attr(n, "N") != vocab})
            records[graph] = record
        if "verifier" in graphs:
            forget_step_costs(manifest)
        manifest.quantized.update(records)
        rebuild_twins(staging, manifest, graphs)
        manifest.write(staging)
    return records


def _drop_unread_weights(staging: Path, manifest: Manifest) -> None:
    """The shared weights file loses the original weights no graph reads any more (graphs re-hashed)."""
    files = {g: Manifest.path(staging, spec.file) for g, spec in manifest.graphs.items()}
    if compact(staging, files, WEIGHTS):
        for g, path in files.items():
            manifest.graphs[g].sha256 = sha256_file(path)


def quantize_graph(bundle: Path, graph: str = "heads", bits: int = 8, block_size: int = 32,
                   accuracy_level: int | None = None, min_elements: int | None = None, **options) -> dict:
    """One graph (see quantize_bundle); returns its record."""
    opts = replace(QuantizeOptions(), bits=bits, block_size=block_size, accuracy_level=accuracy_level,
                   min_elements=min_elements, **options)
    return quantize_bundle(bundle, [graph], opts)[graph]


def describe_record(graph: str, rec: dict) -> str:
    """One line per quantized graph: what became MatMulNBits, how, and the verifier's agreement with fp32."""
    parts = []
    blocks = rec.get("gguf_blocks")
    if blocks:
        formats = ", ".join(f"{k} {v}" for k, v in blocks["formats"].items())
        worst = max(blocks["max_abs_weight_diff"].values(), default=0.0)
        parts.append(f"GGUF blocks ({formats}; max |w - gguf| {worst:.3g})")
    ort_part = rec.get("onnxruntime_quantizer")
    if ort_part:
        parts.append(f"onnxruntime round-to-nearest {sum(ort_part['matmuls'].values())}")
    parts.append(", ".join(f"{k}: {v}" for k, v in rec["matmulnbits"].items()))
    line = (f"{graph}.onnx: {len(rec['matmuls'])} MatMul(s) -> {rec['op']} {rec['bits']}-bit, block "
            f"{rec['block_size']}: {'; '.join(parts)}")
    agreement = rec.get("agreement")
    if agreement:
        line += (f"; top-1 agreement with fp32 {100 * agreement['top1']:.1f}% over {agreement['positions']} "
                 f"positions ({agreement['prompts']} prompts)")
    return line
