"""Command-line entry points: `dspark-export` (conversion) and `dspark` (run, bench, train, calibrate, demo).

Heavy imports (torch, transformers, onnx) happen inside the commands that need them, so `dspark run` on a
bundle stays torch-free and `--help` is instant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dspark.errors import DSparkError

DEV_PROMPTS = [Path("../shared/data/prompts/dev.jsonl"),
               Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "dev.jsonl",
               Path("/work/shared/data/prompts/dev.jsonl")]


class FriendlyGroup(click.Group):
    """Turns DSparkError and the usual file errors into one line on stderr and exit status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DSparkError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
            click.echo(f"error: {e.strerror}: {e.filename}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


def read_prompts(path: Path, limit: int | None = None, domain: str | None = None) -> list[dict]:
    """JSONL rows with a 'prompt' (or DeepSpec 'turns') field."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise DSparkError(f"prompt file {path} not found") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise DSparkError(f"{path}:{i} is not valid JSON") from None
        if "prompt" not in row and row.get("turns"):
            row["prompt"] = row["turns"][0]
        if not isinstance(row.get("prompt"), str):
            raise DSparkError(f"{path}:{i} has no 'prompt' string")
        if domain is None or row.get("domain") == domain:
            rows.append(row)
    return rows[:limit] if limit else rows


def default_dev_prompts() -> Path:
    import os

    env = os.environ.get("DSPARK_DEV_PROMPTS")
    for candidate in ([Path(env)] if env else []) + DEV_PROMPTS:
        if candidate.exists():
            return candidate.resolve()
    raise DSparkError("no dev prompts found: pass --prompts FILE (JSONL with a 'prompt' field)")


# ------------------------------------------------------------------------------------------------ dspark-export


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def export_cli():
    """Convert a target LLM and a DSpark draft into a deployable bundle (ONNX graphs, manifest, tokenizer)."""


@export_cli.command("onnx")
@click.option("--target", required=True, help="HF folder, .gguf file, or short name (smollm2-135m).")
@click.option("--draft", required=True, help="DeepSpec checkpoint folder, short name, or 'random[:SEED]'.")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path), help="Bundle folder to write.")
@click.option("--block-size", type=click.IntRange(1, 64),
              help="Check the draft's block size (the graphs are traced for the checkpoint's own).")
@click.option("--max-context", default=2048, show_default=True, type=click.IntRange(16, 1 << 20),
              help="Longest prompt + generation a runtime session may hold.")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def export_onnx_cmd(target, draft, output, block_size, max_context, force, quiet):
    """Export verifier.onnx, draft.onnx, heads.onnx, manifest.json and the tokenizer into OUTPUT."""
    from dspark.export.onnx_export import Progress, export_bundle

    if output.exists() and not force:
        raise DSparkError(f"{output} exists; pass --force to replace it")
    progress = Progress(5, quiet)
    with progress.step(f"loading target {target} and draft {draft}"):
        from dspark.models.pair import load_pair

        pair = load_pair(target, draft)
    if block_size is not None and block_size != pair.drafter.cfg.block_size:
        raise DSparkError(f"--block-size {block_size} differs from the draft's block_size "
                          f"{pair.drafter.cfg.block_size} (a DSpark drafter is trained for one block size)")
    export_bundle(pair, output, max_context=max_context, force=force, progress=progress)
    if not quiet:
        click.echo(f"wrote {output}")


# ------------------------------------------------------------------------------------------------------ dspark


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main_cli():
    """Run DSpark speculative decoding: run, bench, train, calibrate, demo."""


@main_cli.command("run")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (rendered with the bundle's chat template).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1, 1 << 20))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threshold", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Verify only the prefix whose calibrated survival reaches this value (0 = all).")
@click.option("--ar", is_flag=True, help="Decode autoregressively with the same verifier graph.")
@click.option("--threads", type=click.IntRange(1, 256), help="ONNX Runtime intra-op threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def run_cmd(bundle, prompt, max_new_tokens, temperature, seed, threshold, ar, threads, as_json):
    """Decode PROMPT with a bundle on ONNX Runtime, streaming the text; ends with tau and tokens/s."""
    from dspark.runtime import Runtime

    rt = Runtime(bundle, threads=threads)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, threshold=threshold, ar=ar)
    if as_json:
        res = rt.generate([prompt], **kw)[0]
        click.echo(json.dumps({"text": rt.tokenizer.decode(res.token_ids), "token_ids": res.token_ids,
                               "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 2),
                               "rounds": res.rounds, "stopped": res.stopped, "mode": "ar" if ar else "dspark"}))
        return
    for piece in rt.stream(prompt, **kw):
        click.echo(piece, nl=False)
    res = rt.last.results[0]
    click.echo(f"\n\n[{'AR' if ar else 'DSpark'}] {len(res.token_ids)} tokens, tau {res.tau:.2f} over "
               f"{res.rounds} rounds, {res.tokens_per_s:.1f} tokens/s", err=True)


@main_cli.command("reference")
@click.option("--target", default="smollm2-135m", show_default=True, help="HF folder, .gguf file or short name.")
@click.option("--draft", default="random", show_default=True,
              help="DeepSpec checkpoint folder, short name, or 'random[:SEED]' (untrained).")
@click.option("--prompt", help="Prompt text (default: the first dev prompt).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, 100000))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@click.option("--seed", default=0, show_default=True)
@click.option("--threshold", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Verify only the prefix whose calibrated survival reaches this value (0 = verify all).")
@click.option("--check-ar/--no-check-ar", default=True, show_default=True,
              help="Also decode autoregressively and compare (greedy: token for token).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def reference_cmd(target, draft, prompt, max_new_tokens, temperature, seed, threshold, check_ar, as_json):
    """DSpark decoding with the PyTorch reference (batch 1), compared with autoregressive decoding."""
    import time

    from dspark.models.pair import load_pair
    from dspark.models.reference import generate_ar, generate_dspark
    from dspark.tokenizer import ChatTokenizer

    pair = load_pair(target, draft, seed)
    tok = ChatTokenizer(pair.loaded.folder)
    if prompt is None:
        prompt = read_prompts(default_dev_prompts(), limit=1)[0]["prompt"]
    ids = tok.encode_chat(prompt)
    t0 = time.perf_counter()
    ds = generate_dspark(pair.target, pair.drafter, [ids], max_new_tokens, temperature, seed, tok.stop_ids,
                         threshold)[0]
    ds_s = time.perf_counter() - t0
    out = {"prompt": prompt, "text": tok.decode(ds.token_ids), "token_ids": ds.token_ids, "tau": round(ds.tau, 3),
           "rounds": ds.rounds, "dspark_s": round(ds_s, 2), "draft": draft}
    if check_ar:
        t0 = time.perf_counter()
        ar = generate_ar(pair.target, [ids], max_new_tokens, temperature, seed, tok.stop_ids)[0]
        out["ar_s"] = round(time.perf_counter() - t0, 2)
        out["equals_ar"] = ar.token_ids == ds.token_ids
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"prompt: {prompt}\n\n{out['text']}\n")
    click.echo(f"tau {out['tau']:.2f} over {ds.rounds} rounds, {len(ds.token_ids)} tokens in {ds_s:.1f}s")
    if check_ar:
        verdict = "equals" if out["equals_ar"] else "DIFFERS FROM"
        click.echo(f"DSpark output {verdict} the autoregressive output ({'greedy' if temperature == 0 else 'sampled'})")
        if temperature == 0 and not out["equals_ar"]:
            sys.exit(1)


@main_cli.command("demo")
@click.pass_context
def demo_cmd(ctx):
    """The reference DSpark decode of a dev prompt on SmolLM2-135M-Instruct, checked against AR decoding."""
    ctx.invoke(reference_cmd, target="smollm2-135m", draft="random", prompt=None, max_new_tokens=64,
               temperature=0.0, seed=0, threshold=0.0, check_ar=True, as_json=False)


if __name__ == "__main__":
    main_cli()
