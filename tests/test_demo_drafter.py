"""The demo drafter shipped in the package: DeepSpec format, fits SmolLM2, small, calibrated, documented."""
import json

from dspark.models.checkpoint import read_draft_config
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


def test_demo_drafter_fits_smollm2(smollm2):
    from dspark.models.checkpoint import load_draft

    pair, _ = smollm2
    body = pair.loaded.hf_model
    drafter = load_draft(NAME, pair.loaded.config, body.model.embed_tokens, body.lm_head)
    assert "embed_tokens.weight" not in drafter.trainable_state_dict()
