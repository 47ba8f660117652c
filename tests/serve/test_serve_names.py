"""`dspark serve --demo`: the bundle `dspark demo` made, under a model id that does not change with its cache
folder's digest, and the serving page's examples (docs/serving.md) written against exactly that."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dspark.cli import main_cli
from dspark.errors import DSparkError
from dspark.serve.names import served

SERVING = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_demo_serves_the_demo_bundle_as_a_stable_model_id(tiny_bundle_v6, cache):
    from dspark.demo import demo_bundle_path

    with pytest.raises(DSparkError, match="run `dspark demo` first"):
        served(None, True, None)
    own = demo_bundle_path("gguf")
    shutil.copytree(tiny_bundle_v6[3], own)
    target = served(None, True, None)
    assert target.bundle == own and target.model_name == "smollm2-135m-dspark" and target.aliases == (own.name,)
    plain = served(own, False, "mine")
    assert plain.model_name == "mine" and plain.aliases == (own.name,)
    assert served(own, False, None).aliases == ()


@pytest.mark.parametrize("args, message", [([], "give the BUNDLE to serve, or --demo"),
                                           (["somewhere", "--demo"], "either BUNDLE or --demo")])
def test_serve_needs_one_bundle(cache, args, message):
    res = CliRunner().invoke(main_cli, ["serve", *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_the_serving_page_examples_address_the_demo_bundle():
    section = SERVING  # the whole page: `dspark serve` and Triton
    assert re.search(r"^dspark serve --demo", section, flags=re.MULTILINE)
    models = re.findall(r'"model": "([^"]+)"', section) + re.findall(r'model="([^"]+)"', section)
    assert models and set(models) == {"smollm2-135m-dspark"}
    assert "temperature` (0..2, default 0: greedy" in section
