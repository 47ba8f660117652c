"""Ctrl-C while the command line is still importing its commands ends in one line and exit status 130."""
import importlib
import sys

import pytest

import dspark.cli


@pytest.mark.parametrize("entry", ["dspark_main", "export_main"])
def test_an_interrupt_during_the_first_imports_is_one_line(entry, monkeypatch, capsys):
    real_import = importlib.import_module

    def interrupted(name, *args, **kwargs):
        if name == "dspark.cli.main":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as exited:
        getattr(dspark.cli, entry)()
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_the_entry_points_run_the_commands(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dspark", "--help"])
    with pytest.raises(SystemExit) as exited:
        dspark.cli.dspark_main()
    assert exited.value.code == 0 and "Usage" in capsys.readouterr().out
