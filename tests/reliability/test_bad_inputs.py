"""The bad-input table: every case must end in exit status 2 (CLI) or DSparkError (API) with one line, no
traceback, and no change to any file outside the requested output (every file under the test folder is hashed
before and after). Add a row for every refusal that gets fixed."""
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from dspark.cli import export_cli, main_cli
from dspark.errors import DSparkError
from reliability.conftest import tree_hashes


@dataclass
class Cli:
    group: object
    args: list
    output: Path | None = None  # the one path the command may write


@dataclass
class Api:
    call: Callable[[], object]


CASES: dict[str, Callable] = {}
NEEDS_TARGET: set[str] = set()  # cases that also get the tiny HF target folder (and watch it for changes)


def case(name: str, target: bool = False):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = fn
        if target:
            NEEDS_TARGET.add(name)
        return fn
    return register


def edit_manifest(bundle: Path, change: Callable[[dict], None]) -> None:
    path = bundle / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def run(bundle, *extra):
    return Cli(main_cli, ["run", bundle, "--prompt", "w1 w2", "--max-new-tokens", "4", *extra])


def setter(*keys_and_value):
    *keys, value = keys_and_value

    def change(raw):
        node = raw
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return change


DELETE = object()

# --- manifests: types, ranges, relations, paths (dspark run BUNDLE) -------------------------------------------
MANIFEST_EDITS = {
    "manifest target.vocab_size is text": setter("target", "vocab_size", "6"),
    "manifest target.vocab_size 0": setter("target", "vocab_size", 0),
    "manifest target.num_layers missing": setter("target", "num_layers", DELETE),
    "manifest target is a list": setter("target", [1, 2]),
    "manifest draft.block_size 0": setter("draft", "block_size", 0),
    "manifest draft.block_size negative": setter("draft", "block_size", -3),
    "manifest draft.block_size 2.5": setter("draft", "block_size", 2.5),
    "manifest draft.block_size true": setter("draft", "block_size", True),
    "manifest draft.target_layer_ids text": setter("draft", "target_layer_ids", "abc"),
    "manifest draft.mask_token_id outside vocab": setter("draft", "mask_token_id", 1000),
    "manifest max_context text": setter("max_context", "big"),
    "manifest max_context 1": setter("max_context", 1),
    "manifest stop_token_ids text": setter("stop_token_ids", "5"),
    "manifest stop_token_ids outside vocab": setter("stop_token_ids", [99]),
    "manifest stop_token_ids float": setter("stop_token_ids", [1.5]),
    "manifest graphs without verifier": setter("graphs", "verifier", DELETE),
    "manifest graph file ../../": setter("graphs", "verifier", "file", "../../etc/passwd"),
    "manifest graph file absolute": setter("graphs", "verifier", "file", "/etc/passwd"),
    "manifest graph file number": setter("graphs", "draft", "file", 42),
    "manifest graph inputs text": setter("graphs", "heads", "inputs", "x"),
    "manifest tensor dtype unknown": lambda raw: raw["graphs"]["heads"]["inputs"][0].update(dtype="complex999"),
    "manifest tensor shape negative": lambda raw: raw["graphs"]["heads"]["inputs"][0].update(shape=[-1]),
    "manifest tensor extra field": lambda raw: raw["graphs"]["heads"]["inputs"][0].update(extra=1),
    "manifest zero STS temperatures": setter("calibration", "sts_temperatures", [0.0, 0.0, 0.0]),
    "manifest negative STS temperature": setter("calibration", "sts_temperatures", [1.0, -1.0, 1.0]),
    "manifest STS temperatures wrong length": setter("calibration", "sts_temperatures", [1.0]),
    "manifest sps_table of text": setter("calibration", "sps_table", ["x"]),
    "manifest acceptance_prior above 1": setter("calibration", "acceptance_prior", [1.5, 0.5, 0.5]),
    "manifest acceptance_prior wrong length": setter("calibration", "acceptance_prior", [0.5]),
    "manifest claimed acceptance of text": setter("draft", "expected_acceptance", {"accept_at": "high"}),
    "manifest claimed acceptance negative": setter("draft", "expected_acceptance", {"accept_at": [-0.1]}),
    "manifest calibration is text": setter("calibration", "abc"),
    "manifest engine file outside": setter("tensorrt", {"max_context": 64, "max_batch": 1,
                                                        "engines": {"verifier": {"file": "../x.engine"}}}),
    "manifest plugin library absolute": setter("tensorrt", {"max_context": 64, "max_batch": 1,
                                                            "plugin": {"library": "/usr/lib/libc.so.6"}}),
    "manifest precision number": setter("precision", 16),
    "manifest draft.confidence_head text": setter("draft", "confidence_head", "yes"),
    "manifest graph sha256 number": setter("graphs", "verifier", "sha256", 5),
    "manifest num_kv_heads wrong (ORT run-time error)": setter("target", "num_kv_heads", 1),
    "manifest head_dim wrong (ORT run-time error)": setter("target", "head_dim", 3),
}

