"""`dspark cache list|clear`: what dspark keeps in its cache folder (added to `dspark` by dspark/cli/main.py)."""
from __future__ import annotations

import click

from dspark.cache_entries import CACHE_KINDS, cache_entries, clear_cache
from dspark.resolve import cache_dir


@click.group("cache")
def cache_group():
    """What dspark keeps in its cache ($DSPARK_CACHE, default ~/.cache/dspark): dequantized GGUF targets (keyed by
    the GGUF's sha256, shared by every venv), demo bundles, built CUDA kernels, TensorRT for RTX's library links,
    SPS tables profiled by `dspark run` and `bench` (per bundle and machine)."""


NOT_OURS = "  (not made by dspark: clear keeps it)"
CACHE_KIND_OPTION = click.option("--kind", "kinds", multiple=True, type=click.Choice(CACHE_KINDS),
                                 help="Only entries of this kind (repeatable; default: all).")


@cache_group.command("list")
@CACHE_KIND_OPTION
def cache_list_cmd(kinds):
    """Every cache entry with its size on disk."""
    entries = cache_entries(tuple(kinds) or CACHE_KINDS)
    for e in entries:
        click.echo(f"{e.bytes / 1e6:10.1f} MB  {e.kind:<8} {e.path}{'' if e.ours else NOT_OURS}")
    click.echo(f"{sum(e.bytes for e in entries) / 1e6:10.1f} MB  in {len(entries)} entries under {cache_dir()}")


@cache_group.command("clear")
@CACHE_KIND_OPTION
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def cache_clear_cmd(kinds, yes):
    """Remove the cache entries dspark made (made again when needed: a target in about a minute, the demo bundle
    in a few minutes); anything else found there is kept."""
    kinds = tuple(kinds) or CACHE_KINDS
    entries = cache_entries(kinds)
    total = sum(e.bytes for e in entries if e.ours)
    if not yes:
        click.confirm(f"remove {', '.join(kinds)} from the cache ({total / 1e6:.1f} MB)?", abort=True)
    removed = clear_cache(kinds)
    click.echo(f"removed {len(removed)} entries, {sum(e.bytes for e in removed) / 1e6:.1f} MB")
    kept = [e for e in entries if not e.ours]
    if kept:
        click.echo(f"kept {len(kept)} entries dspark did not make, e.g. {kept[0].path} (remove them yourself "
                   f"if you want them gone)")

