"""How many tokens a prompt leaves room for in a context: the one rule `dspark run`, bench and calibrate (the
Decoder) and `dspark serve` (the Engine) apply, and the line that says which prompts of a batch it left out."""
from __future__ import annotations


def max_new_tokens(context: int, prompt_len: int) -> int:
    """The most tokens a request with `prompt_len` prompt tokens may generate in `context` positions (0 or less:
    none). prompt + max_tokens <= context: the last token generated is never written to the cache, and rounds
    within a block of the end verify without drafting (Slots._room_to_draft), so such a request runs to its last
    token."""
    return context - prompt_len



def skipped_line(skipped: int, total: int, max_tokens: int, context: int) -> str:
    """One line for a batch of `total` prompts of which `skipped` did not fit `context` with `max_tokens`."""
    return (f"skipped {skipped} of {total} prompts: prompt + max_tokens {max_tokens} does not fit the context of "
            f"{context} positions; {total - skipped} ran")