for _name, _change in MANIFEST_EDITS.items():
    case(_name)(lambda b, _t, change=_change: (edit_manifest(b, change), run(b))[1])


@case("manifest not JSON")
def _(b, t):
    (b / "manifest.json").write_text("{")
    return run(b)


@case("manifest a JSON list")
def _(b, t):
    (b / "manifest.json").write_text("[]")
    return run(b)


@case("manifest with NaN")
def _(b, t):
    (b / "manifest.json").write_text((b / "manifest.json").read_text().replace('"max_context": 256', '"max_context": NaN'))
    return run(b)


@case("manifest not UTF-8")
def _(b, t):
    (b / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}')
    return run(b)


@case("manifest is a folder")
def _(b, t):
    (b / "manifest.json").unlink()
    (b / "manifest.json").mkdir()
    return run(b)


@case("manifest format_version 99")
def _(b, t):
    edit_manifest(b, setter("format_version", 99))
    return run(b)


@case("graph file a link leading out of the bundle")
def _(b, t):
    outside = t / "elsewhere.onnx"
    shutil.copyfile(b / "heads.onnx", outside)
    (b / "heads.onnx").unlink()
    (b / "heads.onnx").symlink_to(outside)
    return run(b)


@case("weights.data with one byte changed")
def _(b, t):
    data = bytearray((b / "weights.data").read_bytes())
    data[len(data) // 2] ^= 0x40
    (b / "weights.data").write_bytes(bytes(data))
    return run(b)


@case("weights.data cut short")
def _(b, t):
    data = (b / "weights.data").read_bytes()
    (b / "weights.data").write_bytes(data[:-64])
    return run(b)


@case("a graph loaded only when used is empty")
def _(b, t):
    (b / "heads.onnx").write_bytes(b"")  # greedy decoding runs heads_greedy; heads.onnx would load on sampling
    return run(b)


@case("a graph replaced by another graph of the bundle")
def _(b, t):
    shutil.copyfile(b / "draft.onnx", b / "heads.onnx")
    return run(b)


@case("manifest block_size disagrees with the graphs")
def _(b, t):
    edit_manifest(b, setter("draft", "block_size", 4))
    return run(b)


@case("manifest tensor shape disagrees with the graph file")
def _(b, t):
    def change(raw):
        for spec in raw["graphs"].values():
            for tensor in spec["inputs"]:
                if tensor["name"] == "conf_temperatures":
                    tensor["shape"] = [9]
    edit_manifest(b, change)
    return run(b)


@case("graph file garbage")
def _(b, t):
    (b / "verifier.onnx").write_bytes(b"\x08garbage")
    return run(b)


@case("bundle is a file")
def _(b, t):
    (t / "file").write_text("x")
    return run(t / "file")


@case("bundle missing")
def _(b, t):
    return run(t / "nope")


# --- manifest sizes against the graphs' declared shapes (issue 42, re-audit): refused when the bundle is read ------
SIZE_EDITS = {
    "manifest draft.num_layers missing": setter("draft", "num_layers", DELETE),
    "manifest draft.head_dim missing": setter("draft", "head_dim", DELETE),
    "manifest draft.num_layers disagrees with the draft graph": setter("draft", "num_layers", 2),
    "manifest draft.num_kv_heads disagrees with the draft graph": setter("draft", "num_kv_heads", 3),
    "manifest draft.hidden_size disagrees with the heads graph": setter("draft", "hidden_size", 16),
    "manifest target.num_layers huge": setter("target", "num_layers", 10 ** 12),
    "manifest target.vocab_size huge": setter("target", "vocab_size", 10 ** 30),
    "manifest target.vocab_size one more than the graphs'": setter("target", "vocab_size", 7),
    "manifest format_version true": setter("format_version", True),
    "manifest precision unknown": setter("precision", "fp8"),
    "manifest quantized record a number": setter("quantized", {"heads": 8}),
    "manifest quantized gguf_blocks a list": setter("quantized", {"verifier": {"bits": 4, "gguf_blocks": [1]}}),
    "manifest draft.target_layer_ids more taps than the verifier gives": setter("draft", "target_layer_ids", [-1, 0]),
}
for _name, _change in SIZE_EDITS.items():
    case(_name)(lambda b, _t, change=_change: (edit_manifest(b, change), run(b))[1])


def _retyped(graph_side_tensor_axis: list[tuple], value):
    def change(raw):
        for graph, side, name, axis in graph_side_tensor_axis:
            for tensor in raw["graphs"][graph][side]:
                if tensor["name"] == name:
                    tensor["shape"][axis] = value
    return change


@case("manifest taps features an axis name in both graphs")
def _(b, t):
    edit_manifest(b, _retyped([("verifier", "outputs", "taps", 2), ("draft", "inputs", "ctx_features", 2)], "feat"))
    return run(b)


@case("manifest verifier draft_probs vocabulary disagrees with the heads'")
def _(b, t):
    edit_manifest(b, _retyped([("verifier", "inputs", "draft_probs", 2)], 9))
    return run(b)


# --- graph files read by the export commands: integrity first, one line naming the file -----------------------
def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@case("check --lint-only with a graph cut short")
def _(b, t):
    _cut(b / "heads.onnx")
    return Cli(export_cli, ["check", "--lint-only", b])


@case("check --lint-only with an empty graph the manifest records no hash of")
def _(b, t):
    (b / "verifier.onnx").write_bytes(b"")
    edit_manifest(b, setter("graphs", "verifier", "sha256", ""))
    return Cli(export_cli, ["check", "--lint-only", b])


@case("check --lint-only with a PNG as a graph the manifest records no hash of")
def _(b, t):
    (b / "draft.onnx").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    edit_manifest(b, setter("graphs", "draft", "sha256", ""))
    return Cli(export_cli, ["check", "--lint-only", b])


@case("fuse --rebuild with weights.data cut short")
def _(b, t):
    _cut(b / "weights.data", 0.9)
    return Cli(export_cli, ["fuse", b, "--rebuild"])


@case("quantize with one byte of weights.data changed")
def _(b, t):
    data = bytearray((b / "weights.data").read_bytes())
    data[len(data) // 3] ^= 0x01
    (b / "weights.data").write_bytes(bytes(data))
    return Cli(export_cli, ["quantize", b, "--min-elements", "0"])


@case("quantize with a foreign graph the manifest records no hash of")
def _(b, t):
    (b / "heads.onnx").write_text("<html>not a graph</html>")
    edit_manifest(b, setter("graphs", "heads", "sha256", ""))
    return Cli(export_cli, ["quantize", b, "--min-elements", "0"])


@case("build with a graph cut short")
def _(b, t):
    _cut(b / "draft.onnx")
    return Cli(export_cli, ["build", b, "--flavor", "rtx"])


# --- tokenizer and chat template ---------------------------------------------------------------------------
@case("tokenizer.json garbage")
def _(b, t):
    (b / "tokenizer.json").write_text("{]")
    return run(b)


@case("tokenizer_config.json not UTF-8")
def _(b, t):
    (b / "tokenizer_config.json").write_bytes(b"\xff\xfe\x00")
    return run(b)


@case("tokenizer_config.json a list")
def _(b, t):
    (b / "tokenizer_config.json").write_text("[1]")
    return run(b)


@case("chat template syntax error")
def _(b, t):
    (b / "chat_template.jinja").write_text("{% if %}")
    return run(b)


@case("chat template sandbox security error")
def _(b, t):
    (b / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    return run(b)


@case("chat template range error")
def _(b, t):
    (b / "chat_template.jinja").write_text("{% for i in range(10 ** 9) %}x{% endfor %}")
    return run(b)


@case("chat template nested loops")
def _(b, t):
    (b / "chat_template.jinja").write_text("{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}"
                                           "{% endfor %}")
    return run(b)


@case("chat template writing without end")
def _(b, t):
    (b / "chat_template.jinja").write_text("{% for i in range(99999) %}{% for c in 'x' * 99999 %}{{ c }}"
                                           "{% endfor %}{% endfor %}")
    return run(b)


@case("chat template a huge power")
def _(b, t):
    (b / "chat_template.jinja").write_text("{{ 9 ** 999999999 }}")
    return run(b)


@case("chat template raise_exception")
def _(b, t):
    (b / "chat_template.jinja").write_text("{{ raise_exception('no user turns here') }}")
    return run(b)


def _linked_out(b, t, name, content=None):
    """b/name replaced by a link to a file outside the bundle (a copy of it, or `content`)."""
    outside = t / f"outside-{name.replace('/', '-')}"
    if content is None:
        shutil.copyfile(b / name, outside)
    else:
        outside.write_text(content)
    (b / name).unlink(missing_ok=True)
    (b / name).symlink_to(outside)


@case("chat template a link to a file outside the bundle")
def _(b, t):
    _linked_out(b, t, "chat_template.jinja", "{{ 'a system file becomes the prompt' }}")
    return run(b)


@case("tokenizer.json a link out of the bundle")
def _(b, t):
    _linked_out(b, t, "tokenizer.json")
    return run(b)


@case("chat template not UTF-8")
def _(b, t):
    (b / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    return run(b)


# --- command-line values ----------------------------------------------------------------------------------
for _name, _extra in {
    "run --temperature nan": ["--temperature", "nan"],
    "run --temperature text": ["--temperature", "warm"],
    "run --threshold nan": ["--threshold", "nan"],
    "run --threshold 2": ["--threshold", "2"],
    "run --seed -1": ["--seed", "-1"],
    "run --max-new-tokens 0": ["--max-new-tokens", "0"],
    "run --max-new-tokens beyond the context": ["--max-new-tokens", "1000"],
    "run --threads 0": ["--threads", "0"],
    "run --ar --gate": ["--ar", "--gate"],
    "run --policy ar --gate": ["--policy", "ar", "--gate"],
    "run --policy unknown": ["--policy", "sometimes"],
    "run --ar --policy schedule": ["--ar", "--policy", "schedule"],
    "run --ar --threshold": ["--ar", "--threshold", "0.5"],
    "run --threshold-rule unknown": ["--threshold-rule", "last"],
    "run --backend unknown": ["--backend", "cuda"],
    "run --policy fixed: a 20-digit gamma": ["--policy", "fixed:99999999999999999999"],
}.items():
    case(_name)(lambda b, _t, extra=_extra: run(b, *extra))


@case("run --prompt empty")
def _(b, t):
    return Cli(main_cli, ["run", b, "--prompt", "  "])


@case("run --prompt not UTF-8")
def _(b, t):
    return Cli(main_cli, ["run", b, "--prompt", "w1 \udcff"])


@case("reference --temperature nan")
def _(b, t):
    return Cli(main_cli, ["reference", "--target", t / "none", "--temperature", "nan"])


@case("reference --draft random:abc")
def _(b, t):
    return Cli(main_cli, ["reference", "--target", t / "none", "--draft", "random:abc"])


@case("reference --seed -2")
def _(b, t):
    return Cli(main_cli, ["reference", "--seed", "-2"])


# --- export: never replace what is not a bundle, refuse bad drafts and targets early ---------------------
def onnx(target, draft, output, *extra):
    return Cli(export_cli, ["onnx", "--target", target, "--draft", draft, "--output", output, "-q", "--no-check",
                            *extra], output)


@case("onnx --force onto a web app with a manifest.json")
def _(b, t):
    app = t / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    (app / "index.html").write_text("<html></html>")
    return Cli(export_cli, ["onnx", "--target", t / "none", "--draft", "random", "--output", app, "--force"])


@case("onnx --force onto a bundle that also holds user files")
def _(b, t):
    (b / "notes.txt").write_text("mine")
    return Cli(export_cli, ["onnx", "--target", t / "none", "--draft", "random", "--output", b, "--force"])


@case("onnx --force onto a file")
def _(b, t):
    (t / "out").write_text("mine")
    return Cli(export_cli, ["onnx", "--target", t / "none", "--draft", "random", "--output", t / "out", "--force"])


@case("onnx onto an existing bundle without --force")
def _(b, t):
    return Cli(export_cli, ["onnx", "--target", t / "none", "--draft", "random", "--output", b])


@case("onnx --draft random:abc")
def _(b, t):
    return onnx(t / "none", "random:abc", t / "out")


@case("onnx --draft random:-1")
def _(b, t):
    return onnx(t / "none", "random:-1", t / "out")


@case("onnx --target missing")
def _(b, t):
    return onnx(t / "none", "random", t / "out")


@case("onnx --target config with text sizes")
def _(b, t):
    target = t / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "32"}))
    return onnx(target, "random", t / "out")


@case("onnx --target missing, with the progress display on (refused before it starts)")
def _(b, t):
    return Cli(export_cli, ["onnx", "--target", t / "none", "--draft", "random", "--output", t / "out"], t / "out")


@case("onnx --target an unsupported model_type, with the progress display on")
def _(b, t):
    target = t / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 32}))
    return Cli(export_cli, ["onnx", "--target", target, "--draft", "random", "--output", t / "out"], t / "out")


