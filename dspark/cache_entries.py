"""What `dspark cache list|clear` sees: the entries under the cache folder, and which of them dspark provably made.

`clear` deletes only entries whose name and contents match what dspark writes there; anything else found under
a cache folder (a user's file, a folder DSPARK_CACHE happened to point at) is listed as not dspark's and kept.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dspark.bundle import TOKENIZER_FILES, is_bundle
from dspark.files import LOCK_SUFFIX, remove_stale_temporaries
from dspark.resolve import cache_dir

# dequantized GGUF targets, demo bundles, built CUDA kernels, the links that let TensorRT for RTX load its wheel's
# libraries (dspark.trt.rtx_libs; made again on the next import), SPS tables profiled for a run (dspark.calibration
# .sps_cache)
CACHE_KINDS = ("targets", "bundles", "kernels", "tensorrt_rtx_libs", "sps")

_TARGET_FILES = set(TOKENIZER_FILES) | {"config.json", "model.safetensors"}
_KERNEL_FILE = re.compile(r"confidence_truncate-[0-9a-f]+-sm_\d+\.(cubin|tmp)")
_KERNEL_FOLDER = re.compile(r"\d+(-\d+)*")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SPS_FILE = re.compile(r"[0-9a-f]{24}\.json")


@dataclass(frozen=True)
class CacheEntry:
    kind: str
    path: Path
    bytes: int
    ours: bool  # name and contents are what dspark writes there: `clear` may delete it


def folder_bytes(path: Path) -> int:
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _plain_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _target(path: Path) -> bool:
    """targets/<gguf stem>-<16 hex>: an HF config + tokenizer folder (dspark.models.target)."""
    return (_plain_folder(path) and _HEX16.fullmatch(path.name.rsplit("-", 1)[-1]) is not None
            and all(p.is_file() and not p.is_symlink() and p.name in _TARGET_FILES for p in path.iterdir()))


def _bundle(path: Path) -> bool:
    """bundles/<name>: a dspark bundle holding nothing but its own files (dspark.demo)."""
    if not _plain_folder(path):
        return False
    manifest = is_bundle(path)
    return manifest is not None and all(p.name in manifest.own_files() for p in path.iterdir())


def _kernel(path: Path) -> bool:
    """kernels/: plugin cubins (dspark.trt.plugin_kernel) and nvcc builds per arch list (dspark.ops.kernels)."""
    if path.is_file() and not path.is_symlink():
        return _KERNEL_FILE.fullmatch(path.name) is not None
    return (_plain_folder(path) and _KERNEL_FOLDER.fullmatch(path.name) is not None
            and all(p.name == "libdspark_kernels.so" and p.is_file() for p in path.iterdir()))


def _rtx_links(path: Path) -> bool:
    """tensorrt_rtx_libs/<16 hex>: symbolic links only (dspark.trt.rtx_libs)."""
    return (_plain_folder(path) and _HEX16.fullmatch(path.name) is not None
            and all(p.is_symlink() for p in path.iterdir()))


def _sps(path: Path) -> bool:
    return path.is_file() and not path.is_symlink() and _SPS_FILE.fullmatch(path.name) is not None


OURS = {"targets": _target, "bundles": _bundle, "kernels": _kernel, "tensorrt_rtx_libs": _rtx_links, "sps": _sps}


def cache_entries(kinds: tuple[str, ...] = CACHE_KINDS) -> list[CacheEntry]:
    """Every entry under the cache's folders of these kinds, each marked whether dspark made it (hidden names are
    staging temporaries, which their writers and `clear` tidy)."""
    root = cache_dir()
    return [CacheEntry(kind, entry, folder_bytes(entry), OURS[kind](entry)) for kind in kinds
            if _plain_folder(root / kind) for entry in sorted((root / kind).iterdir())
            if not entry.name.startswith(".")]


def clear_cache(kinds: tuple[str, ...] = CACHE_KINDS) -> list[CacheEntry]:
    """Remove the entries of these kinds that dspark made; returns what was removed."""
    root = cache_dir()
    for kind in kinds:  # temporaries left by a killed writer (their lock files say they were dspark's)
        for lock in (root / kind).glob(f".*.tmp-*{LOCK_SUFFIX}") if _plain_folder(root / kind) else ():
            remove_stale_temporaries(root / kind / lock.name[1:].split(".tmp-")[0])
    removed = [e for e in cache_entries(kinds) if e.ours]
    for entry in removed:
        if _plain_folder(entry.path):
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink()
    return removed
