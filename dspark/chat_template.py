"""The sandbox a chat template renders in: jinja2's immutable sandbox, with the work of one render bounded, so a
template from a bundle (untrusted input) cannot hang a server or fill its memory: every range() of a render draws
from one budget of iterations (nested loops multiply), and `*` / `**` cannot build a string, list or number past a
size; the render itself stops past a time and a text size."""
from __future__ import annotations

import time
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark.errors import DSparkError

MAX_ITERATIONS = 1_000_000  # range() items per render, all loops together
MAX_ITEMS = 1_000_000  # characters or items a `*` may make
MAX_EXPONENT_BITS = 4096


class BoundedTemplates(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                    raise DSparkError(f"the chat template builds a sequence of {len(seq) * n} items (at most "
                                      f"{MAX_ITEMS})")
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_EXPONENT_BITS:
                raise DSparkError(f"the chat template computes {left} ** {right}, a number too large")
        return super().call_binop(context, operator, left, right)


def bounded_range(budget: list[int]):
    """range() for one render: the items of every call count against budget[0]."""

    def limited(*args):
        items = range(*args)
        budget[0] -= len(items)
        if budget[0] < 0:
            raise DSparkError(f"the chat template loops more than {MAX_ITERATIONS} times in one render")
        return items

    return limited


RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 16 << 20


def render_bounded(template, **values) -> str:
    """template.render(**values), stopped once it runs past RENDER_SECONDS or MAX_RENDER_CHARS of text (checked
    between the pieces jinja2 yields: every loop that writes text yields)."""
    deadline = time.monotonic() + RENDER_SECONDS
    pieces, size = [], 0
    for piece in template.generate(range=bounded_range([MAX_ITERATIONS]), **values):
        pieces.append(piece)
        size += len(piece)
        if size > MAX_RENDER_CHARS:
            raise DSparkError(f"the chat template writes more than {MAX_RENDER_CHARS} characters for one request")
        if time.monotonic() > deadline:
            raise DSparkError(f"the chat template takes longer than {RENDER_SECONDS:g} s to render one request")
    return "".join(pieces)