@case("onnx --max-context 1")
def _(b, t):
    return onnx(t / "none", "random", t / "out", "--max-context", "1")


def draft_dir(t: Path, hf_target: Path, **changes) -> Path:
    """A valid slim DeepSpec draft for the hf_target fixture, with config.json fields changed."""
    from dspark.models.checkpoint import save_draft
    from dspark.models.config import TargetConfig, draft_config_for
    from dspark.models.drafter import DSparkDrafter

    cfg = draft_config_for(TargetConfig.from_dict(json.loads((hf_target / "config.json").read_text())),
                           mask_token_id=6, block_size=3, target_layer_ids=(0,), markov_rank=4)
    folder = save_draft(DSparkDrafter(cfg), t / "draft", include_shared=False)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


DRAFT_EDITS = {
    "draft config block_size 0": {"block_size": 0},
    "draft config block_size text": {"block_size": "3"},
    "draft config hidden_size negative": {"hidden_size": -32},
    "draft config zero confidence temperature": {"confidence_temperatures": [1.0, 0.0, 1.0]},
    "draft config rms_norm_eps negative": {"rms_norm_eps": -1e-6},
    "draft config kv heads not dividing heads": {"num_key_value_heads": 3},
    "draft config target_layer_ids text": {"target_layer_ids": "0"},
    "draft config markov_rank float": {"markov_rank": 4.5},
    "draft config architectures not DSpark": {"architectures": ["LlamaForCausalLM"]},
}
for _name, _changes in DRAFT_EDITS.items():
    case(_name, target=True)(lambda b, t, hf, changes=_changes: onnx(hf, draft_dir(t, hf, **changes), t / "out"))


