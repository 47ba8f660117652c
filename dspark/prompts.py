"""Prompt files (JSONL rows with a 'prompt' string, or DeepSpec's 'turns' list): the demo set shipped in the package
and where the project's dev prompts are."""
from __future__ import annotations

import os
from pathlib import Path

from dspark.errors import DSparkError
from dspark.files import parse_json, read_text

DEV_PROMPTS_ENV = "DSPARK_DEV_PROMPTS"
# beside a checkout of this repository: <workspace>/shared/data/prompts/dev.jsonl next to <workspace>/<repo>/
PROJECT_DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "dev.jsonl"
# written for this project (math, chat, code), installed with the package: `dspark demo` works anywhere
DEMO_PROMPTS = Path(__file__).resolve().parent / "assets" / "prompts" / "demo.jsonl"


def read_prompts(path: Path, limit: int | None = None, domain: str | None = None) -> list[dict]:
    """JSONL rows with a 'prompt' (or DeepSpec 'turns') field."""
    rows = []
    if not Path(path).exists():
        raise DSparkError(f"prompt file {path} not found")
    lines = read_text(path, f"prompt file {path}").split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{path}:{i}")
        if isinstance(row, dict) and "prompt" not in row and "turns" in row:
            turns = row["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise DSparkError(f"{path}:{i}: 'turns' must be a non-empty list of strings, not {turns!r:.60}")
            row["prompt"] = turns[0]
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DSparkError(f"{path}:{i} has no 'prompt' string")
        if not row["prompt"].strip():
            raise DSparkError(f"{path}:{i} has an empty prompt")
        if domain is None or row.get("domain") == domain:
            rows.append(row)
    return rows[:limit] if limit else rows


def dev_prompts_path() -> Path:
    """$DSPARK_DEV_PROMPTS, else the project's shared dev prompts beside this checkout."""
    env = os.environ.get(DEV_PROMPTS_ENV)
    for candidate in ([Path(env)] if env else []) + [PROJECT_DEV_PROMPTS]:
        if candidate.exists():
            return candidate.resolve()
    raise DSparkError(f"no dev prompts found: pass --prompts FILE (JSONL with a 'prompt' field) or set "
                      f"{DEV_PROMPTS_ENV}")


def demo_prompts_path() -> Path:
    if not DEMO_PROMPTS.exists():
        raise DSparkError(f"the demo prompts are missing from this installation ({DEMO_PROMPTS}); reinstall dspark")
    return DEMO_PROMPTS


def default_prompts_path() -> Path:
    """The dev prompts where they exist ($DSPARK_DEV_PROMPTS or beside this checkout), else the shipped demo set."""
    try:
        return dev_prompts_path()
    except DSparkError:
        return demo_prompts_path()
