"""Reading and writing the project's files: JSON that fails with one line naming the file, and folders that
appear whole or not at all (torch-free)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dspark.errors import DSparkError


def read_json(path: Path, label: str | None = None) -> Any:
    """The parsed content of `path`; DSparkError "<label> is not valid JSON (...)" if it is not (label: the path)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DSparkError(f"{label or path} is not valid JSON ({e})") from None


@contextmanager
def atomic_folder(folder: Path) -> Iterator[Path]:
    """A temporary folder beside `folder` to write into: when the block ends it replaces `folder` (and whatever
    was there), when the block raises it is removed and `folder` stays as it was."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    try:
        yield tmp
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
