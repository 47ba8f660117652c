"""Command-line entry points: `dspark-export` (conversion) and `dspark` (run, bench, train, calibrate, demo).

Heavy imports (torch, transformers, onnx) happen inside the commands that need them, so `dspark run` on a
bundle stays torch-free and `--help` is instant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dspark.cli.cache import cache_group
from dspark.cli.check import check_cmd
from dspark.cli.deepspec import deepspec_cmd
from dspark.cli.demo import demo_cmd
from dspark.cli.options import WEIGHTS_OPTION, ort_only, ort_weights, run_policy, sampling_options, sampling_params
from dspark.cli.quantize import fuse_cmd, quantize_cmd
from dspark.errors import DSparkError, exit_report, on_sigterm, raise_terminated
from dspark.prompts import dev_prompts_path, read_prompts
from dspark.serve.commands import serve_cmd, triton_cmd  # click only: the server loads inside the command
from dspark.train.options import TrainOptions, click_options

class FriendlyGroup(click.Group):
    """Any error ends a command with one line on stderr: bad input exits 2 (DSparkError, file errors), SIGINT and
    SIGTERM unwind (temporaries are removed) and exit 130 and 143; anything else is a bug to report."""

    def invoke(self, ctx):
        previous = on_sigterm(raise_terminated)
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # one line too, naming where the help is
            line, code = f"error: {e.format_message()} (see {(e.ctx or ctx).command_path} -h)", 2
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except BaseException as e:
            line, code = exit_report(e)
        finally:
            on_sigterm(previous)
        click.echo(" ".join(line.split("\n"))[:2000], err=True)
        sys.exit(code)


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
@click.option("--draft-vocab", type=click.IntRange(1),
              help="Draft from only this many tokens, the most frequent in the draft's training responses "
                   "(its draft_vocab.json): cheaper heads, still lossless.")
@click.option("--precision", default="auto", show_default=True,
              type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
              help="Stored precision of the weight matrices (the graphs compute in fp32; ONNX Runtime widens "
                   "them at load or maps them as they are, TensorRT builds run them at this precision). auto: the "
                   "target checkpoint's (bf16 for a bf16 checkpoint; fp32 for GGUF and fp32 ones).")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--no-check", is_flag=True, help="Skip recording reference data for `dspark-export check`.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def export_onnx_cmd(target, draft, output, block_size, max_context, draft_vocab, precision, force, no_check, quiet):
    """Export verifier.onnx, draft.onnx, heads.onnx, manifest.json and the tokenizer into OUTPUT."""
    from dspark.export.trace.onnx_export import check_draft_vocab, check_replaceable, export_bundle
    from dspark.export.trace.progress import Progress
    from dspark.models.target import check_target

    check_replaceable(output, force)
    check_target(target)  # one line for a bad target, before the progress display starts
    check_draft_vocab(draft, draft_vocab)  # before minutes of loading the target
    progress = Progress(6 if no_check else 7, quiet)
    with progress.step(f"loading target {target} and draft {draft}"):
        from dspark.models.pair import load_pair

        pair = load_pair(target, draft, lazy=True)
    if block_size is not None and block_size != pair.drafter.cfg.block_size:
        raise DSparkError(f"--block-size {block_size} differs from the draft's block_size "
                          f"{pair.drafter.cfg.block_size} (a DSpark drafter is trained for one block size)")
    export_bundle(pair, output, max_context=max_context, force=force, progress=progress, check_data=not no_check,
                  draft_vocab=draft_vocab, precision=precision)
    if not quiet:
        click.echo(f"wrote {output}")


@export_cli.command("build")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--flavor", type=click.Choice(["tensorrt", "rtx"]),
              help="TensorRT 10/11, or TensorRT for RTX (builds without a GPU). Default: whichever is installed, "
                   "TensorRT first.")
@click.option("--precision", default="fp16", show_default=True, type=click.Choice(["fp16", "bf16", "fp32"]))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 4096))
@click.option("--max-context", default=2048, show_default=True, type=click.IntRange(2, 1 << 20))
@click.option("--compute-capability", "compute_capabilities", multiple=True,
              help="rtx: a GPU target to build for (75, 80, 86, 89, 120, 121; repeat; default all but 75). "
                   "Hopper (90) is no TensorRT for RTX target.")
@click.option("--runtime-cache", help="rtx: file (relative to BUNDLE) where the runtime keeps its JIT results "
                                      "[default: engines/runtime.cache].")
@click.option("--version-compatible", is_flag=True, help="Engines that newer TensorRT runtimes can load.")
@click.option("--timing-cache", type=click.Path(path_type=Path),
              help="tensorrt: reuse and update this timing cache.")
@click.option("--plugin", type=click.Path(path_type=Path),
              help="Built C++ libdspark_trt_plugin.so (see docs/tensorrt.md); default: the plugin registered from "
                   "Python.")
def build_cmd(bundle, flavor, precision, max_batch, max_context, compute_capabilities, runtime_cache,
              version_compatible, timing_cache, plugin):
    """Build TensorRT engines for BUNDLE (rtx: on any machine; tensorrt: on the GPU they will run on)."""
    from dspark.trt.build import build_engines

    rep = build_engines(bundle, precision, max_batch, max_context, version_compatible, timing_cache, plugin,
                        flavor=flavor, compute_capabilities=tuple(compute_capabilities), runtime_cache=runtime_cache)
    for name, e in rep["engines"].items():
        click.echo(f"{name}: {e['file']} ({e['bytes'] / 1e6:.1f} MB, {e['build_s']}s, "
                   f"{rep['plugin_layers'][name]} plugin layer(s))")
    targets = f", targets {' '.join(rep['targets'])}" if rep["targets"] else f", device {rep['device']}"
    click.echo(f"{rep['flavor']} {rep['tensorrt']}, {precision}{targets}, {rep['plugin']['implementation']} plugin")


# ------------------------------------------------------------------------------------------------------ dspark


@click.group(cls=FriendlyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main_cli():
    """Run DSpark speculative decoding: run, bench, train, calibrate, demo."""


BACKEND_OPTION = click.option("--backend", default="onnxruntime", show_default=True,
                              type=click.Choice(["onnxruntime", "tensorrt"]),
                              help="tensorrt: the engines of `dspark-export build` (GPU, cuda-python).")
CUDA_GRAPHS_OPTION = click.option("--cuda-graphs", is_flag=True, help="With --backend tensorrt: replay engine launches "
                                  "as CUDA graphs.")


@main_cli.command("run")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (rendered with the bundle's chat template).")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens",
              default=128, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Tokens to generate per request at most (--max-new-tokens: the same).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--policy", default="all", show_default=True,
              help="How many drafts a round verifies, as `dspark bench` and `dspark serve` take it: ar | all | "
                   "fixed:GAMMA | static:THRESHOLD | schedule | topk, each but ar optionally +gate (skip drafting in "
                   "rounds where a plain verifier step is expected to be faster; needs the bundle's SPS table).")
@click.option("--threshold-rule", default="cumulative", show_default=True, type=click.Choice(["cumulative", "first"]),
              help="How static:T cuts: cumulative bounds the survival (product of the confidences so far); first: "
                   "DeepSpec's --confidence-threshold, cut at the first position whose own confidence is below it.")
@click.option("--ar", is_flag=True, help="Same as --policy ar.")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), help="Same as --policy static:THRESHOLD (0: all).")
@click.option("--gate", is_flag=True, help="Adds +gate to the policy (as `dspark serve --gate`).")
@click.option("--threads", type=click.IntRange(1, 256), help="ONNX Runtime intra-op threads (default: all cores).")
@BACKEND_OPTION
@CUDA_GRAPHS_OPTION
@WEIGHTS_OPTION
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def run_cmd(bundle, prompt, max_tokens, temperature, seed, policy, threshold_rule, ar, threshold, gate, threads,
            backend, cuda_graphs, weights, as_json, **sampling):
    """Decode PROMPT with a bundle (ONNX Runtime on CPU, or its TensorRT engines), streaming the text; ends with
    tau and tokens/s."""
    from dspark.calibration.sps import ensure_sps_table
    from dspark.runtime import DecodeOptions, Runtime

    ort_only(backend, threads=threads is not None)
    policy = run_policy(policy, ar, threshold, gate)
    ar = policy.is_ar
    options = DecodeOptions(max_tokens=max_tokens, temperature=temperature, seed=seed, policy=policy,
                            threshold_rule=threshold_rule, sampling=sampling_params(**sampling))
    rt = Runtime(bundle, backend=backend, threads=threads, cuda_graphs=cuda_graphs,
                 weights=ort_weights(backend, weights))
    ensure_sps_table(rt, policy, say=lambda m: click.echo(m, err=True), store=False)  # --gate without a table
    if as_json:
        res = rt.generate([prompt], options)[0]
        click.echo(json.dumps({"text": res.text, "token_ids": res.token_ids,
                               "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 2),
                               "rounds": res.rounds, "stopped": res.stopped, "mode": "ar" if ar else "dspark"}))
        return
    stream = rt.stream(prompt, options)
    for piece in stream:
        click.echo(piece, nl=False)
    res = stream.result
    drafted = f" ({stream.times.drafted} drafted)" if policy.gate else ""
    click.echo(f"\n\n[{'AR' if ar else 'DSpark'}] {len(res.token_ids)} tokens, tau {res.tau:.2f} over "
               f"{res.rounds} rounds{drafted}, {res.tokens_per_s:.1f} tokens/s", err=True)


@main_cli.command("bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--concurrency", "-R", default=1, show_default=True, type=click.IntRange(1, 4096),
              help="Requests decoding at once (continuous batching).")
@click.option("--policy", default="schedule", show_default=True,
              help="ar | all | fixed:GAMMA | static:THRESHOLD | schedule | topk, optionally +gate "
                   "(e.g. schedule+gate: skip drafting in rounds where it cannot pay)")
@click.option("--prompts", type=click.Path(path_type=Path),
              help="JSONL prompts (default: the dev prompts beside a checkout, else the demo set in the package).")
@click.option("--limit", type=click.IntRange(1), help="Use at most this many prompts.")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens",
              default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Tokens to generate per request at most (--max-new-tokens: the same).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@BACKEND_OPTION
@CUDA_GRAPHS_OPTION
@click.option("--json", "as_json", is_flag=True)
def bench_cmd(bundle, concurrency, policy, prompts, limit, max_tokens, temperature, backend, cuda_graphs,
              as_json):
    """Throughput of BUNDLE with R concurrent requests: aggregate and per-request tokens/s, tau, verify budget."""
    from dspark.calibration.sps import ensure_sps_table
    from dspark.prompts import default_prompts_path
    from dspark.runtime import Runtime, VerifyPolicy
    from dspark.runtime.decoder import context_limit, overflowing
    from dspark.runtime.measure import run_batch

    policy = VerifyPolicy.parse(policy)
    rows = read_prompts(prompts or default_prompts_path(), limit=limit)
    if not rows:
        raise DSparkError(f"{prompts} holds no prompts")
    rt = Runtime(bundle, backend=backend, cuda_graphs=cuda_graphs)
    limit = context_limit(rt.backend, rt.manifest)
    overflowing([rt.encode(r["prompt"]) for r in rows], limit, max_tokens)  # before minutes of profiling
    ensure_sps_table(rt, policy, max_batch=min(concurrency, 8), say=lambda m: click.echo(m, err=True), store=False)
    res = run_batch(rt, [r["prompt"] for r in rows], concurrency, policy, max_tokens, temperature,
                    say=lambda m: click.echo(m, err=True))
    if as_json:
        click.echo(json.dumps(res.as_dict()))
        return
    click.echo(f"{res.policy} R={res.concurrency}: {res.tokens_per_s:.1f} tok/s aggregate, "
               f"{res.per_request_tokens_per_s:.1f} tok/s per request, tau {res.tau:.2f}, "
               f"verify budget {res.mean_verify_budget:.2f} drafts/request/round, {res.drafted_rounds} of {res.rounds} "
               f"rounds drafted ({res.requests} requests)")


@main_cli.command("doctor")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--build", is_flag=True, help="Build (or rebuild) the TensorRT engines into BUNDLE first; without "
              "it doctor only reads the bundle.")
@click.option("--plugin", type=click.Path(path_type=Path), help="Built libdspark_trt_plugin.so.")
@click.option("--flavor", type=click.Choice(["tensorrt", "rtx"]),
              help="TensorRT flavor to check and build with (default: the engines', else whichever is installed).")
def doctor_cmd(bundle, build, plugin, flavor):
    """Check BUNDLE on this machine: ONNX Runtime parity, TensorRT lint, and, where TensorRT and a GPU exist,
    engines with the plugin layer, parity vs ONNX Runtime, greedy equality and speed. Says what it skipped."""
    from dspark.trt.doctor import run_doctor

    rep = run_doctor(bundle, build=build, plugin=plugin, flavor=flavor)
    click.echo(rep.format())
    sys.exit(1 if rep.failed else 0)


@main_cli.command("train")
@click_options(TrainOptions)
def train_cmd(**options):
    """Train a DSpark drafter for TARGET on the target's own responses to PROMPTS (CPU or CUDA)."""
    from dspark.train.run import TrainRun

    TrainRun(**options).run()


