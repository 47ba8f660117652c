"""`dspark-export triton` writes a repository Triton parses as written, replaces only what it wrote, and copies
only the bundle's own files (the server itself: tests/serve/test_triton.py)."""
import re
import shutil

import pytest
from google.protobuf import text_format

from dspark.errors import DSparkError
from dspark.serve.triton import TritonModel, write_repository

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")


def _parsed(folder):
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_a_bundle_path_with_quotes_stays_one_parameter(tiny_bundle_v6, tmp_path):
    hostile = tmp_path / 'b" } } parameters: { key: "threads" value: { string_value: "64'
    shutil.copytree(tiny_bundle_v6[3], hostile)
    folder = write_repository(TritonModel(bundle=hostile), tmp_path / "repo")
    config = _parsed(folder)
    assert config.parameters["bundle"].string_value == str(hostile.resolve())
    assert "threads" not in config.parameters and config.name == "dspark" and config.backend == "python"


def test_force_replaces_only_a_folder_it_wrote(tiny_bundle_v6, tmp_path):
    model = TritonModel(bundle=tiny_bundle_v6[3])
    mine = tmp_path / "repo" / "dspark"
    mine.mkdir(parents=True)
    (mine / "weights.bin").write_bytes(b"the user's")
    with pytest.raises(DSparkError, match="exists; pass --force"):
        write_repository(model, tmp_path / "repo")
    with pytest.raises(DSparkError, match="not written by dspark-export triton"):
        write_repository(model, tmp_path / "repo", force=True)
    assert (mine / "weights.bin").read_bytes() == b"the user's"
    shutil.rmtree(mine)
    write_repository(model, tmp_path / "repo")
    (mine / "1" / "notes.txt").write_text("added by the user")
    with pytest.raises(DSparkError, match="not written by dspark-export triton"):
        write_repository(model, tmp_path / "repo", force=True)
    (mine / "1" / "notes.txt").unlink()
    write_repository(TritonModel(bundle=tiny_bundle_v6[3], instances=2), tmp_path / "repo", force=True)
    assert _parsed(mine).instance_group[0].count == 2


def test_copy_bundle_copies_the_bundles_own_files_and_refuses_links_out(tiny_bundle_v6, tmp_path):
    bundle = shutil.copytree(tiny_bundle_v6[3], tmp_path / "bundle")
    (bundle / "private-notes.txt").write_text("not part of the bundle")
    folder = write_repository(TritonModel(bundle=bundle, copy_bundle=True), tmp_path / "repo")
    copied = {p.name for p in (folder / "1" / "bundle").iterdir()}
    assert "manifest.json" in copied and "private-notes.txt" not in copied
    secret = tmp_path / "secret.jinja"
    secret.write_text("{{ 'a system file' }}")
    (bundle / "chat_template.jinja").unlink(missing_ok=True)
    (bundle / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(DSparkError, match="links outside the bundle"):
        write_repository(TritonModel(bundle=bundle, copy_bundle=True), tmp_path / "repo2")
    assert not (tmp_path / "repo2" / "dspark").exists()


@pytest.fixture
def triton_model(monkeypatch):
    """dspark.serve.triton_model as Triton's Python backend imports it (its utils module stubbed)."""
    import importlib
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "dspark.serve.triton_model", raising=False)
    return importlib.import_module("dspark.serve.triton_model")


def _config(**params) -> str:
    import json

    return json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})


@pytest.mark.parametrize("config, says", [
    ("{", "the Triton model configuration is not valid JSON"),
    ("[" * 100000, "nested too deeply"),
    ("[]", "must hold a JSON object"),
    ('{"parameters": [1]}', "parameters must be a map"),
    ('{"parameters": {"bundle": "b"}}', "parameter 'bundle' has no string_value"),
    (_config(threads="4"), "the parameter 'bundle'"),
    (_config(bundle="b", threads="four"), "parameter 'threads' is 'four'"),
    (_config(bundle="b", batch_size="-2"), "parameter 'batch_size' is '-2'"),
    (_config(bundle="b", max_context="0"), "parameter 'max_context' is '0'"),
])
def test_a_hand_edited_model_config_is_one_line(triton_model, config, says):
    from dspark.errors import DSparkError

    with pytest.raises(DSparkError, match=re.escape(says)):
        params = triton_model.parameters(config)
        for key in ("threads", "batch_size", "max_queue", "max_context"):
            triton_model._count(params, key, None, lo=0 if key == "max_queue" else 1)


def test_the_model_config_written_by_the_command_parses(triton_model, tiny_bundle_v6, tmp_path):
    params = triton_model.parameters(_config(bundle=str(tiny_bundle_v6[3]), batch_size="auto", max_queue="0"))
    assert params["bundle"] == str(tiny_bundle_v6[3]) and triton_model._count(params, "max_queue", 64, lo=0) == 0
    assert triton_model._count(params, "threads", None) is None
