"""Tiny random targets and drafters for fast tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark.export.trace.onnx_export import export_bundle
from dspark.models.config import TargetConfig, draft_config_for
from dspark.models.drafter import DSparkDrafter, init_weights
from dspark.models.pair import Pair
from dspark.models.target import TargetModel


def tiny_hf(family: str = "llama", vocab: int = 96, layers: int = 4, seed: int = 0, hidden: int = 32):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=(family == "llama"), attn_implementation="eager")
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // 4, rope_theta=1e6))
    model.generation_config.eos_token_id = None  # decode the full length; stop tokens are tested explicitly
    model.generation_config.pad_token_id = 0
    # Larger logits than HF's init so distributions are peaked enough to make acceptance non-trivial.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_pair(family: str = "llama", vocab: int = 96, layers: int = 4, seed: int = 0, block_size: int = 4,
              markov_rank: int = 8, markov_head_type: str = "vanilla", draft_layers: int = 1,
              tap_ids: tuple[int, ...] | None = None, confidence: bool = True, hidden: int = 32):
    hf = tiny_hf(family, vocab, layers, seed, hidden)
    target = TargetModel(hf)
    cfg = draft_config_for(target.cfg, mask_token_id=vocab - 1, num_layers=draft_layers, block_size=block_size,
                           target_layer_ids=tap_ids or tuple(range(layers - 1))[-3:], markov_rank=markov_rank,
                           markov_head_type=markov_head_type, confidence_head=confidence)
    target = TargetModel(hf, cfg.target_layer_ids).eval()
    drafter = DSparkDrafter(cfg, embed_tokens=hf.model.embed_tokens, lm_head=hf.lm_head)
    torch.manual_seed(seed + 1)
    init_weights(drafter, std=0.2)
    return hf, target, drafter.eval()


def tiny_tokenizer_folder(folder, vocab: int, stop_id: int | None = None):
    """A word-level tokenizer over 'w0'..'w{V-1}' so tiny bundles are complete (ids == word numbers)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{stop_id if stop_id is not None else vocab - 1}"}))
    if stop_id is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_id}))
    return folder


def tiny_byte_tokenizer_folder(folder):
    """A byte-level BPE tokenizer without merges: ids 0..255 are the bytes (as byte-level BPE spells them), 256 is
    the stop token; grammars (JSON) can be written in it, so structured outputs run on tiny random models."""
    from tokenizers import AddedToken, decoders

    from dspark.tokenizer import BYTE_OF_CHAR

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE({char: byte for char, byte in BYTE_OF_CHAR.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": BYTE_VOCAB - 1}))
    return folder


BYTE_VOCAB = 257  # tiny_byte_tokenizer_folder's


class TinyLoaded:
    """Stands in for LoadedTarget when exporting a tiny in-memory pair."""

    def __init__(self, hf, folder):
        self.hf_model, self.folder = hf, folder
        self.config = TargetConfig.from_dict(hf.config.to_dict())
        self.source, self.source_file = "tiny-random", folder

    def tokenizer_files(self):
        return [p for p in self.folder.iterdir() if p.is_file()]


def tiny_bundle(out, family="qwen3", vocab=16, stop_id=None, byte_tokens=False, **kw):
    """Export a tiny random pair to `out`; returns (hf, target, drafter, bundle_path). byte_tokens: a byte-level
    tokenizer (vocab BYTE_VOCAB, stop token 256) instead of words."""
    hf, target, drafter = tiny_pair(family, vocab=BYTE_VOCAB if byte_tokens else vocab, **kw)
    out = Path(out)
    tokdir = tiny_byte_tokenizer_folder(out.parent / f"{out.name}-tokenizer") if byte_tokens else \
        tiny_tokenizer_folder(out.parent / f"{out.name}-tokenizer", vocab, stop_id)
    pair = Pair(loaded=TinyLoaded(hf, tokdir), target=target, drafter=drafter, draft_source="random")
    export_bundle(pair, out, max_context=256, force=True, quiet=True)
    return hf, target, drafter, out


def twin_naming_its_source(bundle, out, twin: str, source: str) -> Path:
    """A linked copy of `bundle` whose manifest entry `twin` (an ONNX Runtime twin) names the graph `source`: a
    hostile or stale manifest."""
    from dspark.bundle import Manifest
    from dspark.files import linked_copy

    out = Path(out)
    linked_copy(bundle, out)
    man = Manifest.read(out)
    man.graphs[twin] = man.graphs[source]
    man.write(out)
    return out


def restamp(bundle: Path) -> None:
    """Record a hand-edited bundle's graph hashes in its manifest: a bundle built wrong but consistent with its
    manifest (what the parity checks must catch), not a damaged copy (what loading refuses)."""
    from dspark.bundle import Manifest, sha256_file

    manifest = Manifest.read(bundle)
    for spec in manifest.graphs.values():
        spec.sha256 = sha256_file(Path(bundle) / spec.file)
    manifest.write(bundle)
