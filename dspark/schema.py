"""Checks at the boundary for untrusted JSON (manifests, draft configs): a value of the wrong type, out of range or
pointing outside its folder becomes one DSparkError line naming the file, the field and the value (torch-free)."""
from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from dspark.errors import DSparkError


class Fields:
    """Typed reads from one JSON object; `where` prefixes every message (e.g. 'bundle/manifest.json: draft')."""

    def __init__(self, raw: Any, where: str):
        if not isinstance(raw, dict):
            raise DSparkError(f"{where} must be a JSON object, not {_kind(raw)}")
        self.raw, self.where = raw, where

    def fail(self, key: str, what: str):
        raise DSparkError(f"{self.where}.{key} {what}")

    def has(self, key: str) -> bool:
        return key in self.raw and self.raw[key] is not None

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def integer(self, key: str, lo: int | None = None, hi: int | None = None, default: Any = ...) -> int:
        value = self._value(key, default)
        if not is_int(value):
            self.fail(key, f"must be an integer, not {value!r}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            self.fail(key, f"is {value}, outside {_range(lo, hi)}")
        return value

    def number(self, key: str, lo: float | None = None, positive: bool = False, default: Any = ...) -> float:
        value = self._value(key, default)
        check_number(value, f"{self.where}.{key}", lo=lo, positive=positive)
        return float(value)

    def string(self, key: str, default: Any = ..., choices: tuple[str, ...] | None = None) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            self.fail(key, f"must be a string, not {value!r}")
        if choices is not None and value not in choices:
            self.fail(key, f"is {value!r}, not one of {', '.join(choices)}")
        return value

    def boolean(self, key: str, default: Any = ...) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, not {value!r}")
        return value

    def int_list(self, key: str, lo: int | None = None, hi: int | None = None, default: Any = ...) -> list[int]:
        value = self._value(key, default)
        if not isinstance(value, list) or not all(is_int(v) for v in value):
            self.fail(key, f"must be a list of integers, not {_short(value)}")
        bad = [v for v in value if (lo is not None and v < lo) or (hi is not None and v > hi)]
        if bad:
            self.fail(key, f"holds {bad[0]}, outside {_range(lo, hi)}")
        return value

    def number_list(self, key: str, positive: bool = False, default: Any = ...) -> list[float]:
        value = self._value(key, default)
        if not isinstance(value, list):
            self.fail(key, f"must be a list of numbers, not {_short(value)}")
        for i, v in enumerate(value):
            check_number(v, f"{self.where}.{key}[{i}]", positive=positive)
        return [float(v) for v in value]

    def obj(self, key: str, default: Any = ...) -> "Fields":
        return Fields(self._value(key, default), f"{self.where}.{key}")

    def _value(self, key: str, default: Any) -> Any:
        if key not in self.raw or self.raw[key] is None and default is not ...:
            if default is ...:
                self.fail(key, "is missing")
            return default
        return self.raw[key]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_number(value: Any, name: str, lo: float | None = None, positive: bool = False) -> float:
    """A finite real number (no bool, no NaN/inf), >= lo, > 0 with positive; DSparkError naming `name` if not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DSparkError(f"{name} must be a finite number, not {value!r}")
    if positive and value <= 0:
        raise DSparkError(f"{name} must be positive, not {value!r}")
    if lo is not None and value < lo:
        raise DSparkError(f"{name} must be at least {lo}, not {value!r}")
    return float(value)


def contained(folder: Path, name: Any, what: str = "bundle") -> Path:
    """folder/name if it names a file inside folder (after resolving links), else DSparkError."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise DSparkError(f"{what} {folder} names {_short(name)} as a file, which is not a file name")
    root = Path(folder).resolve()
    target = (Path(folder) / name).resolve()
    if Path(name).is_absolute() or (target != root and root not in target.parents):
        raise DSparkError(f"{what} {folder} names {name!r}, which lies outside the {what} folder: refused")
    return Path(folder) / name


def _range(lo: int | None, hi: int | None) -> str:
    return f"{lo if lo is not None else '...'}..{hi if hi is not None else '...'}"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
