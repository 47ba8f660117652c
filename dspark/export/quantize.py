"""8-bit weight-only quantization of a bundle's draft-side graphs for ONNX Runtime on CPU.

At batch 1 the heads graph is bound by memory traffic: its base LM head reads the whole [d, V] matrix each round
(SmolLM2: 113 MB fp32), which costs as much as the verifier's own LM head. MatMulNBits with 8-bit blocks reads a
quarter of that. Quantizing the *draft* side never changes the tokens a request gets: the heads graph outputs the
distribution it actually sampled from, and verification (greedy match or rejection sampling against the target)
uses exactly that distribution, so decoding stays lossless; only acceptance can move a little. The verifier, which
defines the output, is never quantized here.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

from dspark.bundle import MANIFEST, Manifest, sha256_file
from dspark.errors import DSparkError

QUANTIZABLE = ("heads", "draft")


def _large_matmuls(model, min_elements: int) -> tuple[list[str], list[str]]:
    """(names of MatMuls whose constant weight has >= min_elements, names of all other MatMuls)."""

    sizes = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer}
    big, small = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        weight = sizes.get(node.input[1])
        (big if weight is not None and weight >= min_elements else small).append(node.name)
    return big, small


def _load_unlinked(bundle: Path, file: str):
    """onnx.load, also for a bundle copied with hard links (cp -al), whose external data onnx refuses to read
    ("potential hardlink attack"): then the graph is read from a private copy."""

    files = [f for f in (file, f"{file}.data") if (bundle / f).exists()]
    if all((bundle / f).stat().st_nlink == 1 for f in files):
        return onnx.load(str(bundle / file))
    private = Path(tempfile.mkdtemp(dir=bundle.parent, prefix=f".{bundle.name}.read-"))
    try:
        for f in files:
            shutil.copyfile(bundle / f, private / f)
        return onnx.load(str(private / file))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def quantize_graph(bundle: Path, graph: str = "heads", bits: int = 8, block_size: int = 32,
                   accuracy_level: int = 4, min_elements: int = 1 << 20) -> dict:
    """Replace BUNDLE/<graph>.onnx by its MatMulNBits version (MatMuls with weights of >= min_elements only) and
    record it in the manifest. Files are written beside the bundle first and moved in, the manifest last."""


    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    bundle = Path(bundle)
    if graph not in QUANTIZABLE:
        raise DSparkError(f"only the draft-side graphs ({', '.join(QUANTIZABLE)}) can be quantized; the verifier "
                          f"defines the output and stays as exported")
    if bits != 8:
        raise DSparkError(f"--bits {bits}: only 8-bit weights are supported (4-bit loses 25-40% top-1 agreement "
                          f"on SmolLM2-135M)")
    manifest = Manifest.read(bundle)
    if graph in manifest.quantized:
        raise DSparkError(f"{graph}.onnx of {bundle} is already quantized ({manifest.quantized[graph]['bits']}-bit)")
    spec = manifest.graphs[graph]
    try:
        model = _load_unlinked(bundle, spec.file)
    except Exception as e:  # protobuf / external-data errors
        raise DSparkError(f"cannot read {bundle / spec.file}: {str(e).splitlines()[0][:200]}") from None
    big, small = _large_matmuls(model, min_elements)
    if not big:
        raise DSparkError(f"{graph}.onnx has no MatMul with a weight of at least {min_elements} elements to quantize")
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                          bits=bits)
    quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=small, algo_config=config)
    quantizer.process()
    qmodel = quantizer.model.model
    tmp = Path(tempfile.mkdtemp(dir=bundle.parent, prefix=f".{bundle.name}.quant-"))
    try:
        data = f"{spec.file}.data"
        onnx.save(qmodel, str(tmp / spec.file), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data, size_threshold=1024)
        record = {"bits": bits, "block_size": block_size, "accuracy_level": accuracy_level, "op": "MatMulNBits",
                  "matmuls": big, "fp32_sha256": spec.sha256}
        spec.sha256 = sha256_file(tmp / spec.file)
        manifest.quantized[graph] = record
        manifest.write(tmp)
        # Replace (never write through) so a bundle copied with hard links keeps its original files.
        for name in (data, spec.file, MANIFEST):
            if (tmp / name).exists():
                os.replace(tmp / name, bundle / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record
