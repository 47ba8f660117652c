"""Dev prompts for integration tests (skipped where the project's shared data is absent)."""
from __future__ import annotations

import pytest

from dspark.errors import DSparkError
from dspark.prompts import dev_prompts_path, read_prompts


def dev_prompts(n: int | None = None, stride: int = 1):
    """Dev prompts spread over the domains (every `stride`-th row)."""
    try:
        path = dev_prompts_path()
    except DSparkError as e:
        pytest.skip(str(e))
    rows = [r["prompt"] for r in read_prompts(path)][::stride]
    return rows[:n] if n else rows
