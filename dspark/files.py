"""Reading and writing the project's files: JSON that fails with one line naming the file, files and folders that
appear whole or not at all, and temporaries that a killed process cannot leave behind for good (torch-free).

Every temporary this module makes beside a destination is named `.NAME.tmp-XXXX` and owned through a lock file
`.NAME.tmp-XXXX.lock` that its process holds (flock) while it lives. The next writer of NAME removes the
temporaries whose lock nobody holds any more (a process killed with SIGKILL), never those of a live process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dspark.errors import DSparkError, describe_os_error

LOCK_SUFFIX = ".lock"
_RENAME_EXCHANGE = 2


MAX_TEXT_BYTES = 1 << 30  # a text file dspark reads whole (prompts, JSON): beyond this it is not one


def read_text(path: Path, label: str | None = None, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of `path` (a file or a pipe, at most `limit` bytes); DSparkError naming the file if it cannot be
    read, is a device (/dev/zero would never end), is larger, or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            if stat.S_ISCHR(os.fstat(f.fileno()).st_mode) or stat.S_ISBLK(os.fstat(f.fileno()).st_mode):
                raise DSparkError(f"{label or path} is a device, not a text file")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise DSparkError(f"{label or path} is larger than {limit >> 20} MiB: not a file dspark reads whole")
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # newlines as text mode reads them
    except UnicodeDecodeError as e:
        raise DSparkError(f"{label or path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        why = e.strerror if e.strerror and e.filename in (None, str(path)) else describe_os_error(e)
        raise DSparkError(f"cannot read {label or path}: {why}") from None


def read_json(path: Path, label: str | None = None, kind: type | tuple[type, ...] | None = None) -> Any:
    """The parsed content of `path`; DSparkError naming the file (label: the path by default) if it cannot be read,
    is not UTF-8, is not JSON (see parse_json) or, with `kind`, is not a JSON value of that type (dict: an object,
    list: an array)."""
    return parse_json(read_text(path, label), label or str(path), kind)


def parse_json(text: str | bytes, label: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """Every piece of JSON dspark did not write in this process (a bundle's files, a user's prompt file, a cache
    entry, a server's parameters) is parsed here: malformed JSON, bytes that are not UTF-8, nesting too deep for the
    parser, NaN/Infinity, a number too large to be finite or an integer of more digits than Python converts become
    one DSparkError line naming `label`; with `kind` the top-level value must be of that type."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise DSparkError(f"{label} is not JSON text ({type(text).__name__})")
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        value = json.loads(text.removeprefix("\ufeff"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise DSparkError(f"{label} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise DSparkError(f"{label} is not valid JSON (nested too deeply to read)") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, 1e999, an integer of over 4300 digits
        raise DSparkError(f"{label} is not valid JSON ({_first_line(e)})") from None
    if kind is not None and not isinstance(value, kind):
        raise DSparkError(f"{label} must hold a JSON {_json_kind(kind)}, not {_json_kind(type(value))}")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def _first_line(e: BaseException) -> str:
    if "integer string conversion" in str(e):
        return f"an integer of more than {getattr(sys, 'get_int_max_str_digits', lambda: 4300)()} digits"
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean",
               type(None): "null"}


def _json_kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_JSON_KINDS.get(k, k.__name__) for k in kinds)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normal_mode(path: Path) -> None:
    """What a plain open()/mkdir() would have given: 0666/0777 less the umask (mkstemp/mkdtemp give 0600/0700)."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary file renamed into place: readers see the old or the new file, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        normal_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Temporary:
    """A locked temporary folder `.NAME.tmp-XXXX` beside `dest` (see the module docstring)."""

    def __init__(self, dest: Path):
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.dest)
        fd, lock = tempfile.mkstemp(dir=self.dest.parent, prefix=f".{self.dest.name}.tmp-", suffix=LOCK_SUFFIX)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.lock_fd, self.lock = fd, Path(lock)
        self.path = Path(lock[:-len(LOCK_SUFFIX)])
        self.path.mkdir()
        normal_mode(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self.lock_fd is not None:
            self.lock.unlink(missing_ok=True)
            os.close(self.lock_fd)
            self.lock_fd = None


def remove_stale_temporaries(dest: Path) -> list[Path]:
    """Remove `.NAME.tmp-*` beside dest whose owner died (its lock can be taken); returns what was removed."""
    dest = Path(dest)
    removed = []
    for lock in dest.parent.glob(f".{dest.name}.tmp-*{LOCK_SUFFIX}"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live process holds it
        try:
            folder = Path(str(lock)[:-len(LOCK_SUFFIX)])
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
            elif folder.exists() or folder.is_symlink():
                folder.unlink()
            lock.unlink(missing_ok=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_folder(new: Temporary, dest: Path) -> None:
    """Put new.path at dest. An existing dest is swapped with it in one step (no moment without a dest) and the
    old content, now at the temporary's name, is removed under the temporary's lock."""
    if dest.exists() and _exchange(new.path, dest):
        new.remove()
        return
    if dest.exists():  # no atomic exchange here: the shortest window two renames allow
        old = Temporary(dest)
        old.path.rmdir()
        os.replace(dest, old.path)
        os.replace(new.path, dest)
        old.remove()
        new.release()
        return
    os.replace(new.path, dest)
    new.release()


@contextmanager
def atomic_folder(folder: Path) -> Iterator[Path]:
    """A temporary folder beside `folder` to write into: when the block ends it replaces `folder` (and whatever
    was there), when the block raises it is removed and `folder` stays as it was. A link to a folder is followed:
    the folder it names is replaced and the link stays."""
    folder = Path(folder)
    if folder.is_symlink() and folder.is_dir():
        folder = folder.resolve()
    tmp = Temporary(folder)
    try:
        yield tmp.path
        replace_folder(tmp, folder)
    except BaseException:
        tmp.remove()
        raise


def linked_copy(folder: Path, into: Path) -> None:
    """Every file of `folder` in `into` as a hard link (a copy where links are impossible): the new folder
    shares what it does not change, and what it changes gets new files, so no other copy is written through."""

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(folder, into, copy_function=link, dirs_exist_ok=True)
