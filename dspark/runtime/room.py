"""How many tokens a prompt leaves room for in a context: the one rule `dspark run`, bench and calibrate (the
Decoder) and `dspark serve` (the Engine) apply."""
from __future__ import annotations


def max_new_tokens(context: int, prompt_len: int) -> int:
    """The most tokens a request with `prompt_len` prompt tokens may generate in `context` positions (0 or less:
    none). prompt + max_tokens <= context: the last token generated is never written to the cache, and rounds
    within a block of the end verify without drafting (Slots._room_to_draft), so such a request runs to its last
    token."""
    return context - prompt_len

