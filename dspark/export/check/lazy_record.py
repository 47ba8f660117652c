"""check/ data recorded on first use: a bundle converted without it (`dspark demo`, `dspark-export onnx
--no-check`) gets it from the checkpoints its manifest names, when they are still on this machine and unchanged."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.check.parity import CHECK_DIR, record_check_data
from dspark.files import atomic_folder
from dspark.integrity import file_sha256


def _unchanged(source: dict, what: str) -> Path:
    """The checkpoint a manifest's source names, if it is here and holds what was converted."""
    where = source.get("file") or source.get("folder")
    if not isinstance(where, str) or not Path(where).exists():
        raise DSparkError(f"no {CHECK_DIR}/ reference data, and the {what} this bundle was converted from "
                          f"({where}) is not on this machine: convert again with `dspark-export onnx` (without "
                          f"--no-check) where it is")
    path = Path(where)
    digests = source.get("sha256")
    wanted = {path.name: digests} if isinstance(digests, str) else digests if isinstance(digests, dict) else {}
    for name, digest in wanted.items():
        file = path if path.is_file() else path / name
        if not file.is_file() or file_sha256(file) != digest:
            raise DSparkError(f"no {CHECK_DIR}/ reference data, and the {what} at {path} is not the one this bundle "
                              f"was converted from ({name} changed): the reference would not be this bundle's")
    return path


def record_missing(bundle: Path, say: Callable[[str], None]) -> bool:
    """Record check/ if the bundle has none; returns whether it did. Written beside the bundle and moved in whole."""
    bundle = Path(bundle)
    if (bundle / CHECK_DIR / "expected.json").exists():
        return False
    manifest = Manifest.read_checked(bundle)
    draft = manifest.sources.get("draft") or {}
    name = draft.get("name") if isinstance(draft, dict) else None
    if not isinstance(name, str) or (name.startswith("random") and ":" not in name):
        raise DSparkError(f"no {CHECK_DIR}/ reference data, and this bundle's drafter ({name}) cannot be made "
                          f"again: convert again with `dspark-export onnx` (without --no-check)")
    target = _unchanged(manifest.sources.get("target") or {}, "target")
    draft_source = name if name.startswith("random") else str(_unchanged(draft, "draft checkpoint"))
    say(f"no {CHECK_DIR}/ reference data in {bundle}: recording it once from {target} and {draft_source} ...")
    from dspark.export.trace.onnx_export import draft_ids_for
    from dspark.models.pair import load_pair

    pair = load_pair(str(target), draft_source, lazy=True)
    if manifest.draft.get("draft_vocab"):
        pair.set_draft_vocab(draft_ids_for(pair, int(manifest.draft["draft_vocab"]), tuple(manifest.stop_token_ids)))
    with atomic_folder(bundle / CHECK_DIR) as staging:
        record_check_data(pair, bundle, into=staging)
    return True
