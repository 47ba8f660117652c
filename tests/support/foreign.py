"""Draft checkpoints written in other projects' layouts (field and tensor names as docs/convert.md lists them), from
tiny dspark drafters, so the tests can load them back and compare."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.models.drafter import DSparkDrafter


def with_cfg(drafter: DSparkDrafter, ids=None, **changes) -> DSparkDrafter:
    """The same weights under a changed config (e.g. sample_from_anchor=False); with `ids` (and draft_vocab_size in
    changes) the drafter's own LM head and Markov output become those rows of the original's, perturbed so they are
    not the target's."""
    cfg = dataclasses.replace(drafter.cfg, **changes)
    fixed = cfg.draft_vocab_size > 0
    new = DSparkDrafter(cfg, embed_tokens=drafter.embed_tokens, lm_head=None if fixed else drafter.lm_head)
    state = {k: v for k, v in drafter.state_dict().items()}
    if fixed:
        rows = torch.as_tensor(ids)
        g = torch.Generator().manual_seed(7)
        head = state["lm_head.weight"][rows]
        state["lm_head.weight"] = head + 0.5 * torch.randn(head.shape, generator=g)
        if "markov_head.markov_w2.weight" in state:
            state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][rows]
    new.load_state_dict(state)
    if fixed:
        new.set_draft_vocab(ids)
    return new.eval()


def _decoder_fields(cfg) -> dict:
    return dict(model_type="qwen3", hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope["rope_theta"], rope_scaling=None, attention_bias=False, hidden_act="silu",
                layer_types=["full_attention"] * cfg.num_layers, tie_word_embeddings=False, use_sliding_window=False,
                sliding_window=None, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, use_cache=True)


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _slots(cfg) -> int:
    """The foreign block_size: input slots of a block (DFlash counts the anchor's)."""
    return cfg.block_slots


def zlab_dflash(drafter: DSparkDrafter, folder, block_in_dflash_config: bool = False) -> Path:
    """z-lab/dflash: a Qwen3 config + dflash_config; no embedding or LM head, no heads."""
    cfg = drafter.cfg
    assert not cfg.sample_from_anchor and cfg.markov_rank == 0 and not cfg.enable_confidence_head
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    config = {**_decoder_fields(cfg), "architectures": ["DFlashDraftModel"],
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "num_target_layers": cfg.num_target_layers,
              "dflash_config": dflash, "dtype": "float32"}
    if block_in_dflash_config:
        dflash["block_size"] = _slots(cfg)
    else:
        config["block_size"] = _slots(cfg)
    return _write(folder, config, drafter.trainable_state_dict())


def specforge_dspark(drafter: DSparkDrafter, folder, early_names: bool = False) -> Path:
    """SpecForge's DSparkDraftModel: DFlash's config with the head settings in dflash_config; early checkpoints kept
    the heads under logit_head.*."""
    cfg = drafter.cfg
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
              "projector_type": "dspark", "attention_mode": "gqa", "markov_rank": cfg.markov_rank,
              "markov_head_type": cfg.markov_head_type, "enable_confidence_head": cfg.enable_confidence_head,
              "confidence_head_with_markov": cfg.confidence_head_with_markov,
              "confidence_head_alpha": 1.0 if cfg.enable_confidence_head else 0.0}
    if cfg.sample_from_anchor:
        dflash["shift_label"] = True
    config = {**_decoder_fields(cfg), "architectures": ["DSparkDraftModel"], "block_size": _slots(cfg),
              "num_target_layers": cfg.num_target_layers, "dflash_config": dflash}
    state = drafter.trainable_state_dict()
    if early_names:
        state = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
                 for k, v in state.items()}
    return _write(folder, config, state)


def speculators(drafter: DSparkDrafter, folder, kind: str = "dspark", verifier_norm: bool = False) -> Path:
    """vllm-project/speculators: decoder in transformer_layer_config, hidden-state-index taps, draft_vocab_size,
    embed_tokens + lm_head stored, and d2t (offsets) / t2d (mask) for a reduced vocabulary."""
    cfg = drafter.cfg
    layer = _decoder_fields(cfg)
    for generic in ("bos_token_id", "eos_token_id", "use_cache", "tie_word_embeddings"):
        layer.pop(generic)
    config = {
        "speculators_model_type": kind, "speculators_version": "0.5.0", "architectures": [
            "DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                               "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3ForCausalLM"]}},
        "transformer_layer_config": layer, "draft_vocab_size": cfg.head_rows, "block_size": _slots(cfg),
        "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": False,
        "sample_from_anchor": cfg.sample_from_anchor, "transformers_version": "5.0.0", "dtype": "float32",
        "tie_word_embeddings": False,
    }
    if kind == "dspark":
        config.update(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                      enable_confidence_head=cfg.enable_confidence_head,
                      confidence_head_with_markov=cfg.confidence_head_with_markov)
    state = dict(drafter.state_dict())
    if drafter.fixed_vocab:
        ids = drafter.draft_ids
        state["d2t"] = ids - torch.arange(len(ids))
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, True)
    if verifier_norm:
        state["verifier_norm.weight"] = torch.ones(cfg.hidden_size)
    return _write(folder, config, state)
