"""A new user's second pass (issue 42): `dspark doctor` comes back clean on a CPU bundle and never writes into the
bundle it checks, and an install without the export extra (no torch, no onnx) runs the demo and doctor on a
converted bundle or ends with one line naming what to install."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dspark.bundle import Manifest
from dspark.cli import main_cli
from dspark.errors import exit_report


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by relative path, with a digest of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def bundle(tiny_bundle_v6, tmp_path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], out, ignore=shutil.ignore_patterns("engines"))
    return out


def test_doctor_without_build_never_writes_into_the_bundle(bundle):
    before = snapshot(bundle)
    res = CliRunner().invoke(main_cli, ["doctor", str(bundle)])
    assert res.exit_code == 0, res.output
    assert snapshot(bundle) == before  # no engines/, no rewritten manifest
    assert "[skip] engines: none built yet (`dspark doctor --build BUNDLE`" in res.output


def test_doctor_on_a_quantized_cpu_bundle_notes_once_that_tensorrt_cannot_build_it(bundle):
    from dspark.export.quantize.bundle import quantize_graph

    quantize_graph(bundle, "heads", min_elements=0)  # real MatMulNBits nodes, as in the demo's 8-bit heads
    before = snapshot(bundle)
    res = CliRunner().invoke(main_cli, ["doctor", str(bundle)])
    assert res.exit_code == 0, res.output
    assert "FAIL" not in res.output and res.output.count("not buildable for TensorRT") == 1
    assert "[note] TensorRT build: this bundle is not buildable for TensorRT, because heads hold MatMulNBits" \
        in res.output and "dspark demo --weights fp32" in res.output
    assert snapshot(bundle) == before


def test_a_missing_optional_package_is_one_line_naming_what_to_install():
    for name, extra in (("onnx", "dspark[export]"), ("torch.nn", "dspark[export]"), ("uvicorn", "dspark[serve]")):
        line, code = exit_report(ModuleNotFoundError(f"No module named '{name}'", name=name))
        assert code == 2 and "internal error" not in line and extra in line and name.split(".")[0] in line
    line, _ = exit_report(ModuleNotFoundError("No module named 'dspark.gone'", name="dspark.gone"))
    assert "internal error" in line  # dspark's own module missing is a broken install, still reported as a bug


WITHOUT_EXPORT_EXTRA = """
import sys
for name in ("torch", "onnx", "onnx_ir", "polygraphy", "transformers"):
    sys.modules[name] = None  # as in a `pip install -e .` venv
from dspark.cli import export_cli, main_cli
cli = export_cli if sys.argv[1] == "export" else main_cli
try:
    cli(sys.argv[2:])
except SystemExit as e:
    sys.exit(e.code)
"""


def without_export_extra(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "DSPARK_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", WITHOUT_EXPORT_EXTRA, *args], capture_output=True, text=True,
                          check=False, env=env)


def test_the_demo_runs_its_cached_bundle_without_torch_or_onnx(bundle, tmp_path, monkeypatch):
    from dspark.demo import demo_bundle_path

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    own = demo_bundle_path("fp32")  # the demo's own (managed) bundle, converted earlier
    own.parent.mkdir(parents=True)
    shutil.copytree(bundle, own)
    manifest = Manifest.read(own)
    manifest.graphs.pop("heads_greedy")  # converted before the twins: adding them needs onnx
    manifest.write(own)
    out = without_export_extra(["main", "demo", "--weights", "fp32", "--num-prompts", "1", "--max-new-tokens", "4"],
                               tmp_path / "cache")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "has no greedy heads graph" in out.stderr and "dspark[export]" in out.stderr
    assert "1 of 1 outputs identical to AR" in out.stdout


def test_doctor_and_export_commands_without_torch_or_onnx_name_what_to_install(bundle, tmp_path):
    doctor = without_export_extra(["main", "doctor", str(bundle)], tmp_path / "cache")
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    assert "[skip] ONNX Runtime vs PyTorch reference: this needs the Python package" in doctor.stdout
    assert "[skip] TensorRT operator lint: this needs the Python package 'onnx'" in doctor.stdout
    lint = without_export_extra(["export", "check", "--lint-only", str(bundle)], tmp_path / "cache")
    lines = lint.stderr.strip().splitlines()
    assert lint.returncode == 2 and len(lines) == 1 and "internal error" not in lines[0]
    assert lines[0].startswith("error: this needs the Python package 'onnx'") and "dspark[export]" in lines[0]


def test_the_demo_converts_without_check_data_and_says_what_its_silent_pass_is(bundle, tmp_path, monkeypatch):
    """The demo never runs `dspark-export check`, so its conversion skips the reference recording (the longest step
    of the first run); its autoregressive comparison pass prints no text, so it says that it is running."""
    import dspark.export.trace.onnx_export as onnx_export
    import dspark.models.pair as pair
    from dspark.demo import DemoPlan, ensure_demo_bundle

    calls = []

    def export_bundle(pair, output, **options):  # records what the demo asks for; the bundle is the tiny one
        calls.append(options)
        shutil.copytree(bundle, output)

    monkeypatch.setattr(onnx_export, "export_bundle", export_bundle)
    monkeypatch.setattr(pair, "load_pair", lambda *args, **kw: None)
    plan = DemoPlan([{"prompt": "w1"}], tmp_path / "p.jsonl", tmp_path / "converted", convert=True, managed=False)
    ensure_demo_bundle(plan, "fp32", say=lambda m: None)
    assert calls and calls[0]["check_data"] is False
    res = CliRunner().invoke(main_cli, ["demo", "--bundle", str(bundle), "--num-prompts", "2", "--max-new-tokens",
                                        "4"])
    assert res.exit_code == 0, res.output
    assert res.output.count("decoding the same prompt autoregressively, for the comparison") == 2


@pytest.mark.parametrize("damage", ["cut short", "emptied", "one byte changed"])
def test_doctor_reads_no_graph_it_found_damaged(bundle, damage):
    """The files check fails, and no ONNX check parses the damaged graph (the lint used to, and ended the doctor on
    a protobuf error reported as an internal error)."""
    path = bundle / "verifier.onnx"
    data = path.read_bytes()
    path.write_bytes({"cut short": data[:len(data) // 2], "emptied": b"",
                      "one byte changed": data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]}[damage])
    before = snapshot(bundle)
    res = CliRunner().invoke(main_cli, ["doctor", str(bundle)])
    assert res.exit_code == 1, res.output
    assert "[FAIL] files (sha256 of every graph and data file): verifier.onnx (verifier graph)" in res.output
    assert "[skip] ONNX Runtime vs PyTorch reference: the bundle's files are damaged" in res.output
    assert "[skip] TensorRT operator lint: the bundle's files are damaged" in res.output
    assert "internal error" not in res.output and "Traceback" not in res.output
    assert snapshot(bundle) == before
