"""Bad input gets one line and a non-zero exit, never a traceback, never a half-written output."""
import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dspark.cli import export_cli, main_cli
from support.tiny import restamp


def run(cli, *args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.output


def one_line_error(code, out, needle):
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert needle in out, out
    assert len([line for line in lines if line.startswith("error:") or line.startswith("Error:")]) == 1, out


@pytest.fixture()
def bundle(tiny_bundle_v6, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], dst)
    return dst


def test_help_works():
    assert run(export_cli, "--help")[0] == 0
    assert run(main_cli, "--help")[0] == 0
    for cmd in ("run", "train", "calibrate", "reference", "demo"):
        assert run(main_cli, cmd, "--help")[0] == 0
    for cmd in ("onnx", "check"):
        assert run(export_cli, cmd, "--help")[0] == 0


def test_run_json_output(bundle):
    code, out = run(main_cli, "run", bundle, "--prompt", "w1 w2 w3", "--max-new-tokens", 5, "--json")
    assert code == 0, out
    obj = json.loads(out)
    assert {"text", "token_ids", "tau", "tokens_per_s", "rounds"} <= set(obj)
    assert 1 <= len(obj["token_ids"]) <= 5


def test_missing_bundle(tmp_path):
    one_line_error(*run(main_cli, "run", tmp_path / "nope", "--prompt", "w1"), "not found")


def test_corrupt_graph(bundle):
    (bundle / "verifier.onnx").write_bytes(b"\x08garbage")
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "does not hold what the manifest records")
    restamp(bundle)  # a manifest that records the garbage: ONNX Runtime refuses it
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "cannot load verifier.onnx")


def test_missing_graph(bundle):
    (bundle / "draft.onnx").unlink()
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "incomplete")


def test_manifest_from_another_format_version(bundle):
    man = json.loads((bundle / "manifest.json").read_text())
    man["format_version"] = 99
    (bundle / "manifest.json").write_text(json.dumps(man))
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "format version 99")


def test_manifest_not_json(bundle):
    (bundle / "manifest.json").write_text("{")
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "not valid JSON")


def test_graph_not_matching_manifest(bundle):
    shutil.copy2(bundle / "heads.onnx", bundle / "draft.onnx")
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "does not hold what the manifest records")
    restamp(bundle)
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1"), "does not match the manifest")


def test_empty_and_overlong_prompts(bundle):
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "   "), "empty prompt")
    long_prompt = " ".join(["w1"] * 300)  # the tiny bundle holds 256 positions
    one_line_error(*run(main_cli, "run", bundle, "--prompt", long_prompt), "too long")


def test_unknown_option_values(bundle):
    for args in (["--temperature", "-1"], ["--threads", "0"], ["--max-new-tokens", "0"], ["--bogus"]):
        code, out = run(main_cli, "run", bundle, "--prompt", "w1", *args)
        assert code == 2 and "Traceback" not in out, out


@pytest.mark.integration
def test_export_refuses_existing_output_and_bad_draft(tmp_path, smollm2_loaded_once):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_error(*run(export_cli, "onnx", "--target", "smollm2-135m", "--draft", "random", "--output", out),
                   "exists; pass --force")
    assert (out / "keep.txt").read_text() == "mine"
    one_line_error(*run(export_cli, "onnx", "--target", "smollm2-135m", "--draft", tmp_path / "missing",
                        "--output", tmp_path / "c"), "not found")
    assert not (tmp_path / "c").exists()


@pytest.mark.integration
def test_export_draft_that_does_not_fit(tmp_path, smollm2_loaded_once):
    from dspark.models.checkpoint import save_draft
    from support.tiny import tiny_pair

    _, _, drafter = tiny_pair("llama", vocab=49152 // 512)
    save_draft(drafter, tmp_path / "wrong", include_shared=True)
    one_line_error(*run(export_cli, "onnx", "--target", "smollm2-135m", "--draft", tmp_path / "wrong",
                        "--output", tmp_path / "c"), "does not fit the target")
    assert not (tmp_path / "c").exists()


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch, tiny_bundle_v6):
    import dspark.export.trace.onnx_export as ox
    from dspark.models.pair import Pair
    from support.tiny import TinyLoaded

    hf, target, drafter, _ = tiny_bundle_v6
    calls = []

    def failing(ex, path, *rest):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(ex, path, *rest)

    real = ox.export_graph
    monkeypatch.setattr(ox, "export_graph", failing)
    pair = Pair(TinyLoaded(hf, tiny_bundle_v6[3]), target, drafter, "random")
    with pytest.raises(KeyboardInterrupt):
        ox.export_bundle(pair, tmp_path / "out", quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_calibrate_and_check_cli_errors(bundle, tmp_path):
    one_line_error(*run(main_cli, "calibrate", bundle, "--prompts", tmp_path / "none.jsonl"), "not found")
    one_line_error(*run(export_cli, "check", tmp_path / "nope"), "not found")


def test_cli_entry_points_exit_cleanly():
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "run", "/nonexistent", "--prompt", "x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr


def test_bench_scripts_compile_and_show_help():
    """The benchmark scripts are not imported by any test run; at least they parse on this Python and start."""
    import glob
    import os
    import py_compile

    root = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    scripts = sorted(glob.glob(os.path.join(root, "*.py")))
    assert len(scripts) >= 4
    for path in scripts:
        py_compile.compile(path, doraise=True)
        if os.path.basename(path) != "common.py":
            out = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, cwd=root)
            assert out.returncode == 0 and "usage" in out.stdout, (path, out.stderr[-500:])


