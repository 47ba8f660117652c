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
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

from dspark.bundle import Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.files import Temporary, normal_mode, replace_folder

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

    files = [f for f in (file, f"{file}.data") if Manifest.path(bundle, f).exists()]
    if all((bundle / f).stat().st_nlink == 1 for f in files):
        return onnx.load(str(bundle / file))
    private = Temporary(bundle.with_name(f"{bundle.name}.read"))
    try:
        for f in files:
            shutil.copyfile(bundle / f, private.path / f)
        return onnx.load(str(private.path / file))
    finally:
        private.remove()


def _linked_copy(bundle: Path, into: Path) -> None:
    """Every file of the bundle in `into` as a hard link (a copy where links are impossible): the new bundle
    shares what it does not change, and what it changes gets new files, so no other copy is written through."""

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(bundle, into, copy_function=link, dirs_exist_ok=True)


def quantize_graph(bundle: Path, graph: str = "heads", bits: int = 8, block_size: int = 32,
                   accuracy_level: int = 4, min_elements: int = 1 << 20) -> dict:
    """Replace BUNDLE/<graph>.onnx by its MatMulNBits version (MatMuls with weights of >= min_elements only) and
    record it in the manifest. The new graph, its data and the manifest are written into a copy of the bundle
    (hard links) that replaces the bundle in one step: readers see the old set or the new one, never a mix."""


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
    staging = Temporary(bundle)
    try:  # the new bundle is the old one with graph, data and manifest replaced, swapped in as one folder
        tmp = staging.path
        _linked_copy(bundle, tmp)
        data = f"{spec.file}.data"
        for name in (spec.file, data):
            (tmp / name).unlink(missing_ok=True)
        onnx.save(qmodel, str(tmp / spec.file), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data, size_threshold=1024)
        for name in (spec.file, data):
            if (tmp / name).exists():
                normal_mode(tmp / name)
        record = {"bits": bits, "block_size": block_size, "accuracy_level": accuracy_level, "op": "MatMulNBits",
                  "matmuls": big, "fp32_sha256": spec.sha256}
        spec.sha256 = sha256_file(tmp / spec.file)
        manifest.quantized[graph] = record
        manifest.write(tmp)
        replace_folder(staging, bundle)
    except BaseException:
        staging.remove()
        raise
    return record
