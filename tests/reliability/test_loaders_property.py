"""Property: mutated manifests and draft configs (fields deleted, replaced by values of any JSON type, paths
leading out) make the loaders succeed or raise DSparkError, never anything else; what they accept is usable."""
import json
import math
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.models.config import DraftConfig

# CI: the same 1,000 examples every run (a red CI must mean a change broke something); a session hunting for more
# bugs sets DSPARK_PROPERTY_EXAMPLES and DSPARK_PROPERTY_RANDOM=1
EXAMPLES = int(os.environ.get("DSPARK_PROPERTY_EXAMPLES", "1000"))
DERANDOMIZE = os.environ.get("DSPARK_PROPERTY_RANDOM") != "1"
LEAVES = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.integers(-3, 300)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
          | st.sampled_from(["../x.onnx", "/etc/passwd", "verifier.onnx", "float32", "batch", "qwen3", "", "a\x00b"]))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=6)


@st.composite
def mutated(draw, base):
    """base with 1-4 mutations, each at a random path: delete the value, replace it, or add a key."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 4))):
        node, key = doc, None
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            child = node[key]
            if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
                break
            node = child
        if key is None or not isinstance(node, (dict, list)):
            continue
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete" and isinstance(node, dict):
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.text(max_size=6))] = draw(VALUES)
        else:
            node[key] = draw(VALUES)
    return doc


@pytest.fixture(scope="module")
def loader_bundle(tiny_bundle_v6, tmp_path_factory):
    """The tiny bundle's manifest beside empty graph files (the loaders never open the graphs)."""
    folder = tmp_path_factory.mktemp("prop") / "bundle"
    folder.mkdir()
    for f in tiny_bundle_v6[3].iterdir():
        if f.suffix == ".onnx":
            (folder / f.name).write_bytes(b"")
    shutil.copyfile(tiny_bundle_v6[3] / "manifest.json", folder / "manifest.json")
    return folder, json.loads((folder / "manifest.json").read_text())


def load_or_refuse(base: dict, load, inspect) -> None:
    """Feed mutated copies of `base` to `load`: each is refused with a one-line DSparkError or loads into something
    `inspect` finds usable; both outcomes must occur."""
    outcomes = {"accepted": 0, "refused": 0}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=DERANDOMIZE)
    @given(mutated(base))
    def check(doc):
        try:
            loaded = load(doc)
        except DSparkError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
            return
        outcomes["accepted"] += 1
        inspect(loaded)

    check()
    assert outcomes["refused"] > 0 and outcomes["accepted"] > 0, outcomes


def test_mutated_manifests_load_or_raise_dspark_error(loader_bundle):
    folder, base = loader_bundle

    def load(doc):
        (folder / "manifest.json").write_text(json.dumps(doc))
        return Manifest.read(folder)

    def inspect(man):
        assert isinstance(man.block_size, int) and man.block_size >= 1
        assert all(math.isfinite(t) and t > 0 for t in man.sts_temperatures)
        assert len(man.sts_temperatures) == man.block_size
        assert isinstance(man.max_context, int) and man.max_context >= 2
        vocab = man.target["vocab_size"]
        assert all(isinstance(i, int) and 0 <= i < vocab for i in man.stop_token_ids)
        for spec in man.graphs.values():
            assert folder.resolve() in Manifest.path(folder, spec.file).resolve().parents
        man.own_files()

    load_or_refuse(base, load, inspect)


def test_mutated_draft_configs_load_or_raise_dspark_error(tiny_bundle_v6):
    def inspect(cfg):
        for size in (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.vocab_size, cfg.block_size):
            assert isinstance(size, int) and size >= 1
        assert cfg.num_heads % cfg.num_kv_heads == 0
        assert 0 <= cfg.mask_token_id < cfg.vocab_size
        assert all(math.isfinite(t) and t > 0 for t in cfg.sts_temperatures)
        assert DraftConfig.from_dict(cfg.to_dict()) == cfg  # what is accepted is written back loadable

    load_or_refuse(tiny_bundle_v6[2].cfg.to_dict(), DraftConfig.from_dict, inspect)
