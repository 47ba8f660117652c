"""Load a target and its drafter together (the drafter shares the target's embedding and LM head)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

from dspark.errors import DSparkError
from dspark.files import read_json
from dspark.schema import is_int
from dspark.models.checkpoint import check_draft_folder, load_draft
from dspark.models.config import draft_config_for
from dspark.models.drafter import DSparkDrafter, init_weights
from dspark.models.tensors import TORCH, stored_low
from dspark.models.target import LoadedTarget, TargetModel, load_target, text_body

RANDOM = "random"


@dataclass
class Pair:
    loaded: LoadedTarget
    target: TargetModel
    drafter: DSparkDrafter
    draft_source: str

    def set_draft_vocab(self, ids) -> None:
        """The drafter drafts from `ids` only. Its rows of the LM head and Markov matrix are gathered when read
        if those weights are still in their checkpoints."""
        self.drafter.set_draft_vocab(ids)
        lazy = getattr(self.loaded, "lazy", None)
        d = self.drafter
        if lazy is None or ids is None:
            return
        rows = [(d.draft_lm_weight, d.lm_head.weight)]
        if d.markov_head is not None:
            rows.append((d.draft_markov_w2, d.markov_head.markov_w2.weight))
        for buffer, weight in rows:
            if buffer is not None and buffer.is_meta and weight in lazy:
                ids_of = d.draft_ids.clone()
                digest = hashlib.sha256(ids_of.numpy().tobytes()).hexdigest()
                lazy.add(buffer, lazy.identity(weight) + (("rows", digest),),
                         lambda w=weight, i=ids_of: lazy.read(w)[i])

    def realize(self, precision: str = "fp32") -> None:
        """Read every weight still on the meta device from its checkpoint and make the modules compute what a
        `precision` bundle computes (fp32 arithmetic; the weight matrices a fp16/bf16 bundle stores lower, see
        models.tensors.stored_low, rounded alike): what `dspark-export check` compares against. Those matrices
        stay in memory at their stored precision and are widened when used (a parametrization), so a bf16
        target never needs a fp32 copy of itself. Tied weights stay tied."""
        lazy = getattr(self.loaded, "lazy", None)
        low = TORCH[precision] if precision != "fp32" else None
        done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new); old kept so ids stay unique
        widened: dict[tuple[int, str], torch.nn.Module] = {}
        for module in (self.target, self.drafter):
            for m in module.modules():
                for table in (m._parameters, m._buffers):
                    for key, t in table.items():
                        if t is None:
                            continue
                        if id(t) not in done:
                            done[id(t)] = (t, _realized(t, lazy, low))
                        table[key] = done[id(t)][1]
                        if low is not None and table[key].dtype == low:  # weights and gathered rows
                            widened[(id(m), key)] = m
        for (_, key), m in widened.items():
            if isinstance(m, torch.nn.Embedding):  # widen the rows it gathers, not the whole vocabulary matrix
                m.register_forward_hook(_widen_scaled if hasattr(m, "scalar_embed_scale") else _widen_output)
            else:
                parametrize.register_parametrization(m, key, _Widen(), unsafe=True)


def _widen_output(module, args, out: torch.Tensor) -> torch.Tensor:
    return out.to(torch.float32)


def _widen_scaled(module, args, out: torch.Tensor) -> torch.Tensor:
    """A scaled embedding (Gemma) scales its rows in its weights' dtype; a bundle's graph scales the widened rows
    in fp32 (fp32 arithmetic on rounded weights), and so does the reference."""
    rows = torch.nn.functional.embedding(args[0], module.weight, module.padding_idx).to(torch.float32)
    return rows * module.embed_scale.to(torch.float32)


class _Widen(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.float32)


def _realized(t: torch.Tensor, lazy, low: torch.dtype | None) -> torch.Tensor:
    data = lazy.read(t) if t.is_meta else t.data
    if low is not None and data.is_floating_point() and stored_low(data):
        data = data.to(low)
    else:
        data = data.to(torch.float32) if data.is_floating_point() else data
    if data is t.data:
        return t
    return torch.nn.Parameter(data, requires_grad=False) if isinstance(t, torch.nn.Parameter) else data


def choose_mask_token(loaded: LoadedTarget) -> int:
    """DeepSpec uses an embedding row the tokenizer never emits (Qwen3: the first id past the tokenizer).
    Where the tokenizer fills the vocabulary, take its highest special token that is not a chat/stop marker."""
    vocab = loaded.config.vocab_size
    path = loaded.folder / "tokenizer.json"
    tok = read_json(path, kind=dict)
    model, added = tok.get("model"), tok.get("added_tokens") or []
    words = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(words, (dict, list)) or not isinstance(added, list) \
            or not all(isinstance(t, dict) and is_int(t.get("id")) and isinstance(t.get("content"), str) for t in added):
        raise DSparkError(f"{path} has no model.vocab, or added_tokens without ids: a random drafter cannot choose "
                          f"its mask token; give a draft checkpoint whose config.json sets mask_token_id")
    n_tokens = len(words) + sum(1 for t in added if t["id"] >= len(words))
    if n_tokens < vocab:
        return n_tokens
    template = ""
    for name in ("chat_template.jinja",):
        if (loaded.folder / name).exists():
            template = (loaded.folder / name).read_text()
    config = loaded.hf_model.config
    reserved = {config.bos_token_id, config.pad_token_id}
    eos = config.eos_token_id
    reserved |= set(eos) if isinstance(eos, (list, tuple)) else {eos}  # (Gemma's configs list several)
    specials = [t for t in added if t.get("special") and t["id"] not in reserved
                and t["content"] not in template]
    if not specials:
        raise DSparkError(f"no spare token for the draft's mask slot: the tokenizer uses all {vocab} ids of the "
                          "vocabulary and has no unused special token; name one the tokenizer never emits with "
                          "`dspark train --mask-token-id ID`, or give a draft checkpoint whose config.json sets "
                          "mask_token_id")
    return max(t["id"] for t in specials)


def mask_token(loaded: LoadedTarget, asked: int | None) -> int:
    """The draft's mask slot: `asked` (checked against the vocabulary) or the one choose_mask_token finds."""
    if asked is None:
        return choose_mask_token(loaded)
    vocab = loaded.config.vocab_size
    if not 0 <= asked < vocab:
        raise DSparkError(f"--mask-token-id {asked}: the target's vocabulary has ids 0..{vocab - 1}")
    return asked


