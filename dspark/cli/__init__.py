"""The command line: `dspark-export` (export_cli) and `dspark` (main_cli), built in dspark/cli/main.py.

The groups load on first use, not when the package is imported: dspark.serve.commands imports dspark.cli.options,
and dspark.cli.main imports dspark.serve.commands, so an eager import here would make importing
dspark.serve.commands first a cycle. The console scripts start at `dspark_main` and `export_main`, which import the
commands themselves, so a Ctrl-C during that second of imports ends in one line, as it does later."""
from __future__ import annotations

import importlib
import sys

__all__ = ["export_cli", "main_cli", "dspark_main", "export_main"]


def __getattr__(name: str):
    if name in ("export_cli", "main_cli"):
        from dspark.cli.main import export_cli, main_cli

        return {"export_cli": export_cli, "main_cli": main_cli}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _start(group: str) -> None:
    try:
        commands = importlib.import_module("dspark.cli.main")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    getattr(commands, group)()


def dspark_main() -> None:
    """The `dspark` console script."""
    _start("main_cli")


def export_main() -> None:
    """The `dspark-export` console script."""
    _start("export_cli")
