"""Nothing a user owns is touched: --force replaces only a provable bundle, quantize and calibrate validate first and
replace what they write as a set, outputs get normal permissions; a request that exactly fits the context is
served and an overflowing one in a batch fails alone; DeepSpec can read what dspark writes."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.bundle import Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.export.trace.onnx_export import check_replaceable
from dspark.files import Temporary, replace_folder
from dspark.models.checkpoint import load_draft, save_draft
from reliability.conftest import tree_hashes
from support import deepspec_schema


def normal(mode: int, folder: bool = False) -> bool:
    umask = os.umask(0)
    os.umask(umask)
    return mode & 0o777 == (0o777 if folder else 0o666) & ~umask


def test_force_replaces_only_a_provable_bundle(bundle, tmp_path):
    check_replaceable(bundle, force=True)  # a bundle as exported: fine
    empty = tmp_path / "empty"
    empty.mkdir()
    check_replaceable(empty, force=True)
    (bundle / "notes.txt").write_text("mine")
    with pytest.raises(DSparkError, match="notes.txt"):
        check_replaceable(bundle, force=True)
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"format": "dspark-bundle", "format_version": 1}')
    with pytest.raises(DSparkError, match="not a dspark bundle"):
        check_replaceable(app, force=True)


def test_replace_folder_swaps_in_one_step_and_leaves_no_temporary(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old").write_text("old")
    new = Temporary(dest)
    (new.path / "new").write_text("new")
    replace_folder(new, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert normal(dest.stat().st_mode, folder=True)


def test_quantize_replaces_graph_data_and_manifest_as_a_set(bundle, tmp_path, monkeypatch):
    from dspark.export.quantize import bundle as quantize

    before = tree_hashes(bundle)
    real_save = quantize.ir.save

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(args[1]))

    monkeypatch.setattr(quantize.ir, "save", disk_full)
    with pytest.raises(OSError):
        quantize.quantize_graph(bundle, "heads", min_elements=0)
    assert tree_hashes(bundle) == before, "a failed quantize leaves the bundle as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"], "and no temporary"
    monkeypatch.setattr(quantize.ir, "save", real_save)
    quantize.quantize_graph(bundle, "heads", min_elements=0)
    man = Manifest.read(bundle)
    spec = man.graphs["heads"]
    assert sha256_file(bundle / spec.file) == spec.sha256 and "heads" in man.quantized
    for name in [n for n in (spec.file, f"{spec.file}.data") if (bundle / n).exists()]:
        assert normal((bundle / name).stat().st_mode), oct((bundle / name).stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_a_bundle_given_through_a_link_is_changed_where_it_lies(bundle, tmp_path):
    """quantize/fuse on a link to a bundle: the bundle it names gets the change and the link stays a link, with no
    hidden temporary left beside either."""
    from click.testing import CliRunner

    from dspark.cli import export_cli
    from dspark.export.quantize.bundle import quantize_graph

    link = tmp_path / "link"
    link.symlink_to(bundle, target_is_directory=True)
    quantize_graph(link, "heads", min_elements=0)
    assert link.is_symlink() and "heads" in Manifest.read(bundle).quantized
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / manifest["graphs"].pop("heads_greedy")["file"]).unlink()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(export_cli, ["fuse", str(link)])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and "heads_greedy" in Manifest.read(bundle).graphs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "link"]


def test_check_records_missing_reference_data_from_the_sources(hf_target, tmp_path):
    """A bundle converted with --no-check gets check/ on its first `dspark-export check`, from the checkpoints its
    manifest names; a changed source is refused in one line and nothing is written."""
    from click.testing import CliRunner

    from dspark.cli import export_cli

    bundle = tmp_path / "bundle"
    made = CliRunner().invoke(export_cli, ["onnx", "--target", str(hf_target), "--draft", "random:5", "-o",
                                           str(bundle), "--max-context", "64", "--no-check", "--quiet"])
    assert made.exit_code == 0 and not (bundle / "check").exists(), made.output
    tree = tree_hashes(bundle)
    moved = tmp_path / "moved-target"
    hf_target.rename(moved)
    try:
        refused = CliRunner().invoke(export_cli, ["check", str(bundle)])
    finally:
        moved.rename(hf_target)
    assert refused.exit_code == 2 and "is not on this machine" in refused.output, refused.output
    assert tree_hashes(bundle) == tree
    checked = CliRunner().invoke(export_cli, ["check", str(bundle)])
    assert checked.exit_code == 0, checked.output
    assert "recording it once" in checked.output and (bundle / "check" / "expected.json").exists()
    assert sorted(p.name for p in bundle.iterdir() if p.name.startswith(".")) == []
    again = CliRunner().invoke(export_cli, ["check", str(bundle)])
    assert again.exit_code == 0 and "recording" not in again.output


def test_calibrate_writes_only_the_draft_config_and_only_after_validating(tiny_bundle_v6, bundle, tmp_path):
    from dspark.calibration.calibrate import calibrate

    drafter = tiny_bundle_v6[2]
    draft = save_draft(drafter, tmp_path / "draft", include_shared=False)
    weights = sha256_file(draft / "model.safetensors")
    raw = json.loads((draft / "config.json").read_text())
    prompts = [" ".join(f"w{(i * 7 + j) % 5}" for j in range(3 + i % 4)) for i in range(6)]
    report = calibrate(bundle, prompts, tmp_path / "cal", draft, max_tokens=24)
    after = json.loads((draft / "config.json").read_text())
    assert after.pop("confidence_temperatures") == pytest.approx(report["sts_temperatures"])
    raw.pop("confidence_temperatures", None)
    assert after == raw and sha256_file(draft / "model.safetensors") == weights
    assert Manifest.read(bundle).calibration["sts_temperatures"] == pytest.approx(report["sts_temperatures"])
    assert sorted(p.name for p in (tmp_path / "cal").iterdir()) == ["calibration.json", "reliability.png"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def no_stop_bundle(bundle):
    raw = json.loads((bundle / "manifest.json").read_text())
    raw["stop_token_ids"] = []
    (bundle / "manifest.json").write_text(json.dumps(raw))
    return bundle


def test_a_request_that_exactly_fits_the_context_is_served(bundle):
    from dspark.runtime import DecodeOptions, Runtime

    rt = Runtime(no_stop_bundle(bundle))
    limit = rt.manifest.max_context
    prompt = [1, 2, 3, 4, 5]
    got = {policy: rt.generate([prompt], DecodeOptions(max_tokens=limit - len(prompt), policy=policy))[0]
           for policy in ("ar", "all")}
    assert len(got["ar"].token_ids) == len(got["all"].token_ids) == limit - len(prompt)
    assert got["ar"].token_ids == got["all"].token_ids  # greedy DSpark equals AR to the last position
    assert max(got["all"].committed) > 1  # it did draft before the last positions
    with pytest.raises(DSparkError, match="request 0 needs"):
        rt.generate([prompt], DecodeOptions(max_tokens=limit - len(prompt) + 1))


def test_an_overflowing_request_fails_alone(bundle):
    from dspark.runtime import DecodeOptions, Runtime

    rt = Runtime(no_stop_bundle(bundle))
    options = DecodeOptions(max_tokens=12, batch_size=2)
    alone = rt.generate([[1, 2], [3, 4, 5]], options)
    mixed = rt.generate([[1, 2], [1] * (rt.manifest.max_context - 4), [3, 4, 5]], options)
    assert mixed[1].error and "request 1" in mixed[1].error and mixed[1].token_ids == []
    assert [mixed[0].token_ids, mixed[2].token_ids] == [r.token_ids for r in alone]
    assert all(r.error is None for r in alone)


def test_save_draft_is_readable_by_deepspec_and_refuses_foreign_folders(tiny_bundle_v6, tmp_path):
    drafter = tiny_bundle_v6[2]
    folder = save_draft(drafter, tmp_path / "ckpt", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_anchors"] == 512  # DeepSpec's model class asserts it
    assert set(load_file(folder / "model.safetensors")) == deepspec_schema.weight_names(config)
    assert deepspec_schema.config_problems(config) == []
    assert normal(folder.stat().st_mode, folder=True) and normal((folder / "config.json").stat().st_mode)
    standalone = load_draft(folder)  # no target needed: the shared weights are in the file
    torch.testing.assert_close(standalone.lm_head.weight, drafter.lm_head.weight)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(DSparkError, match="not a dspark draft checkpoint"):
        save_draft(drafter, mine)
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_sharded_checkpoints_are_read_through_their_index(tiny_bundle_v6, tmp_path):
    drafter = tiny_bundle_v6[2]
    folder = save_draft(drafter, tmp_path / "ckpt", dtype=torch.float32)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_draft(folder)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    weight_map[names[0]] = "model-00002-of-00002.safetensors"  # the index says a tensor is where it is not
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(DSparkError, match="lacks"):
        load_draft(folder)


def test_api_values_are_refused_by_name():
    from dspark.runtime import DecodeOptions

    for kw, name in (({"temperature": float("nan")}, "temperature"), ({"seed": -4}, "seed"),
                     ({"policy": "static:2.5"}, "threshold"), ({"max_tokens": np.int64(0)}, "max_tokens")):
        with pytest.raises(DSparkError, match=name):
            DecodeOptions(**kw)
    assert DecodeOptions(temperature=np.float32(0.5), seed=np.int64(3)).temperature == 0.5


def test_deepspec_first_position_threshold_rule(bundle):
    from dspark.runtime import DecodeOptions, Runtime

    from dspark.runtime.scheduler import RoundPlanner

    first = DecodeOptions(policy="static:0.5", threshold_rule="first")
    survival = np.array([[0.9, 0.45, 0.4], [0.4, 0.39, 0.3], [0.9, 0.8, 0.3]])
    active = np.ones(3, dtype=bool)
    first_rule = RoundPlanner(first.policy, 3, None, "first")
    assert not first_rule.feeds(active)["threshold"].any()  # the graph lets every draft through
    assert first_rule.after(survival, active, np.zeros(3, np.int64)).tolist() == [3, 0, 2]  # own conf. .5, .89/.4/.375
    cumulative = RoundPlanner(first.policy, 3, None)
    assert cumulative.after(survival, active, np.array([1, 0, 2])).tolist() == [1, 0, 2]  # the graph's choice
    assert cumulative.after(survival, np.array([True, False, True]), np.array([1, 1, 2])).tolist() == [1, 0, 2]
    rt = Runtime(no_stop_bundle(bundle))
    prompts = [[1, 2, 3], [4, 1]]
    ar = [r.token_ids for r in rt.generate(prompts, DecodeOptions(max_tokens=30, policy="ar"))]
    got = rt.generate(prompts, first.replace(max_tokens=30))
    assert [r.token_ids for r in got] == ar  # greedy: lossless under either rule
    with pytest.raises(DSparkError, match="threshold_rule"):
        DecodeOptions(threshold_rule="last")
