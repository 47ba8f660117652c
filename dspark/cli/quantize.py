"""`dspark-export quantize`: weight-only MatMulNBits for a bundle's graphs (added to `dspark-export` by
dspark/cli/main.py; the quantizer itself loads inside the command)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("quantize")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--graphs", "graph_list", help="Comma-separated graphs to quantize: verifier, draft, heads "
              "(default: heads).")
@click.option("--graph", "graphs", multiple=True, type=click.Choice(["heads", "draft"]),
              help="A draft-side graph to quantize (repeatable; --graphs also takes the verifier).")
@click.option("--bits", default=8, show_default=True, type=int, help="Weight bits: 8, or 4 (verifier, draft).")
@click.option("--head-bits", default=8, show_default=True, type=int, help="Bits of the vocabulary-sized MatMul.")
@click.option("--block-size", default=32, show_default=True, type=click.IntRange(16, 256),
              help="Quantization block along the reduction axis.")
@click.option("--accuracy-level", type=click.IntRange(0, 4),
              help="MatMulNBits accuracy_level: 4 = int8 activations (faster; for the verifier exact on its fused "
                   "twin, which then runs several requests one by one), 0 = fp32 (closer to fp32, batched). "
                   "Default: 4, but 0 for the 4-bit layers of a verifier without a fused twin.")
@click.option("--head-accuracy-level", type=click.IntRange(0, 4),
              help="accuracy_level of the vocabulary-sized MatMul (default: 4 for 8-bit weights).")
@click.option("--asymmetric", is_flag=True, help="onnxruntime's quantizer with zero points (default: symmetric).")
@click.option("--gguf", default="auto", show_default=True,
              help="Verifier of a GGUF target: keep the file's own blocks ('auto': the file it was exported from, "
                   "when still there; 'off'; or the .gguf path).")
@click.option("--min-elements", type=click.IntRange(0),
              help="Only MatMuls whose weight has at least this many elements (default 65536; heads 1048576).")
@click.option("--agreement-prompts", default=6, show_default=True, type=click.IntRange(0),
              help="Prompts for the verifier's top-1 agreement with fp32 (0: skip). One verifier is loaded at a "
                   "time, a reference too big to widen with its weights mapped.")
@click.option("--agreement-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="Greedy tokens per prompt the agreement is measured on (the reference's, or the quantized "
                   "bundle's when the reference runs mapped).")
@click.option("--prompts", "prompt_file", type=click.Path(path_type=Path),
              help="JSONL prompts for the agreement (default: the dev prompts, else the demo set).")
def quantize_cmd(bundle, graph_list, graphs, bits, head_bits, block_size, accuracy_level, head_accuracy_level,
                 asymmetric, gguf, min_elements, agreement_prompts, agreement_tokens, prompt_file):
    """Weight-only MatMulNBits for BUNDLE's graphs (ONNX Runtime CPU). Draft side: decoding stays lossless.
    Verifier: DSpark stays exact with respect to the quantized verifier; its top-1 agreement with fp32 is
    measured and stored in the manifest."""
    from dspark.bundle import Manifest
    from dspark.export.twins.ort_fused import unfusable
    from dspark.export.quantize.bundle import QuantizeOptions, describe_record, quantize_bundle

    names = [g.strip() for g in graph_list.split(",") if g.strip()] if graph_list else []
    opts = QuantizeOptions(bits=bits, head_bits=head_bits, block_size=block_size, accuracy_level=accuracy_level,
                           head_accuracy_level=head_accuracy_level, symmetric=not asymmetric, gguf=gguf,
                           min_elements=min_elements, agreement_prompts=agreement_prompts,
                           agreement_tokens=agreement_tokens, prompt_file=prompt_file)
    done = quantize_bundle(bundle, names + list(graphs) or ["heads"], opts)
    for g, rec in done.items():
        click.echo(describe_record(g, rec))
    manifest = Manifest.read(bundle)
    if "verifier" in done and manifest.quantized_activations("verifier") and "verifier_fused" not in manifest.graphs:
        click.echo(f"warning: the verifier's layers round activations and {bundle} has no fused verifier "
                   f"({unfusable(manifest.target) or 'see `dspark-export fuse`'}): only the fused verifier keeps "
                   f"DSpark equal to its AR output then; --accuracy-level 0 keeps the portable one exact", err=True)


@click.command("fuse")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--rebuild", is_flag=True, help="Rebuild the ones BUNDLE already has too.")
def fuse_cmd(bundle, rebuild):
    """Add ONNX Runtime's own graphs to BUNDLE, made from its portable ones with the same weights (no copy): the
    fused verifier (attention writing the KV cache in place, SkipSimplifiedLayerNormalization) and the
    greedy heads (all-greedy rounds skip the sampling machinery). `dspark run` uses them on CPU; TensorRT builds
    keep the portable graphs."""
    from dspark.bundle import Manifest
    from dspark.export.twins.ort_graphs import fuse_bundle, possible_twins
    from dspark.export.twins.fused_bundle import default_attention

    manifest = Manifest.read(bundle)
    had_sps = "sps_table" in manifest.calibration
    done = fuse_bundle(bundle, possible_twins(manifest) if rebuild else None)
    if not any(why is None for why in done.values()):
        click.echo(f"{bundle} already has ONNX Runtime's graphs (--rebuild rebuilds them)")
    files = {name: spec.file for name, spec in Manifest.read(bundle).graphs.items()}
    for name, why in done.items():
        click.echo(f"{bundle}: {'wrote ' + files[name] if why is None else why}")
    if "verifier_fused" in done and done["verifier_fused"] is None:
        rows = default_attention(Manifest.read(bundle)) == "rows"
        click.echo("ONNX Runtime only: the portable verifier stays for TensorRT" +
                   ("; every step runs fused (attention over the cache's rows)" if rows else
                    " and for multi-position steps of several requests"))
        if had_sps:
            click.echo(f"the SPS table timed the verifier steps before this one and is dropped: run "
                       f"`dspark calibrate --sps {bundle}`")
