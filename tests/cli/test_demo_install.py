"""`dspark demo` from an installed copy of the package: a wheel built from this checkout, installed (without its
dependencies) into a fresh venv, run in an empty folder with no ../shared beside it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A venv holding only the wheel of this checkout; its dependencies come from this interpreter's
    site-packages through a .pth line (which adds the folder but runs none of its .pth files, so the editable
    install of dspark there stays out of the way)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "dspark", src / "dspark", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", tmp / "wheels", src])
    wheel = next((tmp / "wheels").glob("dspark-*.whl"))
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_dspark_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    work = tmp / "empty"  # no ../shared here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DSPARK_DEV_PROMPTS", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", DSPARK_CACHE=str(tmp / "cache"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    return {"venv": venv, "python": python, "work": work, "env": env, "tmp": tmp}


def test_the_installed_copy_is_the_one_imported(installed):
    code = "import dspark, dspark.prompts as p; print(dspark.__file__); print(p.DEMO_PROMPTS.exists())"
    out = run([installed["python"], "-c", code], cwd=installed["work"], env=installed["env"]).stdout.split()
    assert Path(out[0]).resolve().is_relative_to(installed["venv"].resolve())
    assert out[1] == "True"  # the demo prompts are package data of the wheel


def test_demo_runs_to_the_end_from_the_installed_package(installed, tiny_bundle_v6):
    bundle = installed["tmp"] / "bundle"
    shutil.copytree(tiny_bundle_v6[3], bundle)  # the demo stores the SPS table it profiles in the bundle
    proc = run([installed["venv"] / "bin" / "dspark", "demo", "--bundle", bundle, "--num-prompts", "3",
                "--max-new-tokens", "12"], cwd=installed["work"], env=installed["env"])
    prompts_line = next(line for line in proc.stderr.splitlines() if line.startswith("prompts: "))
    assert Path(prompts_line.split(" from ")[1]).resolve().is_relative_to(installed["venv"].resolve())
    assert "no SPS table" in proc.stderr and "policy: schedule+gate" in proc.stderr
    shipped = [line for line in (installed["work"].parent / "src/dspark/assets/prompts/demo.jsonl").read_text()
               .splitlines() if line]
    first_three = [json.loads(line)["prompt"] for line in shipped[:3]]
    for prompt in first_three:  # printed whole
        assert f"] {prompt}\n" in proc.stdout
    assert proc.stdout.count("identical to AR: yes") == 3
    assert "DSpark (schedule+gate)" in proc.stdout and "speedup x" in proc.stdout
    assert "3 of 3 outputs identical to AR" in proc.stdout
    assert "Traceback" not in proc.stderr
