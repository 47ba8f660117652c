"""What a new user meets first: demo inputs checked before any conversion, the demo's policy and label, defaults
that work on every bundle (SPS table profiled on first use), the cache, export progress, a quiet check."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

from dspark.bundle import Manifest
from dspark.cli import main_cli
from dspark.demo import best_policy, bundle_label, expectation, pick_prompts
from dspark.errors import DSparkError
from dspark.prompts import DEMO_PROMPTS, read_prompts


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    return cache


@pytest.fixture
def bundle_copy(tiny_bundle_v6, tmp_path):
    """A writable copy without an SPS table (the profile on first use writes into it)."""
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], out)
    manifest = Manifest.read(out)
    manifest.calibration.pop("sps_table", None)
    manifest.write(out)
    return out


def test_shipped_demo_prompts_cover_three_domains_and_are_taken_in_turn():
    rows = read_prompts(DEMO_PROMPTS)
    assert {r["domain"] for r in rows} == {"math", "chat", "code"} and len(rows) >= 9
    assert [r["domain"] for r in pick_prompts(rows, 5)] == ["math", "chat", "code", "math", "chat"]
    assert len(pick_prompts(rows, 100)) == len(rows)


@pytest.mark.parametrize("args, message", [
    (["--prompts", "{tmp}/missing.jsonl"], "not found"),
    (["--prompts", "{tmp}/bad.jsonl"], "not valid JSON"),
    (["--prompts", "{tmp}/empty.jsonl"], "holds no prompts"),
    (["--prompts", "{tmp}/blank.jsonl"], "empty prompt"),
    (["--bundle", "{tmp}/not-a-bundle"], "is not a dspark bundle"),
])
def test_demo_checks_every_input_before_converting_anything(tmp_path, empty_cache, args, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{not json\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "blank.jsonl").write_text('{"prompt": "  "}\n')
    (tmp_path / "not-a-bundle").mkdir()
    (tmp_path / "not-a-bundle" / "notes.txt").write_text("x")
    res = CliRunner().invoke(main_cli, ["demo"] + [a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (empty_cache / "bundles").exists() and not (empty_cache / "targets").exists()


def test_demo_takes_a_prompt_file_and_a_count(bundle_copy, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w1 w2 w{i}", "domain": d}) + "\n"
                               for i, d in zip(range(1, 5), ["a", "b", "a", "b"])))
    res = CliRunner().invoke(main_cli, ["demo", "--bundle", str(bundle_copy), "--prompts", str(prompts),
                                        "--num-prompts", "2", "--max-new-tokens", "6"])
    assert res.exit_code == 0, res.output
    assert "[a] w1 w2 w1\n" in res.output and "[b] w1 w2 w2\n" in res.output and "[a] w1 w2 w3" not in res.output
    assert "2 of 2 outputs identical to AR" in res.output and "(per prompt x" in res.output
    assert f"the same decode, one prompt: dspark run {bundle_copy} --policy " in res.output
    assert Manifest.read(bundle_copy).calibration["sps_table"]  # profiled once, kept with the bundle
    again = CliRunner().invoke(main_cli, ["demo", "--bundle", str(bundle_copy), "--prompts", str(prompts),
                                          "--num-prompts", "1", "--max-new-tokens", "4"])
    assert again.exit_code == 0 and "no SPS table" not in again.output


def test_demo_policy_and_label_say_what_the_bundle_is(tiny_bundle_v6):
    manifest = Manifest.read(tiny_bundle_v6[3])
    assert best_policy(manifest)[0] == "schedule+gate"
    assert bundle_label(manifest) == "ONNX Runtime, fp32 verifier, draft and heads, batch 1"
    manifest.quantized["heads"] = {"bits": 8, "op": "MatMulNBits"}
    assert bundle_label(manifest) == "ONNX Runtime, fp32 verifier and draft, 8-bit heads, batch 1"
    assert "on the fp32 verifier" in expectation(manifest) and "GGUF's blocks" not in expectation(manifest)
    manifest.quantized["verifier"] = {"bits": 4, "gguf_blocks": {"formats": {"Q4_1": 210, "Q8_0": 1}}}
    assert "on the GGUF's blocks, verifying even one draft costs about twice" in expectation(manifest)
    manifest.draft["confidence_head"] = False
    assert best_policy(manifest)[0] == "all+gate"


@pytest.mark.parametrize("extra", [[], ["--policy", "all+gate", "-R", "2"]])
def test_bench_defaults_work_on_a_bundle_without_an_sps_table(bundle_copy, tmp_path, extra, empty_cache):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n{"prompt": "w3"}\n')
    before = (bundle_copy / "manifest.json").read_bytes()
    args = ["bench", str(bundle_copy), "--prompts", str(prompts), "--max-new-tokens", "5"] + extra
    res = CliRunner().invoke(main_cli, args)
    assert res.exit_code == 0, res.output
    assert "no SPS table" in res.output and "tok/s aggregate" in res.output
    again = CliRunner().invoke(main_cli, args)  # the profile of this bundle on this machine is kept in the cache
    assert again.exit_code == 0 and "no SPS table" not in again.output, again.output
    assert "using the SPS table profiled earlier" in again.output
    assert (bundle_copy / "manifest.json").read_bytes() == before  # the bundle is never written
    from dspark.calibration import sps_cache

    assert len(list((sps_cache.cache_dir() / "sps").iterdir())) == 1


def test_ensure_sps_table_only_when_the_policy_reads_it(bundle_copy):
    from dspark.calibration.sps import ensure_sps_table
    from dspark.runtime import Runtime

    notes = []
    with Runtime(bundle_copy) as rt:
        assert not ensure_sps_table(rt, "all", say=notes.append)
        assert not ensure_sps_table(rt, "static:0.5", say=notes.append)
        assert ensure_sps_table(rt, "all+gate", say=notes.append)
        assert not ensure_sps_table(rt, "schedule", say=notes.append)  # now there is one
        assert len(notes) == 1 and "no SPS table" in notes[0] and "stored in" in notes[0]
        block = rt.manifest.block_size
        assert len(rt.manifest.calibration["sps_table"]) == block + 1
        assert ensure_sps_table(rt, "topk", max_batch=2, say=notes.append)  # one covering 2 requests
        assert f"covers {block + 1} batch tokens" in notes[1]
    assert len(Manifest.read(bundle_copy).calibration["sps_table"]) == 2 * (block + 1)


def test_gguf_cache_is_keyed_by_content_and_config_has_no_null_quantization(tmp_path, empty_cache):
    from dspark.models.target import _gguf_cache_folder, _write_hf_config

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder, content in (("a", b"same"), ("b", b"same")):
        (tmp_path / folder / "m.gguf").write_bytes(content)
    (tmp_path / "c.gguf").write_bytes(b"other")
    assert _gguf_cache_folder(tmp_path / "a" / "m.gguf") == _gguf_cache_folder(tmp_path / "b" / "m.gguf")
    assert _gguf_cache_folder(tmp_path / "a" / "m.gguf").parent == empty_cache / "targets"
    assert _gguf_cache_folder(tmp_path / "c.gguf").name.split("-")[-1] != \
        _gguf_cache_folder(tmp_path / "a" / "m.gguf").name.split("-")[-1]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": None}))
    _write_hf_config(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "llama"}


def test_export_progress_reports_elapsed_time_on_long_steps(capsys):
    from dspark.export.trace.progress import Progress

    progress = Progress(2, after=0.2, every=0.2)
    with progress.step("a long step"):
        time.sleep(0.7)
    with progress.step("a short step"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[1/2] a long step" and lines[-2] == "[2/2] a short step"
    assert any(line.startswith("[1/2] a long step ... ") and line.endswith("s") for line in lines[1:-3])
    assert lines[-3].startswith("[1/2] a long step: done in ") and lines[-1].startswith("[2/2] a short step: done")
    quiet = Progress(1, quiet=True, after=0.0, every=0.01)
    with quiet.step("x"):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_check_comparison_raises_no_stray_warning():
    from dspark.export.check.parity import compare_outputs

    counts = {"verify_len": np.zeros(4, np.int64)}  # polygraphy divides these 0 by 0 for its relative error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = compare_outputs("heads", "call 0", counts, {"verify_len": counts["verify_len"].copy()})
    assert rows[0].passed and rows[0].max_abs_err == 0.0



TORCH_FREE_RUN = """
import sys
from dspark.cli import main_cli
from dspark.errors import DSparkError
bundle = sys.argv[1]
for args in (["demo", "--bundle", bundle, "--num-prompts", "1"], ["bench", bundle, "--limit", "1"]):
    try:
        main_cli(args + ["--max-new-tokens", "4"])
    except SystemExit as e:
        assert e.code == 0, e.code
print("torch" in sys.modules, "transformers" in sys.modules)
"""


def test_demo_and_bench_on_a_converted_bundle_need_no_torch(bundle_copy):
    out = subprocess.run([sys.executable, "-c", TORCH_FREE_RUN, str(bundle_copy)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "False False"


def test_the_demo_converts_its_own_bundle_again_when_it_is_outdated(tiny_bundle_v6, empty_cache):
    from dspark.demo import DemoRequest, demo_bundle_path, plan_demo

    request = DemoRequest(None, 2, None, 8, "gguf")
    assert plan_demo(request).convert  # nothing there yet
    own = demo_bundle_path("gguf")
    shutil.copytree(tiny_bundle_v6[3], own)
    assert not plan_demo(request).convert
    raw = json.loads((own / "manifest.json").read_text())
    (own / "manifest.json").write_text(json.dumps({**raw, "format_version": 0}))
    assert plan_demo(request).convert and plan_demo(request).managed
    with pytest.raises(DSparkError, match="format version"):  # a bundle the user names is never replaced
        plan_demo(DemoRequest(own, 2, None, 8, "gguf"))
