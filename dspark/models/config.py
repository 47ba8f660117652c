"""Dimensions of the target and the draft, read from their config.json files."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dspark.bundle import MAX_BLOCK, check_expected_acceptance
from dspark.errors import DSparkError
from dspark.models.gemma4_config import (FULL, GEMMA4_DRAFT_DERIVED, GEMMA4_DRAFT_KEPT, GEMMA4_TEXT, GEMMA4_TOP,
                                         SLIDING, gemma4_draft_fields, gemma4_draft_geometry_dict, gemma4_fields,
                                         gemma4_text_config)
from dspark.schema import Fields, check_number

SUPPORTED_FAMILIES = ("llama", "qwen3", "gemma4")
MODEL_TYPES = ("llama", "qwen3", *GEMMA4_TOP, *GEMMA4_TEXT)  # gemma4*: family gemma4
WEIGHTS = "model.safetensors"  # a DeepSpec checkpoint's weights, or shards listed by WEIGHTS_INDEX
WEIGHTS_INDEX = "model.safetensors.index.json"
DEEPSPEC_NUM_ANCHORS = 512  # anchors per sequence in DeepSpec's training (its config.json must name it)
MARKOV_TYPES = ("vanilla", "gated", "rnn")


def _rope(cfg: Fields) -> dict[str, Any]:
    """rope_parameters in the transformers 5 layout (older configs keep rope_theta/rope_scaling at top level)."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = dict(Fields(raw, f"{cfg.where}.rope_parameters").raw)
    rope.setdefault("rope_theta", cfg.number("rope_theta", positive=True, default=10000.0))
    check_number(rope["rope_theta"], f"{cfg.where}.rope_theta", positive=True)
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
    if rope["rope_type"] not in ("default", "llama3"):
        raise DSparkError(f"rope_type {rope['rope_type']!r} is not supported (supported: default, llama3)")
    return rope


@dataclass(frozen=True)
class LayerGeometry:
    """The decoder-layer dimensions and RoPE that the target and the draft configs both carry."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: dict[str, Any] = field(compare=False, hash=False)


def _geometry(cfg: Fields, with_rope: bool = True) -> dict[str, Any]:
    """LayerGeometry's fields from an HF config.json (num_key_value_heads and head_dim may be absent), each
    checked for type and range. Without with_rope (Gemma-4: RoPE by layer type) the caller reads the RoPE."""
    d, heads = cfg.integer("hidden_size", 1), cfg.integer("num_attention_heads", 1)
    kv = cfg.integer("num_key_value_heads", 1, heads, default=heads)
    if heads % kv:
        cfg.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    return dict(
        hidden_size=d,
        num_layers=cfg.integer("num_hidden_layers", 1, 4096),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=cfg.integer("head_dim", 1, default=d // heads or None),
        intermediate_size=cfg.integer("intermediate_size", 1),
        vocab_size=cfg.integer("vocab_size", 1),
        rms_norm_eps=cfg.number("rms_norm_eps", positive=True),
        rope=_rope(cfg) if with_rope else {},
    )


@dataclass(frozen=True)
class TargetConfig(LayerGeometry):
    """The target's geometry. Llama/Qwen3 layers are uniform; Gemma-4 mixes sliding-window layers (head_dim,
    num_kv_heads, `rope`) with full layers (their own head dim and KV heads, `rope_full`): the per-layer tuples
    say which, and num_kv_heads/head_dim/rope are then the sliding layers'."""

    family: str
    tie_word_embeddings: bool
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    sliding_window: int = 0  # a sliding layer's query at position p sees keys at positions > p - sliding_window
    k_eq_v: bool = False  # full layers have no v_proj: V is k_proj's output (v_norm'd, no RoPE)
    final_logit_softcapping: float = 0.0  # 0: none, else logits = s * tanh(logits / s)
    embed_scale: float = 1.0  # the input embedding is multiplied by it (Gemma: sqrt(hidden_size))
    rope_full: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "target config") -> "TargetConfig":
        model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
        if model_type not in MODEL_TYPES:
            raise DSparkError(f"target model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
        if model_type in GEMMA4_TOP + GEMMA4_TEXT:
            return cls._gemma4(cfg, where)
        fields = Fields(cfg, where)
        return cls(**_geometry(fields), family=model_type,
                   tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False))

    @classmethod
    def _gemma4(cls, cfg: dict[str, Any], where: str) -> "TargetConfig":
        text, text_where = gemma4_text_config(cfg, where)
        fields = Fields(text, text_where)
        geometry = _geometry(fields, with_rope=False)
        extra = gemma4_fields(fields, geometry["num_layers"], geometry["num_heads"], geometry["head_dim"],
                              geometry["num_kv_heads"])
        geometry["rope"] = extra.pop("rope")
        tie = Fields(cfg, where).boolean("tie_word_embeddings", default=fields.boolean("tie_word_embeddings",
                                                                                        default=True))
        return cls(**geometry, **extra, family="gemma4", tie_word_embeddings=tie)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def rope_of(self, layer: int) -> dict[str, Any]:
        return self.rope_full if self.layer_types and not self.is_sliding(layer) else self.rope

    @property
    def uniform(self) -> bool:
        """Every layer has the same KV geometry, RoPE and unbounded attention (one [L, 2, B, Hkv, cap, hd] cache)."""
        return not self.layer_types

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_types and self.layer_types[i] == FULL)


