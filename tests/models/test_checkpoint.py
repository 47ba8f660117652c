"""DeepSpec checkpoint format: key names, round trip, and one-line refusals of bad checkpoints."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DSparkError
from dspark.models.checkpoint import load_draft, save_draft
from support.tiny import tiny_pair

LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight"}


def deepspec_keys(layers, markov, with_shared):
    keys = {f"layers.{i}.{k}" for i in range(layers) for k in LAYER_KEYS}
    keys |= {"norm.weight", "fc.weight", "hidden_norm.weight", "markov_head.markov_w1.weight",
             "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    keys |= {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
             "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}.get(markov, set())
    if with_shared:
        keys |= {"embed_tokens.weight", "lm_head.weight"}
    return keys


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_round_trip_with_deepspec_names(tmp_path, markov):
    _, target, drafter = tiny_pair("qwen3", vocab=32, markov_head_type=markov, draft_layers=2)
    out = save_draft(drafter, tmp_path / "d", include_shared=True, dtype=torch.float32)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == deepspec_keys(2, markov, True)
    cfg = drafter.cfg
    r, d = cfg.markov_rank, cfg.hidden_size
    assert tensors["fc.weight"].shape == (d, cfg.num_taps * d)
    assert tensors["markov_head.markov_w2.weight"].shape == (cfg.vocab_size, r)
    assert tensors["confidence_head.proj.weight"].shape == (1, d + r)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == markov
    loaded = load_draft(out)  # standalone: embed/lm_head from the checkpoint
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    # A slim save leaves out the shared matrices; loading then takes them from the target.
    slim = save_draft(drafter, tmp_path / "slim", include_shared=False, dtype=torch.float32)
    assert set(load_file(slim / "model.safetensors")) == deepspec_keys(2, markov, False)
    shared = load_draft(slim, target.cfg, target.embed_tokens, target.lm_head)
    assert shared.lm_head is target.lm_head
    torch.testing.assert_close(shared.fc.weight, drafter.fc.weight)


@pytest.fixture()
def saved(tmp_path):
    _, target, drafter = tiny_pair("llama", vocab=32, layers=6, tap_ids=(1, 2, 3))
    return target, save_draft(drafter, tmp_path / "draft", include_shared=False, dtype=torch.float32)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_weights(folder, fn):
    t = load_file(folder / "model.safetensors")
    fn(t)
    save_file(t, folder / "model.safetensors")


def _load(target, folder):
    return load_draft(folder, target.cfg, target.embed_tokens, target.lm_head)


BAD = {
    "missing key": (lambda f: _edit_weights(f, lambda t: t.pop("norm.weight")), "missing norm.weight"),
    "wrong shape": (lambda f: _edit_weights(f, lambda t: t.update({"hidden_norm.weight": torch.ones(7)})),
                    r"hidden_norm.weight has shape \[7\]"),
    "unexpected key": (lambda f: _edit_weights(f, lambda t: t.update({"layers.9.mlp.up_proj.weight": torch.ones(1)})),
                       "unexpected keys layers.9"),
    "hidden size": (lambda f: _edit_config(f, hidden_size=64), "hidden_size=64, target has 32"),
    "vocab": (lambda f: _edit_config(f, vocab_size=40), "vocab_size=40, target has 32"),
    "tap beyond depth": (lambda f: _edit_config(f, target_layer_ids=[1, 2, 9]), "beyond the target's 6 layers"),
    "tap is last layer": (lambda f: _edit_config(f, target_layer_ids=[1, 2, 5]), "is the target's last layer"),
    "fc width": (lambda f: _edit_config(f, target_layer_ids=[1, 2, 3, 4]), r"fc.weight is \[32, 96\]"),
    "target depth": (lambda f: _edit_config(f, num_target_layers=8), "num_target_layers=8, target has 6"),
    "corrupt weights": (lambda f: (f / "model.safetensors").write_bytes(b"\x00garbage" * 10), "corrupt or not safetensors"),
    "pickle only": (lambda f: ((f / "model.safetensors").rename(f / "pytorch_model.bin")), "pickles and are never loaded"),
    "not json": (lambda f: (f / "config.json").write_text("{oops"), "not valid JSON"),
    "foreign config": (lambda f: _edit_config(f, architectures=["LlamaForCausalLM"]), "not a DSpark draft config"),
    "no config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_refused_in_one_line(saved, case):
    target, folder = saved
    damage, message = BAD[case]
    damage(folder)
    with pytest.raises(DSparkError, match=message) as err:
        _load(target, folder)
    assert "\n" not in str(err.value)


def test_missing_folder_and_standalone_without_shared(saved, tmp_path):
    target, folder = saved
    with pytest.raises(DSparkError, match="not found"):
        load_draft(tmp_path / "nope")
    with pytest.raises(DSparkError, match="load it together with its target"):
        load_draft(folder)
    shutil.rmtree(folder)


def test_the_shared_matrices_are_saved_as_dspark_decodes_with_them(tmp_path):
    """A checkpoint read alone (as DeepSpec reads it) gives the logits dspark's decode gives with the target."""
    _, target, drafter = tiny_pair("qwen3", vocab=32)  # fp32 target matrices, not bf16-representable
    out = save_draft(drafter, tmp_path / "d")  # the default: the drafter's own weights in bf16
    tensors = load_file(out / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["lm_head.weight"].dtype == torch.float32
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight)
    alone = load_draft(out)
    with_target = load_draft(out, target.cfg, target.embed_tokens, target.lm_head)
    hidden = torch.randn(2, 5, drafter.cfg.hidden_size)
    assert torch.equal(alone.lm_head(hidden), with_target.lm_head(hidden))
    # a bf16 target's matrices are exact in bf16, so they stay as small as the rest
    with torch.no_grad():
        drafter.lm_head.weight.copy_(drafter.lm_head.weight.to(torch.bfloat16).float())
    assert load_file(save_draft(drafter, tmp_path / "b") / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