def random_drafter(loaded: LoadedTarget, seed: int = 0, mask_token_id: int | None = None, **kw) -> DSparkDrafter:
    cfg = draft_config_for(loaded.config, mask_token_id=mask_token(loaded, mask_token_id), **kw)
    body = loaded.hf_model
    drafter = DSparkDrafter(cfg, embed_tokens=text_body(body).embed_tokens, lm_head=body.lm_head)
    torch.manual_seed(seed)
    init_weights(drafter)
    return drafter.eval()


def random_seed(draft: str, default: int) -> int:
    """The SEED of 'random:SEED' (a non-negative integer), else `default`."""
    if ":" not in draft:
        return default
    text = draft.split(":", 1)[1]
    if not text.isascii() or not text.isdigit() or int(text) >= 1 << 63:
        raise DSparkError(f"--draft {draft!r}: random:SEED takes a non-negative integer seed")
    return int(text)


def load_pair(target: str, draft: str, seed: int = 0, lazy: bool = False) -> Pair:
    """`draft` is a checkpoint folder, a short name, or 'random' / 'random:SEED' (an untrained drafter). With
    lazy, the target's and the draft checkpoint's weights stay in their checkpoints until read (the export streams
    them; Pair.realize loads them); a random drafter's are made in memory."""
    if draft == RANDOM or draft.startswith(RANDOM + ":"):
        seed = random_seed(draft, seed)
    else:
        check_draft_folder(draft)  # refuse a bad draft before the (slow) target load
    loaded = load_target(target, lazy=lazy)
    if draft == RANDOM or draft.startswith(RANDOM + ":"):
        drafter = random_drafter(loaded, seed)
    else:
        body = loaded.hf_model
        drafter = load_draft(draft, loaded.config, text_body(body).embed_tokens, body.lm_head, lazy=loaded.lazy)
    return Pair(loaded=loaded, target=loaded.wrapper(drafter.cfg.target_layer_ids), drafter=drafter,
                draft_source=draft)
