"""Every ```bash and ```python block of README.md and docs/*.md as written: python blocks run on a tiny bundle (its
path in place of the docs'), every bash command line parses against the CLI it names (click commands, bench scripts'
--help) and the repository files it names exist; every relative Markdown link points to a file of the repository."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dspark.cli import export_cli, main_cli

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXTS = {path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8") for path in DOC_FILES}
README = TEXTS["README.md"]
BLOCKS = [(name, lang, body) for name, text in TEXTS.items()
          for lang, body in re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.DOTALL)]
BASH_LINES = [(name, line) for name, lang, body in BLOCKS if lang == "bash" for line in body.splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
PYTHON_BLOCKS = [(name, body) for name, lang, body in BLOCKS if lang == "python"]
README_BUNDLE = "out/smollm2-bundle"
MUST_PRINT_TAU = {"README.md"}  # files whose python blocks print the decode's tau
TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"out", "runs", "build", "dist"}


def commands(line: str) -> list[list[str]]:
    """The simple commands of a line (`a && b`), comments and [optional] brackets dropped."""
    words = [w.strip("[]") for w in shlex.split(line, comments=True)]
    out, current = [], []
    for w in words:
        if w == "&&":
            out.append(current)
            current = []
        elif w:
            current.append(w)
    return [c for c in out + [current] if c]


def parse_click(group: click.Group, name: str, args: list[str]) -> None:
    """Parse `args` as the CLI would (options, types, required ones) for the leaf command they name; runs nothing.
    (The groups take no options of their own.)"""
    command, parent = group, click.Context(group, info_name=name)
    while isinstance(command, click.Group):
        assert args, f"{name}: a command of {command.name} is missing"
        sub = command.get_command(parent, args[0])
        assert sub is not None, f"{name}: no command {args[0]!r}"
        parent = click.Context(sub, info_name=args[0], parent=parent)
        command, args = sub, args[1:]
    command.make_context(parent.info_name, list(args), parent=parent.parent)


def test_parse_click_refuses_what_the_cli_refuses():
    parse_click(main_cli, "dspark", ["cache", "clear", "--kind", "bundles", "--yes"])
    for bad in (["run", "b", "--no-such-option"], ["run", "b"], ["cache", "sweep"], ["bench", "b", "-R", "0"]):
        with pytest.raises((click.UsageError, AssertionError)):
            parse_click(main_cli, "dspark", bad)


def repo_paths(cmd: list[str]) -> list[str]:
    """Words that name files of this repository (placeholders, outputs and ../shared data aside)."""
    values = [w.split("=", 1)[-1] for w in cmd[1:]]
    return [w for w in values if "/" in w and w.split("/")[0] in TOP_LEVEL]


def test_readme_has_blocks_to_check():
    assert len(DOC_FILES) >= 2, "docs/ has no pages"
    assert len(BASH_LINES) >= 15 and PYTHON_BLOCKS
    assert any(name == "README.md" for name, _ in PYTHON_BLOCKS)
    assert any(name == "README.md" for name, _ in BASH_LINES)
    assert any("smollm2-135m-dspark" in line and "dspark-export onnx" in line for _, line in BASH_LINES)
    assert any(line.startswith("dspark reference") for _, line in BASH_LINES)
    assert "download.pytorch.org/whl/cpu" in README


def test_the_readme_links_every_docs_page():
    linked = {target for _, target in relative_links("README.md")}
    assert {name for name in TEXTS if name.startswith("docs/")} <= linked


@pytest.mark.parametrize("name, line", BASH_LINES, ids=[f"{name}: {line}" for name, line in BASH_LINES])
def test_bash_line_parses_and_names_existing_files(name, line):
    for cmd in commands(line):
        if cmd[0].endswith(("/bin/python", "/bin/pip")):  # a venv's own (the Triton recipe's)
            cmd = [cmd[0].rsplit("/", 1)[1], *cmd[1:]]
        for path in repo_paths(cmd):
            assert (REPO / path).exists(), f"{line!r} names {path}, which is not in the repository"
        if cmd[0] in ("dspark", "dspark-export"):
            parse_click(main_cli if cmd[0] == "dspark" else export_cli, cmd[0], cmd[1:])
        elif cmd[0] == "python" and cmd[1].endswith(".py"):
            assert (REPO / cmd[1]).exists()
            help_text = subprocess.run([sys.executable, cmd[1], "--help"], cwd=REPO, capture_output=True,
                                       text=True, check=True).stdout
            for option in (w.split("=")[0] for w in cmd[2:] if w.startswith("--")):
                assert option in help_text, f"{cmd[1]} --help has no {option}"
        elif cmd[0] == "python" and cmd[1:3] == ["-m", "venv"]:
            assert len(cmd) == 4, f"{line!r}: python -m venv takes one folder here"
        elif cmd[0] == "python" and cmd[1:3] == ["-m", "pytest"]:
            assert all((REPO / w).exists() for w in cmd[3:] if not w.startswith("-"))
        elif cmd[0] == "pip" and cmd[1] == "install":
            extras = re.findall(r"\.\[([\w,]+)\]", " ".join(cmd))
            setup = (REPO / "setup.py").read_text()
            assert all(f'"{e}":' in setup for group in extras for e in group.split(","))
        elif cmd[0] == "cmake":
            continue  # the plugin build: its source folder is checked above
        else:
            pytest.fail(f"{name} line {line!r} runs {cmd[0]!r}, which this test does not know how to check")


def test_python_blocks_run_on_a_tiny_bundle(tiny_bundle_v6, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], bundle)  # ensure_sps_table writes the profiled table into it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name, code in PYTHON_BLOCKS:
        assert README_BUNDLE in code, f"a python block of {name} does not use {README_BUNDLE}"
        proc = subprocess.run([sys.executable, "-c", code.replace(README_BUNDLE, str(bundle))], cwd=tmp_path, check=False,
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        if name in MUST_PRINT_TAU:
            assert "tau " in proc.stdout, f"a python block of {name} printed no tau"


def test_the_cpu_wheel_instruction_comes_before_the_command_it_affects():
    assert README.index("download.pytorch.org/whl/cpu") < README.index('pip install -e ".[export]"')


def markdown_links(text: str) -> list[str]:
    """The targets of `[text](target)` links (images too) outside fenced code blocks and inline code spans."""
    prose = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"(`+).+?\1", "", prose, flags=re.DOTALL)
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def relative_links(name: str) -> list[tuple[str, str]]:
    """(link, repository path it points to) for the relative links of one file (http(s), mail and pure #anchor
    links aside); the path is relative to the repository root, resolved from the file's folder."""
    out = []
    for link in markdown_links(TEXTS[name]):
        if re.match(r"[a-z][a-z0-9+.-]*:", link, flags=re.IGNORECASE) or link.startswith("#"):
            continue
        target = (REPO / name).parent / link.split("#", 1)[0]
        out.append((link, os.path.relpath(os.path.normpath(target), REPO).replace(os.sep, "/")))
    return out


def test_markdown_links_finds_links_and_skips_code():
    text = "[a](docs/x.md) ![i](img.png#top) `[b](no.md)` [c](http://x.org) [d](#anchor)\n```\n[e](no2.md)\n```\n"
    assert markdown_links(text) == ["docs/x.md", "img.png#top", "http://x.org", "#anchor"]


@pytest.mark.parametrize("name", list(TEXTS))
def test_relative_links_point_to_files_of_the_repository(name):
    links = relative_links(name)
    if name == "README.md":
        assert links, "README.md links no page"
    broken = [link for link, target in links if target.startswith("..") or not (REPO / target).exists()]
    assert not broken, f"{name} links to what is not in the repository: {broken}"