@case("draft shard index pointing outside", target=True)
def _(b, t, hf):
    folder = draft_dir(t, hf)
    (folder / "model.safetensors").rename(t / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"fc.weight": "../model-00001-of-00001.safetensors"}}))
    return onnx(hf, folder, t / "out")


@case("draft shard index not JSON", target=True)
def _(b, t, hf):
    folder = draft_dir(t, hf)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text("{")
    return onnx(hf, folder, t / "out")


# --- quantize and calibrate: validate first, write nothing on refusal -------------------------------------
@case("quantize --bits 4")
def _(b, t):
    return Cli(export_cli, ["quantize", b, "--bits", "4"])


@case("quantize a graph named outside the bundle")
def _(b, t):
    shutil.copyfile(b / "heads.onnx", t / "heads.onnx")
    edit_manifest(b, setter("graphs", "heads", "file", "../heads.onnx"))
    return Cli(export_cli, ["quantize", b, "--min-elements", "0"])


@case("check a bundle whose manifest names /etc/passwd")
def _(b, t):
    edit_manifest(b, setter("graphs", "verifier", "file", "/etc/passwd"))
    return Cli(export_cli, ["check", b])


@case("check with check/expected.json not JSON")
def _(b, t):
    (b / "check" / "expected.json").write_text("{")
    return Cli(export_cli, ["check", b])


