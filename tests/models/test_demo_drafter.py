"""The demo drafter shipped in the package: DeepSpec format, fits SmolLM2, small, calibrated, documented."""
import json

import pytest

from support import deepspec_schema

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


@pytest.mark.integration
def test_the_demo_drafter_becomes_a_complete_deepspec_checkpoint(smollm2, tmp_path):
    """`dspark-export deepspec`: what DeepSpec's model needs to load the demo drafter alone (its config's
    num_anchors, embed_tokens, lm_head), computing the logits dspark computes with its target."""
    import torch
    from click.testing import CliRunner
    from safetensors import safe_open

    from dspark.cli import export_cli
    from dspark.models.config import DEEPSPEC_NUM_ANCHORS

    out = tmp_path / "demo-deepspec"
    result = CliRunner().invoke(export_cli, ["deepspec", "--target", "smollm2-135m", "--draft", NAME, "-o", str(out)])
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_anchors"] == DEEPSPEC_NUM_ANCHORS and raw["architectures"] == ["Qwen3DSparkModel"]
    assert deepspec_schema.config_problems(raw) == []  # every field DeepSpec's model reads, typed as it reads it
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable like any file the user writes
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert set(saved) == deepspec_schema.weight_names(raw)  # DeepSpec's state dict, no key missing or extra
    with safe_open(str(resolve_draft(NAME) / "model.safetensors"), "pt") as f:
        assert all(torch.equal(saved[k], f.get_tensor(k)) for k in f.keys())  # its own weights, bit for bit
    body = smollm2[0].loaded.hf_model
    assert torch.equal(saved["embed_tokens.weight"], body.model.embed_tokens.weight.float())
    assert torch.equal(saved["lm_head.weight"], body.lm_head.weight.float())
    alone = load_draft(out)
    hidden = torch.randn(3, body.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(alone.lm_head(hidden), body.lm_head(hidden))
    again = CliRunner().invoke(export_cli, ["deepspec", "--target", "smollm2-135m", "--draft", NAME, "-o", str(out)])
    assert again.exit_code != 0 and "--force" in again.output
