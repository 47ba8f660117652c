"""Draft checkpoint layouts other than DeepSpec's, read into dspark's DraftConfig and DeepSpec tensor names.

What each layout names, learned from its own code (docs/convert.md, "Which draft layouts load"):
- DeepSpec: architectures [...DSparkModel], DSpark fields at the top level; the tensor names dspark uses.
- z-lab DFlash (and SpecForge's DFlash, which writes the same): architectures [DFlashDraftModel], a Qwen3 config
  with `dflash_config` {target_layer_ids, mask_token_id, block_size (newer)}, `block_size` at the top level (older);
  tensors layers.*, norm, fc, hidden_norm, no embedding or LM head (the target's). The anchor slot predicts nothing.
- SpecForge DSpark: architectures [DSparkDraftModel], `dflash_config.projector_type` "dspark" with the Markov and
  confidence settings inside `dflash_config`; heads markov_head.*, confidence_head.proj.* (early checkpoints under
  logit_head.*); `shift_label` true is DeepSpec's anchor-first convention, false (default) predicts at the masks.
- speculators (vllm-project) dflash / dspark: `speculators_model_type`, the decoder in `transformer_layer_config`,
  `aux_hidden_state_layer_ids` counted as hidden-state indices (DeepSpec id + 1), `draft_vocab_size`, and for a
  reduced vocabulary the buffers d2t (offsets: target id = row + d2t[row]) and t2d (bool mask over the target's).
Anything else is refused in one line naming what differs. dspark writes DeepSpec's layout only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.models.config import DraftConfig
from dspark.schema import Fields

DEEPSPEC_ARCH = "Qwen3DSparkModel"
DFLASH_ARCHS = ("DFlashDraftModel", "DSparkDraftModel")
SPECULATORS_KINDS = ("dflash", "dspark")
# dflash_config entries dspark reads (z-lab, SpecForge); any other one is refused by name
DFLASH_CONFIG_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "projector_type", "attention_mode",
                      "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                      "confidence_head_alpha", "shift_label", "pure_draft_prefix_len"}
SPECULATORS_KEYS = {"speculators_model_type", "speculators_version", "speculators_config", "architectures",
                    "transformer_layer_config", "draft_vocab_size", "block_size", "target_hidden_size",
                    "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal", "sample_from_anchor",
                    "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}
# what transformers' PretrainedConfig writes into every config.json (speculators' configs are PretrainedConfigs)
GENERIC_KEYS = {"_name_or_path", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
                "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type",
                "return_dict", "transformers_version", "tie_word_embeddings", "use_cache", "pad_token_id",
                "bos_token_id", "eos_token_id", "tokenizer_class", "auto_map"}
# tensors a speculators checkpoint may carry for training only (the verifier's copies), never the drafter's
TRAINING_ONLY = frozenset({"verifier_lm_head.weight", "verifier_norm.weight"})
VOCAB_MAPS = ("d2t", "t2d")
ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")
# tensors of drafters whose layers compute something dspark's do not (speculators' converter meets them in
# Laguna-style DFlash checkpoints): refused by name rather than reported as missing q_proj
FOREIGN_PIECES = {"qkv_proj": "a fused qkv_proj (dspark reads separate q_proj, k_proj, v_proj)",
                  ".g_proj.": "an attention output gate g_proj", "aux_hidden_norms.": "per-tap norms aux_hidden_norms"}
SPECFORGE_HEAD_PREFIXES = (("logit_head.markov_head.", "markov_head."),
                           ("logit_head.confidence_head.", "confidence_head."))


@dataclass(frozen=True)
class Layout:
    name: str
    config: DraftConfig
    renames: tuple[tuple[str, str], ...] = ()  # a checkpoint name prefix -> dspark's
    dropped: frozenset[str] = frozenset()  # checkpoint tensors that are not the drafter's

    def local_name(self, name: str) -> str | None:
        """dspark's name for a checkpoint tensor (None: not one of the drafter's weights)."""
        if name in self.dropped or name in VOCAB_MAPS:
            return None
        for piece, what in FOREIGN_PIECES.items():
            if piece in name:
                raise DSparkError(f"draft checkpoint ({self.name}) has {what} ({name}): dspark's draft layers have "
                                  f"no such weight")
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name


def detect(raw: dict[str, Any], where: str, num_target_layers: int | None = None) -> Layout:
    """The layout of a draft config.json, mapped onto DeepSpec's fields. `num_target_layers`: the target's depth
    where the layout does not record it (speculators)."""
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if "speculators_model_type" in raw:
        return _speculators(raw, where, num_target_layers)
    if "dflash_config" in raw or any(a in DFLASH_ARCHS for a in archs):
        return _dflash(raw, where, archs)
    if any(isinstance(a, str) and a.endswith("DSparkModel") for a in archs):
        return Layout("DeepSpec", DraftConfig.from_dict(raw, where))
    if any(isinstance(a, str) and "eagle" in a.lower() for a in archs):
        raise DSparkError(f"{where} is an EAGLE drafter ({archs[0]}); dspark runs DSpark/DFlash block drafters only")
    raise DSparkError(f"not a DSpark draft config (architectures={archs!r}, expected e.g. ['{DEEPSPEC_ARCH}']; "
                      f"dspark also reads z-lab/SpecForge DFlashDraftModel/DSparkDraftModel and speculators "
                      f"dflash/dspark drafters)")


def _decoder(layer: dict[str, Any], where: str) -> dict[str, Any]:
    """The decoder fields DeepSpec's config carries, after refusing what dspark's draft layer does not compute."""
    f = Fields(layer, where)
    if f.get("attention_bias", False) is not False:
        raise DSparkError(f"{where}.attention_bias is {layer['attention_bias']!r}: dspark's draft layers have no "
                          f"projection biases")
    if f.get("hidden_act", "silu") != "silu":
        raise DSparkError(f"{where}.hidden_act is {layer['hidden_act']!r}: dspark's draft MLP is SwiGLU (silu)")
    types = layer.get("layer_types") or []
    odd = [t for t in types if t != "full_attention"] if isinstance(types, list) else [types]
    if odd or f.get("use_sliding_window", False) is True:
        raise DSparkError(f"{where} has {odd[0] if odd else 'sliding-window'} layers: dspark's draft layers are "
                          f"all full attention")
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", *ROPE_KEYS)
    return {k: layer[k] for k in keep if k in layer}


def _deepspec(decoder: dict[str, Any], where: str, **fields: Any) -> DraftConfig:
    return DraftConfig.from_dict({**decoder, "architectures": [DEEPSPEC_ARCH], **fields}, where)


def default_dflash_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's taps when dflash_config names none: the middle layer for one draft layer, else spread evenly over
    layers 1..L-3 (rounded half to even, as Python's round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [int(round(1 + i * step)) for i in range(num_draft_layers)]


def _dflash(raw: dict[str, Any], where: str, archs: list) -> Layout:
    """z-lab's DFlash and SpecForge's DFlash/DSpark: a Qwen3 config plus dflash_config."""
    f = Fields(raw, where)
    dc = f.obj("dflash_config", default={})
    unknown = sorted(set(dc.raw) - DFLASH_CONFIG_KEYS)
    if unknown:
        raise DSparkError(f"{where}: dflash_config.{unknown[0]} is a field dspark does not understand")
    dspark = "DSparkDraftModel" in archs or dc.get("projector_type") is not None
    if dc.get("projector_type") not in (None, "dspark"):
        raise DSparkError(f"{dc.where}.projector_type is {dc.get('projector_type')!r}, not 'dspark'")
    if dc.integer("pure_draft_prefix_len", 0, default=0):
        raise DSparkError(f"{dc.where}.pure_draft_prefix_len is set (a Domino drafter); dspark runs DSpark/DFlash "
                          f"block drafters only")
    if not dc.has("mask_token_id"):
        raise DSparkError(f"{where} names no dflash_config.mask_token_id (the token of the block's mask slots)")
    layers = f.integer("num_hidden_layers", 1, 4096)
    if f.has("num_target_layers"):
        depth = f.integer("num_target_layers", 1, 4096)
        taps = dc.int_list("target_layer_ids", -1, 4096, default=default_dflash_taps(depth, layers))
    elif dc.has("target_layer_ids"):
        taps = dc.int_list("target_layer_ids", -1, 4096)
        depth = max(taps, default=0) + 2  # not recorded: the shallowest target these taps fit
    else:
        raise DSparkError(f"{where} names neither num_target_layers nor dflash_config.target_layer_ids")
    block = dc.integer("block_size", 1, 1024) if dc.has("block_size") else f.integer("block_size", 1, 1024)
    anchor_first = dc.boolean("shift_label", default=False)
    if not anchor_first and block < 2:
        raise DSparkError(f"{where}: block_size {block} leaves no mask slot to draft from")
    heads: dict[str, Any] = {}
    if dspark:
        rank = dc.integer("markov_rank", 0, 1 << 16, default=0)
        alpha = dc.number("confidence_head_alpha", lo=0.0, default=0.0)
        conf = dc.boolean("enable_confidence_head", default=alpha > 0)
        heads = dict(markov_rank=rank, markov_head_type=dc.string("markov_head_type", default="vanilla").lower(),
                     enable_confidence_head=conf,
                     confidence_head_with_markov=dc.boolean("confidence_head_with_markov", default=False))
    cfg = _deepspec(_decoder(raw, where), where, num_target_layers=depth, target_layer_ids=taps,
                    block_size=block if anchor_first else block - 1, mask_token_id=dc.integer("mask_token_id"),
                    sample_from_anchor=anchor_first, **heads)
    name = "SpecForge DSpark" if dspark else "z-lab/SpecForge DFlash"
    return Layout(name, cfg, renames=SPECFORGE_HEAD_PREFIXES if dspark else ())


def _speculators(raw: dict[str, Any], where: str, num_target_layers: int | None) -> Layout:
    """vllm-project/speculators' dflash and dspark drafters."""
    kind = raw.get("speculators_model_type")
    if kind not in SPECULATORS_KINDS:
        raise DSparkError(f"draft config.json is a speculators {kind!r} drafter; dspark runs DSpark/DFlash block "
                          f"drafters only")
    unknown = sorted(set(raw) - SPECULATORS_KEYS - GENERIC_KEYS)
    if unknown:
        raise DSparkError(f"{where}: speculators field {unknown[0]!r} is one dspark does not understand")
    f = Fields(raw, where)
    layer = f.obj("transformer_layer_config")
    defaults = _layer_defaults(layer.get("model_type") or "qwen3", layer.where)
    if any(k in layer.raw for k in ROPE_KEYS):  # the checkpoint's RoPE, in whichever spelling it uses
        defaults = {k: v for k, v in defaults.items() if k not in ROPE_KEYS}
    decoder = {**defaults, **layer.raw}
    hidden, vocab = decoder.get("hidden_size"), decoder.get("vocab_size")
    if f.get("target_hidden_size") not in (None, hidden):
        raise DSparkError(f"{where}.target_hidden_size {raw['target_hidden_size']} differs from the draft's hidden "
                          f"size {hidden}: dspark's fc reads taps of the draft's width")
    aux = f.int_list("aux_hidden_state_layer_ids", 0, 4097)
    taps = [a - 1 for a in aux]  # hidden-state index (0: the embedding output) -> DeepSpec's layer id
    if not f.has("mask_token_id"):
        raise DSparkError(f"{where} names no mask_token_id (the token of the block's mask slots)")
    anchor_first = f.boolean("sample_from_anchor", default=kind == "dspark")
    block = f.integer("block_size", 1, 1024, default=8)
    if not anchor_first and block < 2:
        raise DSparkError(f"{where}: block_size {block} leaves no mask slot to draft from")
    rows = f.integer("draft_vocab_size", 1, default=32000)
    heads: dict[str, Any] = dict(markov_rank=0, enable_confidence_head=False)
    if kind == "dspark":
        heads = dict(markov_rank=f.integer("markov_rank", 0, 1 << 16, default=256),
                     markov_head_type=f.string("markov_head_type", default="vanilla"),
                     enable_confidence_head=f.boolean("enable_confidence_head", default=True),
                     confidence_head_with_markov=f.boolean("confidence_head_with_markov", default=True))
    depth = num_target_layers or max(taps) + 2  # the layout does not record the target's depth
    cfg = _deepspec(_decoder(decoder, layer.where), where, num_target_layers=depth, target_layer_ids=taps,
                    block_size=block if anchor_first else block - 1, mask_token_id=f.integer("mask_token_id"),
                    sample_from_anchor=anchor_first, draft_vocab_size=0 if rows == vocab else rows, **heads)
    return Layout(f"speculators {kind}", cfg, dropped=TRAINING_ONLY)


