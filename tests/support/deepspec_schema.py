"""What DeepSpec's Qwen3 DSpark model reads from a checkpoint (deepseek-ai/DeepSpec afdfa7c,
deepspec/modeling/dspark/qwen3/: its config builder, `Qwen3DSparkModel.__init__` and its layers), written down
here so tests can hold dspark's output to it without importing DeepSpec: the config is a transformers
`Qwen3Config` with the DSpark fields the model asserts, and the weights carry its module names."""
from __future__ import annotations

from transformers import Qwen3Config

# read by the model and its layers whatever the heads
FIELDS = {"architectures": list, "hidden_size": int, "num_hidden_layers": int, "num_attention_heads": int,
          "num_key_value_heads": int, "head_dim": int, "intermediate_size": int, "vocab_size": int,
          "rms_norm_eps": float, "attention_bias": bool, "attention_dropout": (int, float), "layer_types": list,
          "num_target_layers": int, "target_layer_ids": list, "block_size": int, "mask_token_id": int,
          "num_anchors": int, "enable_confidence_head": bool, "markov_rank": int, "tie_word_embeddings": bool}
WITH_MARKOV = {"markov_head_type": str}
WITH_CONFIDENCE = {"confidence_head_with_markov": bool}


def config_problems(raw: dict) -> list[str]:
    """What DeepSpec's model would miss or misread in this config.json (empty: it loads)."""
    config = Qwen3Config(**raw)  # DeepSpec's model takes the target's transformers config class
    wanted = dict(FIELDS)
    if int(getattr(config, "markov_rank", 0)) > 0:
        wanted.update(WITH_MARKOV)
    if bool(getattr(config, "enable_confidence_head", False)):
        wanted.update(WITH_CONFIDENCE)
    problems = [f"{k} missing" for k in wanted if not hasattr(config, k)]
    problems += [f"{k} is {type(getattr(config, k)).__name__}" for k, t in wanted.items()
                 if hasattr(config, k) and not isinstance(getattr(config, k), t)]
    if getattr(config, "architectures", None) != ["Qwen3DSparkModel"]:
        problems.append(f"architectures {getattr(config, 'architectures', None)}")
    if config.tie_word_embeddings:
        problems.append("tie_word_embeddings true (DeepSpec's LM head is its own)")
    if len(config.layer_types) != config.num_hidden_layers or set(config.layer_types) != {"full_attention"}:
        problems.append(f"layer_types {config.layer_types}")
    return problems


def weight_names(raw: dict) -> set[str]:
    """Every parameter name of DeepSpec's model for this config (its state dict)."""
    names = {"embed_tokens.weight", "lm_head.weight", "norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if raw["markov_rank"] > 0:
        names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        kind = raw.get("markov_head_type", "vanilla")
        if kind == "gated":
            names |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
        elif kind == "rnn":
            names |= {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}
    if raw["enable_confidence_head"]:
        names |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return names
