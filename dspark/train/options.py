"""The settings of `dspark train`: one dataclass holds each option's default, help and click type, and the
command's flags are generated from it. Torch-free, because the CLI reads it when it starts."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import click

from dspark.models.config import MARKOV_TYPES


def option(*decls: str, default: Any = MISSING, **click_kw: Any) -> Any:
    """A dataclass field whose click option is `decls` (default: --field-name) with `click_kw` (help, type, ...)."""
    return field(default=default, metadata={"click": (decls, click_kw)})


def click_options(cls: type) -> Callable:
    """Decorator: one click option per field of the dataclass `cls`, in field order, passed to the command under
    the field's name; the field's default is the option's default, and a field without one is required."""

    def decorate(command: Callable) -> Callable:
        for f in reversed(fields(cls)):
            decls, kw = f.metadata["click"]
            kw = dict(kw)
            if f.default is MISSING:
                kw["required"] = True
            elif f.default is not None:
                kw["default"] = f.default
            command = click.option(*(decls or ("--" + f.name.replace("_", "-"),)), f.name, **kw)(command)
        return command

    return decorate


PATH = click.Path(path_type=Path)


@dataclass
class TrainOptions:
    target: str = option(help="HF folder, .gguf file, or short name.")
    prompts: Path = option(type=PATH, help="JSONL prompts (never dev.jsonl).")
    output: Path = option("-o", "--output", type=PATH, help="Run folder (resumable).")
    data: Path | None = option(default=None, type=PATH, help="Response/feature cache (default OUTPUT/data; share it "
                               "between runs, e.g. DSpark and its DFlash ablation).")
    bundle: Path | None = option(default=None, type=PATH,
                                 help="Bundle used to generate responses (default: exported into OUTPUT/work).")
    max_prompts: int | None = option(default=None, type=click.IntRange(1),
                                     help="Generate responses for at most this many prompts.")
    max_tokens: int = option(default=256, show_default=True, type=click.IntRange(8))
    gen_batch: int = option(default=16, show_default=True, type=click.IntRange(1, 512))
    layers: int = option(default=2, show_default=True, type=click.IntRange(1, 64))
    block_size: int = option(default=7, show_default=True, type=click.IntRange(1, 64))
    markov_rank: int = option(default=48, show_default=True, type=click.IntRange(0, 4096))
    markov_type: str = option(default="vanilla", show_default=True, type=click.Choice(list(MARKOV_TYPES)))
    intermediate_size: int = option(default=1024, show_default=True, type=click.IntRange(1))
    confidence: bool = option("--confidence/--no-confidence", default=True, show_default=True)
    loss: str = option(default="dspark", show_default=True, type=click.Choice(["dspark", "ce"]),
                       help="dspark = 0.1 CE + 0.9 L1 + 1.0 confidence BCE; ce = DFlash's CE only.")
    steps: int = option(default=2000, show_default=True, type=click.IntRange(1))
    lr: float = option(default=6e-4, show_default=True, type=float)
    anchors: int = option(default=32, show_default=True, type=click.IntRange(1, 4096))
    seqs_per_step: int = option(default=4, show_default=True, type=click.IntRange(1, 4096))
    seed: int | None = option(default=None, type=int, help="Weights and anchor draws [default: 42; with --init-from: "
                              "mixed with the starting weights, so a continued run does not replay the blocks its "
                              "starting point saw].")
    generate_only: bool = option(default=False, is_flag=True, help="Stop after generating the response cache.")
    import_responses: Path | None = option(
        default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Merge responses generated elsewhere for the same PROMPTS and target (a responses.jsonl, e.g. from a "
             "GPU machine) into the cache; their taps are computed here, for the first --max-prompts.")
    mask_token_id: int | None = option(default=None, type=click.IntRange(0),
                                       help="The draft's mask slot: a token id the tokenizer never emits [default: "
                                            "the first id past the tokenizer, or its highest unused special token].")
    init_from: str | None = option(default=None, help="Start from this trained drafter (folder or short name) "
                                   "instead of random weights; its architecture replaces --layers/--block-size/"
                                   "--markov-*/--intermediate-size/--confidence.")
    draft_vocab: int = option(default=0, type=click.IntRange(0),
                              help="Train the heads over the N most frequent response tokens, as `dspark-export onnx "
                                   "--draft-vocab N` drafts (1.5-2x faster steps on CPU for SmolLM2); 0 = the whole "
                                   "vocabulary.")
    balance_domains: bool = option(default=False, is_flag=True,
                                   help="Draw each training sequence's domain (the prompts' `domain` field) "
                                        "uniformly, then a sequence of it: small domains are replayed more often "
                                        "(train.jsonl is ~90%% math).")
    precision: str = option(default="auto", show_default=True, type=click.Choice(["auto", "bf16", "fp32"]),
                            help="The drafter's forward in bf16 autocast (fp32 weights and losses); auto = bf16 "
                                 "where it runs natively (CUDA, CPUs with AVX512-BF16 or AMX), else fp32.")