@main_cli.command("calibrate")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path),
              help="JSONL prompts NOT used for training (e.g. OUTPUT/heldout_prompts.jsonl of `dspark train`).")
@click.option("--sps", "sps_only", is_flag=True,
              help="Instead: profile the verifier's steps/s per batch-token count into the manifest.")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 512),
              help="With --sps: the largest batch profiled.")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path),
              help="Also store the temperatures in this DeepSpec checkpoint's config.json.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), help="Where calibration.json and "
              "reliability.png go (default: BUNDLE).")
@click.option("--limit", type=click.IntRange(1), help="Use at most this many prompts.")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens",
              default=256, show_default=True, type=click.IntRange(8),
              help="Tokens to generate per request at most (--max-new-tokens: the same).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0),
              help="Decode temperature the calibration is for (acceptance depends on it).")
@BACKEND_OPTION
def calibrate_cmd(bundle, prompts, sps_only, max_batch, draft_dir, out_dir, limit, max_tokens, temperature,
                  backend):
    """Sequential Temperature Scaling of BUNDLE's confidence head on held-out prompts (ECE, AUC, Brier per
    position); for a drafter without one (DFlash), its acceptance per block position, the policies' prior; or
    with --sps the throughput table the prefix scheduler needs."""
    if sps_only:
        from dspark.calibration.sps import profile, write_sps
        from dspark.runtime import Runtime

        rt = Runtime(bundle, backend=backend)
        result = profile(rt, max_batch=max_batch)
        write_sps(bundle, result)
        table = result["sps_table"]
        click.echo(f"SPS table for 1..{len(table)} batch tokens written to {bundle}/manifest.json")
        for m in result["sps_measurements"]:
            if m["positions"] in (1, rt.manifest.block_size + 1):
                click.echo(f"  batch {m['batch']:>3} x {m['positions']} positions: {m['steps_per_s']:.1f} steps/s")
        return
    if backend != "onnxruntime":
        raise DSparkError("--backend applies to --sps; the confidence calibration runs on ONNX Runtime")
    if prompts is None:
        raise DSparkError("give --prompts FILE (held-out prompts) or --sps")
    from dspark.calibration.calibrate import calibrate

    rows = read_prompts(prompts, limit=limit)
    report = calibrate(bundle, [r["prompt"] for r in rows], out_dir or bundle, draft_dir, max_tokens,
                       temperature, say=lambda m: click.echo(m, err=True))
    if "acceptance_prior" in report:
        click.echo(f"{report['rounds']} rounds from {report['prompts']} prompts; no confidence head: acceptance per "
                   f"position " + " ".join(f"{a:.2f}" for a in report["acceptance_prior"]) + " (the policies' prior)")
        return
    click.echo(f"{report['rounds']} rounds from {report['prompts']} prompts; STS temperatures "
               + " ".join(f"{t:.2f}" for t in report["sts_temperatures"]))
    click.echo("position  ECE before -> after   AUC    Brier")
    for b, a in zip(report["before"], report["after"]):
        click.echo(f"{b['position']:>8}  {100 * b['ece']:6.2f}% -> {100 * a['ece']:5.2f}%  {a['auc']:.3f}  {a['brier']:.3f}")


