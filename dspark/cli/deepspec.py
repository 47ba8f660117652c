"""`dspark-export deepspec`: a drafter as a complete DeepSpec checkpoint (added to `dspark-export` by
dspark/cli/main.py; torch loads inside the command)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("deepspec")
@click.option("--target", required=True, help="The drafter's target: HF folder, .gguf file, or short name.")
@click.option("--draft", required=True, help="Draft checkpoint folder or short name (e.g. smollm2-135m-dspark).")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Checkpoint folder to write (config.json, model.safetensors).")
@click.option("--force", is_flag=True, help="Replace an earlier draft checkpoint at OUTPUT.")
def deepspec_cmd(target, draft, output, force):
    """Write DRAFT as a complete DeepSpec checkpoint: its config with every field DeepSpec's model reads
    (num_anchors included), its own weights in bf16, and the target's embedding and LM head in the precision
    dspark decodes with, so DeepSpec's code loads it alone and computes dspark's logits. A drafter saved without
    the shared matrices (as the demo's is, to stay small) becomes loadable by DeepSpec this way."""
    from dspark.errors import DSparkError
    from dspark.models.checkpoint import save_draft
    from dspark.models.pair import load_pair

    if output.exists() and not force:
        raise DSparkError(f"{output} exists; pass --force to replace it (only a draft checkpoint is replaced)")
    pair = load_pair(target, draft, lazy=True)
    lazy = pair.loaded.lazy

    def read(t):
        data = lazy.read(t)
        return data.float() if data.is_floating_point() else data

    save_draft(pair.drafter, output, include_shared=True, read=read if lazy is not None else None)
    click.echo(f"wrote {output} (DeepSpec's format with embed_tokens and lm_head; DeepSpec loads it alone)")
