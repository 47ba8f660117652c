"""bench and calibrate say which prompts were too long for the bundle's context, count only those that ran, and
refuse in one line when none is left."""
import json
import shutil

import pytest
from click.testing import CliRunner

from dspark.cli import main_cli

SHORT = ["w1 w2", "w2 w3", "w3 w1"]
LONG = " ".join(["w1"] * 250)  # with --max-tokens 8: past the tiny bundle's 256 positions


def run(*args):
    res = CliRunner().invoke(main_cli, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture()
def bundle(tiny_bundle_v6, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], dst)
    return dst


def prompts_file(folder, prompts):
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def refused_in_one_line(code, out, needle):
    assert code != 0 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], out


def test_bench_counts_only_the_prompts_that_ran(bundle, tmp_path):
    mixed = prompts_file(tmp_path, [SHORT[0], LONG, SHORT[1], LONG, SHORT[2]])
    code, out = run("bench", bundle, "--prompts", mixed, "--policy", "all", "--max-tokens", 8, "--json")
    assert code == 0, out
    assert "skipped 2 of 5 prompts: prompt + max_tokens 8 does not fit the context of 256 positions; 3 ran" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["requests"] == 3 and result["skipped"] == 2
    code, out = run("bench", bundle, "--prompts", mixed, "--policy", "all", "--max-tokens", 8)
    assert code == 0 and "(3 requests)" in out and "skipped 2 of 5" in out, out
    only_long = prompts_file(tmp_path, [LONG, LONG])
    refused_in_one_line(*run("bench", bundle, "--prompts", only_long, "--policy", "all", "--max-tokens", 8),
                        "none of the 2 prompts fits")


def test_calibrate_writes_the_number_of_prompts_it_calibrated_on(bundle, tmp_path):
    mixed = prompts_file(tmp_path, [SHORT[0], LONG, SHORT[1], LONG, SHORT[2]])
    code, out = run("calibrate", bundle, "--prompts", mixed, "--max-tokens", 8, "--out", tmp_path / "cal")
    assert code == 0, out
    assert "skipped 2 of 5 prompts" in out and "rounds from 3 prompts" in out, out
    report = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert report["prompts"] == 3 and report["skipped_prompts"] == 2
    assert json.loads((bundle / "manifest.json").read_text())["calibration"]["sts"]["prompts"] == 3

    before = (bundle / "manifest.json").read_bytes()
    only_long = prompts_file(tmp_path, [LONG, LONG])
    refused_in_one_line(*run("calibrate", bundle, "--prompts", only_long, "--max-tokens", 8, "--out",
                             tmp_path / "none"), "none of the 2 prompts fits")
    assert not (tmp_path / "none").exists() and (bundle / "manifest.json").read_bytes() == before
