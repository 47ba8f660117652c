"""Optional packages (TensorRT, cuda-python, polygraphy, matplotlib): imported on first use, with one actionable
line when they are missing, so a module's header still names what it needs without making it a hard dependency."""
from __future__ import annotations

import importlib
from types import ModuleType

from dspark.errors import DSparkError


def optional_import(name: str, hint: str) -> ModuleType:
    """import `name`, or raise DSparkError saying how to get it (`hint`, e.g. "pip install 'dspark[trt]'")."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise DSparkError(f"{name} is not installed ({hint}): {e}") from None


class LazyModule:
    """A module-level stand-in: `trt = LazyModule("tensorrt", hint)` imports tensorrt at the first attribute use."""

    def __init__(self, name: str, hint: str):
        self._name, self._hint, self._module = name, hint, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = optional_import(self._name, self._hint)
        return getattr(self._module, attr)
