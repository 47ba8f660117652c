"""What a bundle's files should hold, checked before they are used.

Graph files carry their sha256 in the manifest; the data files (weights.data and each graph's .data) get a record
of their size and sha256 whenever a manifest is written. Reading a bundle checks every graph, lazily loaded ones
included, and every recorded data file: its size each time, its sha256 once per file version (a cache in the
user's dspark cache, keyed by device, inode, size and mtime, so a rename or a second load costs nothing);
`dspark doctor` hashes everything again whatever the cache says.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dspark.errors import DSparkError, describe_os_error
from dspark.files import read_json, write_text_atomic
from dspark.resolve import CacheUnwritable, cache_dir

_SEEN_FILE = "verified-files.json"
_SEEN_LIMIT = 512  # file versions remembered


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _version(path: Path) -> str:
    st = Path(path).stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _seen() -> dict[str, str]:
    try:
        path = cache_dir() / _SEEN_FILE  # a DSPARK_CACHE naming a file is said (DSparkError), not ignored
    except CacheUnwritable:
        return {}
    try:
        return read_json(path, kind=dict)
    except DSparkError:  # none yet, or damaged: hashed again and rewritten
        return {}


def file_sha256(path: Path, full: bool = False) -> str:
    """The sha256 of `path`, from the cache of hashed file versions unless `full` (then hashed and remembered)."""
    version = _version(path)
    seen = _seen()
    if not full and isinstance(seen.get(version), str):
        return seen[version]
    digest = sha256_file(path)
    seen[version] = digest
    try:
        write_text_atomic(cache_dir() / _SEEN_FILE, json.dumps(dict(list(seen.items())[-_SEEN_LIMIT:])))
    except (OSError, DSparkError):
        pass  # a read-only cache: the next load hashes again
    return digest


def read_onnx(path: Path, label: str | None = None):
    """The ModelProto of the ONNX file `path`, its external data left where it is: a DSparkError line naming the
    file when it cannot be read, is empty, or is not an ONNX model (cut short, damaged, another kind of file).
    Every reader of a graph file goes through here (onnx: the export extra)."""
    import onnx  # dspark-export's dependency; the runtime reads graphs through ONNX Runtime

    path, label = Path(path), label or str(path)
    how = "re-export the bundle or copy it again"
    try:
        if path.stat().st_size == 0:
            raise DSparkError(f"{label} is empty, not an ONNX graph: {how}")
        model = onnx.load(str(path), load_external_data=False)
    except DSparkError:
        raise
    except OSError as e:
        raise DSparkError(f"cannot read {label}: {describe_os_error(e)}") from None
    except Exception as e:  # protobuf's DecodeError, and what else a damaged file makes onnx raise
        raise DSparkError(f"{label} is not an ONNX graph ({type(e).__name__}): it is damaged, cut short or another "
                          f"kind of file; {how}") from None
    if not model.HasField("graph") or model.ir_version <= 0 or not model.graph.node:
        raise DSparkError(f"{label} is not an ONNX graph (no graph with nodes in it): it is damaged, cut short or "
                          f"another kind of file; {how}")
    return model


def data_records(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of the data files among `names` that exist in folder."""
    records = {}
    for name in names:
        path = Path(folder) / name
        if path.is_file():
            records[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return records


def check_file(path: Path, label: str, want_sha256: str, want_bytes: int | None = None, full: bool = False) -> None:
    """DSparkError in one line if `path` is missing, of another size, or holds other bytes than recorded."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "is missing from the bundle"
        raise DSparkError(f"{label} {what} ({path}); re-export the bundle or copy it again")
    if want_bytes is not None and path.stat().st_size != want_bytes:
        raise DSparkError(f"{label} is {path.stat().st_size} bytes, the manifest records {want_bytes}: the bundle "
                          f"is damaged or half-copied; copy it again or re-export it")
    if want_sha256 and file_sha256(path, full) != want_sha256:
        raise DSparkError(f"{label} does not hold what the manifest records (sha256 differs): the bundle is "
                          f"damaged; copy it again or re-export it")
