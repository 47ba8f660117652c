"""The demo drafter shipped in the package: DeepSpec format, fits SmolLM2, small, calibrated, documented."""
import json

import pytest

from dspark.demo import folder_digest
from dspark.models.checkpoint import load_draft, read_draft_config
from dspark.resolve import resolve_draft

NAME = "smollm2-135m-dspark"


def test_demo_drafter_is_deepspec_format_small_and_calibrated():
    folder = resolve_draft(NAME)
    cfg = read_draft_config(folder)
    size = (folder / "model.safetensors").stat().st_size
    assert size <= 25 * 1024 * 1024, size
    assert cfg.block_size == 7 and cfg.markov_rank <= 64 and 1 <= cfg.num_layers <= 2
    assert cfg.enable_confidence_head and len(cfg.confidence_temperatures) == cfg.block_size
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    readme = (folder / "README.md").read_text()
    assert "dspark train" in readme and "train.jsonl" in readme


@pytest.mark.integration
def test_demo_drafter_fits_smollm2(smollm2):
    pair, _ = smollm2
    body = pair.loaded.hf_model
    drafter = load_draft(NAME, pair.loaded.config, body.model.embed_tokens, body.lm_head)
    assert "embed_tokens.weight" not in drafter.trainable_state_dict()


def test_demo_bundle_cache_follows_the_drafter(tmp_path):
    """A new demo drafter must not reuse a bundle converted from the old one."""
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"w1"), ("README.md", b"doc")):
        (tmp_path / name).write_bytes(data)
    first = folder_digest(tmp_path)
    (tmp_path / "README.md").write_bytes(b"edited doc")
    assert folder_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"w2")
    assert folder_digest(tmp_path) != first
