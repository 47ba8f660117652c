"""`dspark cache list|clear`: sizes by kind, and clear deletes only what dspark provably made there."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dspark.cli import main_cli
from dspark.files import Temporary


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(root))
    return root


def _target(root, name="model-0123456789abcdef"):
    folder = root / "targets" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 3_000_000)
    return folder


def test_list_and_clear_by_kind(cache, tiny_bundle_v6):
    tiny = tiny_bundle_v6[-1]
    target = _target(cache)
    shutil.copytree(tiny, cache / "bundles" / "demo")
    (cache / "tensorrt_rtx_libs" / "0123456789abcdef").mkdir(parents=True)
    (cache / "tensorrt_rtx_libs" / "0123456789abcdef" / "libx.so").symlink_to("/nonexistent/libx.so")
    listed = CliRunner().invoke(main_cli, ["cache", "list"])
    assert listed.exit_code == 0 and "3.0 MB  targets" in listed.output and "in 3 entries" in listed.output
    assert "tensorrt_rtx_libs" in listed.output and "not made by dspark" not in listed.output
    cleared = CliRunner().invoke(main_cli, ["cache", "clear", "--kind", "bundles", "--yes"])
    assert cleared.exit_code == 0 and "removed 1 entries" in cleared.output
    assert target.exists() and not (cache / "bundles" / "demo").exists()
    refused = CliRunner().invoke(main_cli, ["cache", "clear"], input="n\n")
    assert refused.exit_code == 1 and target.exists()
    cleared = CliRunner().invoke(main_cli, ["cache", "clear", "-y"])
    assert cleared.exit_code == 0 and "removed 2 entries" in cleared.output and not target.exists()


def test_clear_keeps_what_dspark_did_not_make(cache, tiny_bundle_v6):
    """DSPARK_CACHE pointed at a folder holding the user's files: nothing of theirs goes."""
    tiny = tiny_bundle_v6[-1]
    mine = {
        "bundles/notes.txt": b"my notes",
        "bundles/my-bundle/manifest.json": b"{}",  # not a manifest dspark reads
        "targets/Qwen3-8B-Q4_K_M/model.gguf": b"GGUF",
        "targets/model-0123456789abcdef/model.gguf": b"GGUF",  # our name, a file we never write there
        "kernels/libcustom.so": b"ELF",
        "tensorrt_rtx_libs/0123456789abcdef/real.so": b"ELF",  # a real file, not one of our links
    }
    for rel, data in mine.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    bundle = shutil.copytree(tiny, cache / "bundles" / "with-extra")
    (bundle / "my-results.csv").write_text("a,b\n")  # a bundle the user added a file to
    (cache / "bundles" / "linked").symlink_to(tiny, target_is_directory=True)
    listed = CliRunner().invoke(main_cli, ["cache", "list"])
    assert listed.exit_code == 0 and listed.output.count("not made by dspark") == 8, listed.output
    cleared = CliRunner().invoke(main_cli, ["cache", "clear", "-y"])
    assert cleared.exit_code == 0 and "removed 0 entries" in cleared.output and "kept 8 entries" in cleared.output
    assert all((cache / rel).read_bytes() == data for rel, data in mine.items())
    assert (bundle / "my-results.csv").exists() and (tiny / "manifest.json").exists()


def test_clear_tidies_temporaries_of_killed_writers(cache):
    target = cache / "targets" / "model-0123456789abcdef"
    left = Temporary(target)  # a writer that died: its lock is released, its folder stays
    (left.path / "config.json").write_text("{}")
    os.close(left.lock_fd)
    left.lock_fd = None
    cleared = CliRunner().invoke(main_cli, ["cache", "clear", "-y"])
    assert cleared.exit_code == 0 and not left.path.exists() and not left.lock.exists()


def test_an_empty_dspark_cache_means_the_default_folder(tmp_path, monkeypatch):
    from dspark.resolve import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        monkeypatch.setenv("DSPARK_CACHE", empty)
        assert cache_dir() == tmp_path / "home" / ".cache" / "dspark"  # not the current folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


@pytest.mark.parametrize("under", [False, True])
def test_a_dspark_cache_naming_a_file_is_one_line_naming_it(tmp_path, monkeypatch, tiny_bundle_v6, under):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    monkeypatch.setenv("DSPARK_CACHE", str(mine / "cache" if under else mine))
    for args in (["cache", "list"], ["cache", "clear", "--yes"],
                 ["run", str(tiny_bundle_v6[3]), "--prompt", "w1", "--max-new-tokens", "2"]):
        res = CliRunner().invoke(main_cli, args)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, (args, res.output)
        assert lines[0].startswith("error: DSPARK_CACHE=") and str(mine) in lines[0] and "not a folder" in lines[0]
    assert mine.read_text() == "mine"


def test_an_unwritable_cache_folder_only_costs_the_cache(monkeypatch, tiny_bundle_v6):
    """A cache that cannot be made (a read-only home) still runs a bundle: its file hashes are not remembered."""
    from dspark.resolve import CacheUnwritable, cache_dir

    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc, where nobody (root included) makes folders")
    monkeypatch.setenv("DSPARK_CACHE", "/proc/dspark-cache-test")
    with pytest.raises(CacheUnwritable, match="cannot make DSPARK_CACHE=/proc/dspark-cache-test"):
        cache_dir()
    res = CliRunner().invoke(main_cli, ["run", str(tiny_bundle_v6[3]), "--prompt", "w1", "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
