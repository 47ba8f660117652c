"""Command-line options that several commands share."""
from __future__ import annotations

import dataclasses

import click

from dspark.errors import DSparkError

WEIGHTS_OPTION = click.option(
    "--weights", default="auto", show_default=True, type=click.Choice(["auto", "packed", "mapped"]),
    help="ONNX Runtime: packed = fp32 copies of the weights at load (fastest); mapped = used from the bundle file at "
         "their stored precision (for bundles whose fp32 copy does not fit in memory; slower steps); auto = packed "
         "when it fits.")


def run_policy(policy: str, ar: bool, threshold: float | None, gate: bool):
    """`dspark run`'s --policy, or what its shorthands --ar / --threshold spell; --gate adds +gate."""
    from dspark.runtime import VerifyPolicy

    shorthand = [name for name, given in (("--ar", ar), ("--threshold", threshold is not None)) if given]
    if len(shorthand) > 1 or (shorthand and policy != "all"):
        raise DSparkError(f"{' and '.join(shorthand + (['--policy'] if policy != 'all' else []))} each name the "
                          f"policy: give one (--ar is --policy ar, --threshold T is --policy static:T)")
    if ar:
        chosen = VerifyPolicy("ar")
    elif threshold is not None:
        chosen = VerifyPolicy("all") if threshold == 0 else VerifyPolicy("static", threshold=threshold)
    else:
        chosen = VerifyPolicy.parse(policy)
    return dataclasses.replace(chosen, gate=True) if gate else chosen  # VerifyPolicy refuses ar with the gate


def ort_weights(backend: str, weights: str) -> str | None:
    """--weights for the runtime: ONNX Runtime's mode, nothing for other backends (TensorRT engines carry their
    weights inside); a mode asked of another backend is refused rather than ignored."""
    if backend == "onnxruntime":
        return weights
    if weights != "auto":
        raise DSparkError(f"--weights {weights} applies to ONNX Runtime only: {backend} engines hold their own weights")
    return None


def ort_only(backend: str, **given) -> None:
    """Refuse ONNX Runtime's thread flags (given: flag name -> whether the user set it) with another backend
    rather than ignore them."""
    named = [name.replace("_", "-") for name, on in given.items() if on]
    if backend != "onnxruntime" and named:
        raise DSparkError(f"--{named[0]} applies to ONNX Runtime only: {backend} runs its engines on the GPU "
                          f"with threads of its own (drop --{named[0]})")


def sampling_options(command):
    """`dspark run`'s sampling parameters beyond --temperature (dspark.runtime.sampling)."""
    options = [
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0),
                     help="Sample from the k most likely tokens (0: all)."),
        click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
                     help="Sample from the smallest most-likely set holding this much probability."),
        click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
                     help="Drop tokens under this fraction of the top token's probability."),
        click.option("--repetition-penalty", default=1.0, show_default=True,
                     type=click.FloatRange(0.0, 100.0, min_open=True),
                     help="Divide the positive logits of tokens in the prompt or output by it (multiply the "
                          "negative ones)."),
        click.option("--presence-penalty", default=0.0, show_default=True, type=click.FloatRange(-2.0, 2.0),
                     help="Subtract it from the logits of tokens already generated."),
        click.option("--frequency-penalty", default=0.0, show_default=True, type=click.FloatRange(-2.0, 2.0),
                     help="Subtract it times the count of each token already generated."),
        click.option("--logit-bias", "logit_bias", multiple=True, metavar="TOKEN_ID=BIAS",
                     help="Add BIAS (-100..100) to a token's logit; repeat for more tokens."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def sampling_params(top_k: int, top_p: float, min_p: float, repetition_penalty: float, presence_penalty: float,
                    frequency_penalty: float, logit_bias: tuple[str, ...]):
    """sampling_options' values as SamplingParams; --logit-bias TOKEN_ID=BIAS, repeated."""
    from dspark.runtime.sampling import SamplingParams

    bias = {}
    for pair in logit_bias:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise click.BadParameter(f"{pair!r} is not TOKEN_ID=BIAS (e.g. 42=-100)", param_hint="--logit-bias")
    return SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=bias)
