"""The command line: `dspark-export` (export_cli) and `dspark` (main_cli), built in dspark/cli/main.py.

The groups load on first use, not when the package is imported: dspark.serve.commands imports dspark.cli.options,
and dspark.cli.main imports dspark.serve.commands, so an eager import here would make importing
dspark.serve.commands first a cycle."""
from __future__ import annotations

__all__ = ["export_cli", "main_cli"]


def __getattr__(name: str):
    if name in __all__:
        from dspark.cli.main import export_cli, main_cli

        return {"export_cli": export_cli, "main_cli": main_cli}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