@case("check with check/expected.json token ids as text")
def _(b, t):
    raw = json.loads((b / "check" / "expected.json").read_text())
    raw["prompt_ids"] = "w1 w2"
    (b / "check" / "expected.json").write_text(json.dumps(raw))
    return Cli(export_cli, ["check", b])


@case("check with check/ data linked out of the bundle")
def _(b, t):
    _linked_out(b, t, "check/draft_0_inputs.npz")
    return Cli(export_cli, ["check", b])


@case("check with check/ itself a link out of the bundle")
def _(b, t):
    shutil.move(b / "check", t / "elsewhere-check")
    (b / "check").symlink_to(t / "elsewhere-check", target_is_directory=True)
    return Cli(export_cli, ["check", b])


@case("check with a damaged .npz")
def _(b, t):
    (b / "check" / "draft_0_inputs.npz").write_bytes(b"garbage")
    return Cli(export_cli, ["check", b])


@case("check with recorded inputs the graph cannot take")
def _(b, t):
    path = b / "check" / "draft_0_inputs.npz"
    feeds = dict(np.load(path))
    feeds["anchor"] = np.zeros((3, 5, 7), dtype=np.int64)  # a valid .npz of the wrong rank
    with open(path, "wb") as f:
        np.savez(f, **feeds)
    return Cli(export_cli, ["check", b])