def test_quantize_cli_refuses_the_verifier_and_reports_what_it_did(bundle):
    code, out = run(export_cli, "quantize", bundle, "--graph", "verifier")
    one_line_error(code, out, "verifier")
    code, out = run(export_cli, "quantize", bundle, "--min-elements", 0)
    assert code == 0 and "MatMulNBits 8-bit" in out, out
    code, out = run(export_cli, "quantize", bundle, "--min-elements", 0)
    one_line_error(code, out, "already quantized")


def test_weights_mode_of_another_backend_is_refused_not_ignored(bundle):
    code, out = run(main_cli, "run", bundle, "--prompt", "w1", "--backend", "tensorrt", "--weights", "mapped")
    one_line_error(code, out, "ONNX Runtime only")
    code, out = run(main_cli, "run", bundle, "--prompt", "w1", "--backend", "tensorrt", "--threads", 2)
    one_line_error(code, out, "--threads applies to ONNX Runtime only")


def test_run_with_the_draft_gate(bundle):
    before = (bundle / "manifest.json").read_bytes()
    code, out = run(main_cli, "run", bundle, "--prompt", "w1 w2", "--max-new-tokens", 6, "--gate")
    assert code == 0 and "no SPS table" in out and "kept in the user cache" in out, out  # profiled, not failed
    assert (bundle / "manifest.json").read_bytes() == before  # and the user's bundle is left as it was
    prompts = bundle / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    one_line_error(*run(main_cli, "bench", bundle, "--policy", "ar+gate", "--prompts", prompts), "no '+gate'")
    code, out = run(main_cli, "calibrate", bundle, "--sps", "--max-batch", 1)
    assert code == 0, out
    code, out = run(main_cli, "run", bundle, "--prompt", "w1 w2 w3", "--max-new-tokens", 12, "--gate")
    assert code == 0 and "drafted)" in out, out


def test_run_takes_the_policy_as_bench_and_serve_do(bundle):
    """--policy names any policy; --ar and --threshold are its shorthands and give the same decode."""
    def decode(*flags):
        code, out = run(main_cli, "run", bundle, "--prompt", "w1 w2", "--max-new-tokens", 8, "--json", *flags)
        assert code == 0, out
        return {k: v for k, v in json.loads(out.strip().splitlines()[-1]).items() if k != "tokens_per_s"}

    assert decode("--policy", "ar") == decode("--ar")
    static, shorthand = decode("--policy", "static:0.5"), decode("--threshold", 0.5)
    assert static["token_ids"] == shorthand["token_ids"] and static["rounds"] == shorthand["rounds"]
    assert static["mode"] == "dspark" and decode("--ar")["mode"] == "ar"
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1", "--ar", "--policy", "topk"), "give one")


def test_tensorrt_backend_says_what_is_missing(bundle):
    one_line_error(*run(main_cli, "run", bundle, "--prompt", "w1", "--backend", "tensorrt"), "dspark-export build")
    man = json.loads((bundle / "manifest.json").read_text())
    man["tensorrt"] = {"max_batch": 2, "max_context": 64, "engines": {}, "plugin": {"library": "engines/x.so"}}
    (bundle / "manifest.json").write_text(json.dumps(man))
    code, out = run(main_cli, "run", bundle, "--prompt", "w1", "--backend", "tensorrt")
    try:
        import cuda.bindings  # noqa: F401
        import tensorrt  # noqa: F401
        pytest.skip("this machine has cuda-python and TensorRT: the message would name another missing piece")
    except Exception:
        pass
    assert code != 0 and "Traceback" not in out and ("cuda-python" in out or "TensorRT" in out or "nvcc" in out), out
    one_line_error(*run(main_cli, "bench", bundle, "--backend", "tpu"), "tpu")