@main_cli.command("reference")
@click.option("--target", default="smollm2-135m", show_default=True, help="HF folder, .gguf file or short name.")
@click.option("--draft", default="random", show_default=True,
              help="DeepSpec checkpoint folder, short name, or 'random[:SEED]' (untrained).")
@click.option("--prompt", help="Prompt text (default: the first dev prompt).")
@click.option("--max-tokens", "--max-new-tokens", "max_tokens",
              default=64, show_default=True, type=click.IntRange(1, 100000),
              help="Tokens to generate per request at most (--max-new-tokens: the same).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 100.0))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--threshold", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Verify only the prefix whose calibrated survival reaches this value (0 = verify all).")
@click.option("--check-ar/--no-check-ar", default=True, show_default=True,
              help="Also decode autoregressively and compare (greedy: token for token).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def reference_cmd(target, draft, prompt, max_tokens, temperature, seed, threshold, check_ar, as_json):
    """DSpark decoding with the PyTorch reference (batch 1), compared with autoregressive decoding."""
    import time

    from dspark.models.pair import load_pair
    from dspark.models.reference import generate_ar, generate_dspark
    from dspark.runtime import DecodeOptions
    from dspark.tokenizer import ChatTokenizer

    DecodeOptions(max_tokens=max_tokens, temperature=temperature, seed=seed, policy=f"static:{threshold}")
    pair = load_pair(target, draft, seed)
    tok = ChatTokenizer(pair.loaded.folder)
    if prompt is None:
        prompt = read_prompts(dev_prompts_path(), limit=1)[0]["prompt"]
    ids = tok.encode_chat(prompt)
    t0 = time.perf_counter()
    ds = generate_dspark(pair.target, pair.drafter, [ids], max_tokens, temperature, seed, tok.stop_ids,
                         threshold)[0]
    ds_s = time.perf_counter() - t0
    out = {"prompt": prompt, "text": tok.decode(ds.token_ids), "token_ids": ds.token_ids, "tau": round(ds.tau, 3),
           "rounds": ds.rounds, "dspark_s": round(ds_s, 2), "draft": draft}
    if check_ar:
        t0 = time.perf_counter()
        ar = generate_ar(pair.target, [ids], max_tokens, temperature, seed, tok.stop_ids)[0]
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


for command in (serve_cmd, cache_group, demo_cmd):
    main_cli.add_command(command)
for command in (check_cmd, triton_cmd, quantize_cmd, fuse_cmd, deepspec_cmd):
    export_cli.add_command(command)
