"""`dspark demo` (added to `dspark` by dspark/cli/main.py): parse and print; the flow is dspark/demo.py, imported when
the command runs so that `--help` stays instant."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option("--bundle", type=click.Path(path_type=Path),
              help="Use this bundle, or convert into this folder if it does not exist (default: "
                   "~/.cache/dspark/bundles/smollm2-135m-dspark-<drafter digest>-v16k-<weights>, so a new demo drafter "
                   "gets a new bundle).")
@click.option("--num-prompts", default=3, show_default=True, type=click.IntRange(1, 1000),
              help="Prompts to decode (one per domain in turn).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path, dir_okay=False),
              help="JSONL file of prompts ('prompt' and optional 'domain' per line; default: the demo set shipped "
                   "in the package).")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens",
              default=128, show_default=True, type=click.IntRange(1, 4096),
              help="Tokens to generate per request at most (--max-new-tokens: the same).")
@click.option("--weights", default="gguf", show_default=True, type=click.Choice(["gguf", "fp32"]),
              help="Weights of a bundle the demo converts: gguf: the verifier multiplies by the GGUF file's own Q4_1 "
                   "blocks and the draft heads by 8-bit weights (the fastest on CPU; DSpark stays exact with "
                   "respect to the file); fp32: every graph as exported (what `dspark build` makes TensorRT "
                   "engines from).")
@click.option("--heads", type=click.Choice(["q8", "fp32"]), hidden=True,
              help="Older spelling: --heads q8 is --weights gguf, --heads fp32 is --weights fp32.")
def demo_cmd(bundle, num_prompts, prompts_file, max_tokens, weights, heads):
    """Convert SmolLM2-135M-Instruct + the demo DSpark drafter (once), then decode prompts with DSpark's best
    policy for the bundle and with autoregressive decoding on ONNX Runtime: text, tau, and the speedup measured
    in this run."""
    from dspark.demo import DemoRequest, run_demo

    if heads is not None:
        weights = "fp32" if heads == "fp32" else "gguf"
    req = DemoRequest(bundle, num_prompts, prompts_file, max_tokens, weights)
    run_demo(req, say=lambda m: click.echo(m, err=True), show=lambda m: click.echo(m, nl=False))