@dataclass(frozen=True)
class DraftConfig(LayerGeometry):
    """The DSpark fields of a DeepSpec draft config.json plus the layer geometry it inherits."""

    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    # Sequential Temperature Scaling: one temperature per block position (1.0 = uncalibrated).
    confidence_temperatures: tuple[float, ...] = ()
    # False: the block has one more slot than it drafts, and the anchor slot's output is dropped (slot k predicts the
    # token at its own position p+k, as z-lab's and SpecForge's DFlash do); True: DeepSpec's anchor-first convention.
    sample_from_anchor: bool = True
    # > 0: the drafter's own LM head (and Markov output) has this many rows, one per target id of a d2t map
    draft_vocab_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # DeepSpec's draft architecture: "qwen3" (Qwen3DSparkModel, for Qwen3 and Llama targets) or "gemma4"
    # (Gemma4DSparkModel: the fields below, sandwich norms, v_norm, gelu-tanh MLP; see drafter_gemma4)
    variant: str = "qwen3"
    k_eq_v: bool = False
    final_logit_softcapping: float = 0.0
    embed_scale: float = 1.0

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def block_slots(self) -> int:
        """Input slots of a block: block_size, plus the anchor's when it predicts nothing."""
        return self.block_size + (0 if self.sample_from_anchor else 1)

    @property
    def head_rows(self) -> int:
        """Rows of the draft LM head and Markov output: the draft vocabulary's, else the target's."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def conf_in_features(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @property
    def sts_temperatures(self) -> tuple[float, ...]:
        return self.confidence_temperatures or (1.0,) * self.block_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "draft config") -> "DraftConfig":
        """The draft config schema: every field's type and range and the relations between them (DSparkError)."""
        fields = Fields(cfg, where)
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith("DSparkModel") for a in archs):
            raise DSparkError(f"not a DSpark draft config (architectures={archs!r}, expected e.g. ['Qwen3DSparkModel'])")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size", "rms_norm_eps", "target_layer_ids", "block_size", "mask_token_id",
                               "num_target_layers") if k not in cfg]
        if missing:
            raise DSparkError(f"draft config.json lacks {', '.join(missing)}")
        rank = fields.integer("markov_rank", 0, 1 << 16, default=0)
        temps = fields.number_list("confidence_temperatures", positive=True, default=[])
        gemma = "Gemma4DSparkModel" in archs
        geometry, variant, known = _geometry(fields, with_rope=not gemma), {}, _DRAFT_KEYS
        if gemma:
            variant = gemma4_draft_fields(fields, geometry)
            known = (_DRAFT_KEYS - set(GEMMA4_DRAFT_KEPT)) | set(GEMMA4_DRAFT_DERIVED)
        out = cls(
            **geometry, **variant,
            num_target_layers=fields.integer("num_target_layers", 1, 4096),
            target_layer_ids=tuple(fields.int_list("target_layer_ids", -1, 4096)),
            block_size=fields.integer("block_size", 1, MAX_BLOCK),
            mask_token_id=fields.integer("mask_token_id"),
            markov_rank=rank,
            markov_head_type=fields.string("markov_head_type", default="vanilla"),
            enable_confidence_head=fields.boolean("enable_confidence_head", default=False),
            confidence_head_with_markov=fields.boolean("confidence_head_with_markov", default=rank > 0),
            confidence_temperatures=tuple(temps),
            sample_from_anchor=fields.boolean("sample_from_anchor", default=True),
            draft_vocab_size=fields.integer("draft_vocab_size", 0, default=0),
            extra={k: v for k, v in cfg.items() if k not in known},
        )
        if fields.has("expected_acceptance"):
            check_expected_acceptance(fields.obj("expected_acceptance"), out.block_size)
        out.validate()
        # settings of a head the draft does not have mean nothing: kept as to_dict writes them (it omits them)
        return dataclasses.replace(
            out, markov_head_type=out.markov_head_type if rank > 0 else "vanilla",
            confidence_head_with_markov=out.confidence_head_with_markov if out.enable_confidence_head else rank > 0)

    def validate(self) -> None:
        ids = list(self.target_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < -1:
            raise DSparkError(f"draft target_layer_ids {ids} must be strictly increasing ids >= -1")
        _check_taps(ids, self.num_target_layers, "draft target_layer_id")
        if self.markov_head_type not in MARKOV_TYPES:
            raise DSparkError(f"draft markov_head_type {self.markov_head_type!r} is not one of {', '.join(MARKOV_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise DSparkError("draft config asks for confidence_head_with_markov but markov_rank is 0")
        if self.confidence_temperatures and len(self.confidence_temperatures) != self.block_size:
            raise DSparkError(f"draft confidence_temperatures has {len(self.confidence_temperatures)} entries, "
                              f"block_size is {self.block_size}")
        if self.draft_vocab_size >= self.vocab_size:
            raise DSparkError(f"draft draft_vocab_size {self.draft_vocab_size} is not below vocab_size {self.vocab_size}")
        if self.block_slots > MAX_BLOCK:
            raise DSparkError(f"draft block of {self.block_slots} slots is over {MAX_BLOCK}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DSparkError(f"draft mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """A config.json DeepSpec's loader reads (Qwen3DSparkModel fields), plus our optional extras."""
        cfg: dict[str, Any] = dict(self.extra)
        cfg.update(
            architectures=["Qwen3DSparkModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope),
            attention_bias=False,
            hidden_act="silu",
            tie_word_embeddings=False,
            layer_types=["full_attention"] * self.num_layers,
            num_target_layers=self.num_target_layers,
            target_layer_ids=list(self.target_layer_ids),
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            enable_confidence_head=self.enable_confidence_head,
            markov_rank=self.markov_rank,
            num_anchors=self.extra.get("num_anchors", DEEPSPEC_NUM_ANCHORS),  # DeepSpec's model asserts it
        )
        if self.enable_confidence_head:
            cfg["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.markov_rank > 0:
            cfg["markov_head_type"] = self.markov_head_type
        if self.confidence_temperatures:
            cfg["confidence_temperatures"] = list(self.confidence_temperatures)
        if not self.sample_from_anchor:  # dspark's extension: DeepSpec ignores it (docs/convert.md)
            cfg["sample_from_anchor"] = False
        if self.draft_vocab_size:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        if self.variant == "gemma4":
            for key in ("hidden_act", "head_dim", "num_key_value_heads"):
                del cfg[key]
            cfg.update(gemma4_draft_geometry_dict(self))
        return cfg

    def check_fits(self, target: TargetConfig) -> None:
        """Refuse a draft that cannot run against this target, naming the first thing that differs."""
        checks = [
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("num_target_layers", self.num_target_layers, target.num_layers),
        ]
        for name, ours, theirs in checks:
            if ours != theirs:
                raise DSparkError(f"draft does not fit the target: draft {name}={ours}, target has {theirs}")
        if (self.variant == "gemma4") != (target.family == "gemma4"):
            raise DSparkError(f"draft does not fit the target: a {self.variant}-style draft for a {target.family} "
                              f"target (Gemma-4 targets take Gemma4DSparkModel drafts, others Qwen3DSparkModel)")
        _check_taps(self.target_layer_ids, target.num_layers, "draft does not fit the target: target_layer_id")


def with_claim(cfg: DraftConfig, accept_at, measured: str) -> DraftConfig:
    """`cfg` claiming this acceptance per position (`expected_acceptance`, kept in config.json and carried into
    bundles: the collapse alarm of `dspark-export check` holds a bundle to it). NaN positions (never reached)
    are left out from the first one on."""
    values = []
    for a in accept_at:
        if a != a:
            break
        values.append(round(float(a), 4))
    extra = {k: v for k, v in cfg.extra.items() if k != "expected_acceptance"}
    if values:
        extra["expected_acceptance"] = {"accept_at": values, "measured": measured}
    return dataclasses.replace(cfg, extra=extra)


def _check_taps(ids, num_layers: int, what: str) -> None:
    last = num_layers - 1
    for i in ids:
        if i >= last:
            where = "is the target's last layer" if i == last else f"is beyond the target's {num_layers} layers"
            raise DSparkError(f"{what} {i} {where} (allowed: -1..{last - 1})")


_DRAFT_KEYS = {
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_parameters", "rope_theta", "attention_bias",
    "hidden_act", "tie_word_embeddings", "layer_types", "num_target_layers", "target_layer_ids", "block_size",
    "mask_token_id", "enable_confidence_head", "confidence_head_with_markov", "markov_rank", "markov_head_type",
    "confidence_temperatures", "sample_from_anchor", "draft_vocab_size",
}


def default_tap_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """Evenly spread taps from layer 1 to layer L-3, as DeepSpec's configs do ([1, 9, 17, 25, 33] for 36 layers)."""
    last = num_target_layers - 3
    if last <= 1:
        return tuple(range(-1, num_target_layers - 1))[-count:]
    ids = sorted({1 + round(i * (last - 1) / (count - 1)) for i in range(count)})
    return tuple(ids)


def draft_config_for(target: TargetConfig, *, mask_token_id: int, num_layers: int = 1, block_size: int = 7,
                     target_layer_ids: tuple[int, ...] | None = None, markov_rank: int = 64,
                     markov_head_type: str = "vanilla", confidence_head: bool = True,
                     intermediate_size: int | None = None) -> DraftConfig:
    """A new DSpark draft config whose geometry and RoPE follow the target (as DeepSpec's configs do; a Gemma-4
    target's draft layers are copies of its full layers: see gemma4_draft_fields)."""
    full = target.full_layer_ids[0] if target.full_layer_ids else 0
    variant: dict[str, Any] = {}
    if target.family == "gemma4":
        variant = dict(variant="gemma4", k_eq_v=target.k_eq_v, final_logit_softcapping=target.final_logit_softcapping,
                       embed_scale=target.embed_scale,
                       extra=dict(head_dim=target.head_dim, num_key_value_heads=target.num_kv_heads,
                                  rope_parameters={SLIDING: dict(target.rope), FULL: dict(target.rope_full)}))
    cfg = DraftConfig(
        hidden_size=target.hidden_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.kv_heads_of(full),
        head_dim=target.head_dim_of(full),
        intermediate_size=intermediate_size or target.intermediate_size,
        vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps,
        rope=dict(target.rope_of(full)),
        **variant,
        num_target_layers=target.num_layers,
        target_layer_ids=tuple(target_layer_ids or default_tap_ids(target.num_layers)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=confidence_head,
        confidence_head_with_markov=markov_rank > 0,
    )
    cfg.validate()
    cfg.check_fits(target)
    return cfg
