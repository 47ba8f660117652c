"""Makes TensorRT for RTX's unversioned library name resolvable before `import tensorrt_rtx`.

When the RTX ONNX parser falls back to a plugin (our ConfidenceTruncate node), libtensorrt_onnxparser_rtx.so.1
dlopens `libtensorrt_rtx.so`, a name the wheel does not ship (only `.so.1`); the lookup fails and the process
aborts (`terminate called without an active exception`). The parser searches its RPATH, `$ORIGIN`, and glibc takes
`$ORIGIN` from the path a library was opened by, not the path a symlink points to. So the wheel's two libraries are
opened through a private folder of symlinks that also holds `libtensorrt_rtx.so` -> the wheel's `.so.1`; the
parser's lookup then finds the already loaded core library. Measured on 1.7.1: preloading the wheel's own files
(also RTLD_GLOBAL) or setting LD_LIBRARY_PATH after start-up does not help; this does. Nothing outside the
private folder (under the dspark cache) is touched, and the user's environment is not changed.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
from pathlib import Path

from dspark.resolve import cache_dir

CORE = "libtensorrt_rtx.so.1"
PARSER = "libtensorrt_onnxparser_rtx.so.1"
UNVERSIONED = "libtensorrt_rtx.so"
_PRELOADED: list[ctypes.CDLL] = []


def wheel_libs() -> Path | None:
    """The folder of the tensorrt_rtx_libs wheel, or None when that wheel is not installed."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def link_folder(libs: Path, root: Path | None = None) -> Path:
    """The private folder for this wheel: symlinks to its libraries plus the unversioned name (made once, atomically
    per link, so concurrent processes agree)."""
    key = hashlib.sha256(str(libs.resolve()).encode()).hexdigest()[:16]
    folder = (root or cache_dir()) / "tensorrt_rtx_libs" / key
    folder.mkdir(parents=True, exist_ok=True)
    links = {path.name: path for path in libs.glob("*.so*")}
    links[UNVERSIONED] = libs / CORE
    for name, target in links.items():
        link = folder / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        staged = folder / f".{name}.{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(target)
        os.replace(staged, link)
    return folder


def preloaded() -> bool:
    return bool(_PRELOADED)


def preload(root: Path | None = None) -> Path | None:
    """Open the wheel's core and parser libraries through the private folder (once per process); returns the
    folder, or None without the wheel (then `import tensorrt_rtx` reports what is missing)."""
    libs = wheel_libs()
    if libs is None or not (libs / CORE).exists():
        return None
    folder = link_folder(libs, root)
    if not _PRELOADED:
        for name in (CORE, PARSER):
            _PRELOADED.append(ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL))
    return folder