def prompts_file(t: Path, text: str | bytes) -> Path:
    path = t / "prompts.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@case("calibrate --draft an HF target folder", target=True)
def _(b, t, hf):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"prompt": "w1 w2"}\n'), "--draft", hf,
                          "--out", t / "cal"], t / "cal")


@case("calibrate --draft a folder that is not a checkpoint")
def _(b, t):
    (t / "app").mkdir()
    (t / "app" / "config.json").write_text('{"debug": true}')
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"prompt": "w1 w2"}\n'), "--draft",
                          t / "app", "--out", t / "cal"], t / "cal")


@case("calibrate --draft of another block size", target=True)
def _(b, t, hf):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"prompt": "w1 w2"}\n'), "--draft",
                          draft_dir(t, hf, block_size=5, confidence_temperatures=[]), "--out", t / "cal"], t / "cal")


@case("calibrate --prompts not UTF-8")
def _(b, t):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, b'{"prompt": "\xff"}\n')])


@case("calibrate --prompts not JSON")
def _(b, t):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, "prompt: w1\n")])


@case("calibrate --prompts 'turns' a string")
def _(b, t):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"turns": "text"}\n')])


@case("bench --prompts with an integer of 5000 digits")
def _(b, t):
    return Cli(main_cli, ["bench", b, "--prompts", prompts_file(t, '{"prompt": "w1", "n": ' + "7" * 5000 + "}\n")])


@case("bench with every prompt too long for the context (refused before the SPS profile)")
def _(b, t):
    return Cli(main_cli, ["bench", b, "-R", "8", "--prompts", prompts_file(t, '{"prompt": "' + "w1 " * 400 + '"}\n')])


@case("bench --prompts a device that never ends")
def _(b, t):
    return Cli(main_cli, ["bench", b, "--prompts", "/dev/zero", "--limit", "1"])


@case("triton --output a file")
def _(b, t):
    (t / "repo").write_text("mine")
    return Cli(export_cli, ["triton", b, "--output", t / "repo"])


@case("triton --python-env a text file")
def _(b, t):
    (t / "env.txt").write_text("mine")
    return Cli(export_cli, ["triton", b, "--output", t / "repo", "--python-env", t / "env.txt"], t / "repo")


@case("calibrate --prompts nested 100000 deep")
def _(b, t):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, "[" * 100000 + "]" * 100000 + "\n"),
                          "--out", t / "cal"], t / "cal")


@case("bench --prompts 'turns' with a number")
def _(b, t):
    return Cli(main_cli, ["bench", b, "--prompts", prompts_file(t, '{"turns": [3]}\n')])


@case("calibrate --out is a file")
def _(b, t):
    (t / "cal").write_text("mine")
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"prompt": "w1 w2"}\n'), "--out", t / "cal"])


@case("calibrate --temperature nan")
def _(b, t):
    return Cli(main_cli, ["calibrate", b, "--prompts", prompts_file(t, '{"prompt": "w1 w2"}\n'), "--temperature",
                          "nan", "--out", t / "cal"], t / "cal")


# --- the Python API ---------------------------------------------------------------------------------------
def api(fn):
    def build(b, t):
        from dspark.runtime import Runtime

        return Api(lambda: fn(Runtime(b), b))
    return build