def _layer_defaults(model_type: str, where: str) -> dict[str, Any]:
    """The values a transformers config of this model_type takes for fields its config.json leaves out (a diff
    dict writes only the ones that differ)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError):
        raise DSparkError(f"{where}.model_type {model_type!r} is not a transformers model type") from None


def vocab_map(layout: Layout, names: set[str], read: Callable[[str], torch.Tensor]) -> np.ndarray | None:
    """The target id of each row of a reduced draft vocabulary (from d2t, checked against t2d when present), or
    None for a full-vocabulary drafter. `names`: the checkpoint's tensor names; `read` reads one."""
    cfg = layout.config
    rows, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if not rows:
        return None
    if "d2t" not in names:
        raise DSparkError(f"draft ({layout.name}) drafts from {rows} of {vocab} tokens but its checkpoint has no "
                          f"d2t map (target id of each draft token)")
    d2t = read("d2t")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (rows,):
        raise DSparkError(f"draft d2t is {d2t.dtype} {list(d2t.shape)}, expected {rows} integer offsets")
    ids = np.arange(rows, dtype=np.int64) + d2t.to(torch.int64).numpy()  # offsets: target id = row + d2t[row]
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != rows:
        raise DSparkError(f"draft d2t maps its {rows} tokens outside the target's {vocab} ids, or twice onto one")
    if "t2d" in names:
        t2d = read("t2d")
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,) or int(t2d.sum()) != rows \
                or not bool(t2d[torch.from_numpy(ids)].all()):
            raise DSparkError(f"draft t2d (a mask over the target's {vocab} ids) does not mark the {rows} ids d2t "
                              f"maps to")
    return ids