def options(**kw):
    from dspark.runtime import DecodeOptions

    return DecodeOptions(**kw)


API_CASES = {
    "api temperature NaN": lambda rt, b: options(temperature=math.nan),
    "api temperature negative": lambda rt, b: options(temperature=-1.0),
    "api temperature inf": lambda rt, b: options(temperature=math.inf),
    "api temperature bool": lambda rt, b: options(temperature=True),
    "api max_tokens float": lambda rt, b: options(max_tokens=1.5),
    "api max_tokens bool": lambda rt, b: options(max_tokens=True),
    "api max_tokens 0": lambda rt, b: options(max_tokens=0),
    "api seed negative": lambda rt, b: options(seed=-1),
    "api seed float": lambda rt, b: options(seed=1.5),
    "api batch_size 0": lambda rt, b: options(batch_size=0),
    "api policy static:2.5": lambda rt, b: options(policy="static:2.5"),
    "api policy static:nan": lambda rt, b: options(policy="static:nan"),
    "api policy fixed:x": lambda rt, b: options(policy="fixed:x"),
    "api policy unknown": lambda rt, b: options(policy="greedy"),
    "api policy fixed gamma float": lambda rt, b: options(policy=__import__("dspark.runtime", fromlist=["x"])
                                                          .VerifyPolicy("fixed", gamma=1.5)),
    "api policy a number": lambda rt, b: options(policy=3),
    "api observer not one": lambda rt, b: rt.decoder([[1, 2]], observers=[print]),
    "api token ids as bytes": lambda rt, b: rt.generate([b"\x01\x02"]),
    "api token ids float": lambda rt, b: rt.generate([[1.5, 2]]),
    "api token ids bool": lambda rt, b: rt.generate([[True, 1]]),
    "api token id outside vocab": lambda rt, b: rt.generate([[99]]),
    "api token id negative": lambda rt, b: rt.generate([[-1]]),
    "api token ids numpy float": lambda rt, b: rt.generate([np.array([1.0, 2.0])]),
    "api prompts a string": lambda rt, b: rt.generate("w1 w2"),
    "api prompts empty": lambda rt, b: rt.generate([]),
    "api prompt empty list": lambda rt, b: rt.generate([[]]),
    "api prompt None": lambda rt, b: rt.generate([None]),
    "api prompt not UTF-8": lambda rt, b: rt.generate(["w1 \udcff"]),
    "api prompt too long": lambda rt, b: rt.generate([[1] * 300]),
    "api prompt + max_tokens beyond the context": lambda rt, b: rt.generate([[1] * 10], options(max_tokens=250)),
    "api options a dict": lambda rt, b: rt.generate([[1]], {"max_new_tokens": 3}),
    "api threads -3": lambda rt, b: type(rt)(b, threads=-3),
    "api threads 0": lambda rt, b: type(rt)(b, threads=0),
    "api threads 1.5": lambda rt, b: type(rt)(b, threads=1.5),
    "api bundle None": lambda rt, b: type(rt)(None),
    "api bundle a number": lambda rt, b: type(rt)(3),
}
for _name, _fn in API_CASES.items():
    case(_name)(api(_fn))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_touches_nothing(name, bundle, tmp_path, request):
    fn = CASES[name]
    args = [bundle, tmp_path] + ([request.getfixturevalue("hf_target")] if name in NEEDS_TARGET else [])
    built = fn(*args)
    output = built.output if isinstance(built, Cli) else None
    watched = [tmp_path] + args[2:]
    before = [tree_hashes(w, exclude=output) for w in watched]
    if isinstance(built, Api):
        with pytest.raises(DSparkError) as err:
            built.call()
        assert "\n" not in str(err.value) and str(err.value).strip()
    else:
        res = CliRunner().invoke(built.group, [str(a) for a in built.args])
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
        assert isinstance(res.exception, SystemExit), res.exception
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert "Traceback" not in res.output and "please report" not in res.output, res.output
        if output is not None:
            assert not output.exists() or output.is_file(), f"{output} was written on a refusal"
    assert [tree_hashes(w, exclude=output) for w in watched] == before
    assert not [p for p in tmp_path.rglob(".*tmp-*")], "temporaries left behind"


def test_the_table_has_at_least_60_distinct_cases():
    assert len(CASES) >= 60
