"""A frequency-ranked draft vocabulary (as in FR-Spec): the draft heads score only the N most frequent tokens.

On CPU the heads' cost is dominated by the LM head and the Markov bias over the whole vocabulary, once per
block position. Restricting the draft to a shortlist is lossless, because verification uses the draft's actual
distribution (zero outside the shortlist): the verifier's residual resampling produces the other tokens. It only
costs the acceptances the draft would have had on tokens outside the list.

The ranking lives beside a checkpoint (`draft_vocab.json`, written by `dspark train` from the target's own
responses); tokens never counted follow in id order, which for BPE vocabularies is merge order.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from dspark.errors import DSparkError
from dspark.files import read_json
from dspark.schema import is_int

FILE = "draft_vocab.json"
FORMAT = "dspark-draft-vocab/1"


def rank_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> tuple[list[int], int]:
    """Token ids by falling frequency (ties by id), and how many tokens were counted."""
    counts = Counter(int(t) for seq in sequences for t in seq if 0 <= int(t) < vocab_size)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))], sum(counts.values())


def write_ranking(folder: Path, ranked: Sequence[int], counted: int, vocab_size: int, source: str) -> Path:
    """`ranked`, `counted`: what rank_tokens returned."""
    path = Path(folder) / FILE
    path.write_text(json.dumps({"format": FORMAT, "vocab_size": vocab_size, "counted_tokens": counted,
                                "source": source, "ranked_ids": list(ranked)}) + "\n")
    return path


def read_ranking(folder: Path, vocab_size: int) -> list[int]:
    path = Path(folder) / FILE
    if not path.exists():
        raise DSparkError(f"{folder} has no {FILE} (a token ranking for --draft-vocab); `dspark train` writes one "
                          f"from its responses, or drop --draft-vocab")
    raw = read_json(path, kind=dict)
    ranked, size = raw.get("ranked_ids"), raw.get("vocab_size")
    if not (isinstance(ranked, list) and all(is_int(t) for t in ranked) and is_int(size)):
        raise DSparkError(f"{path} is not a dspark draft-vocabulary file")
    ok = raw.get("format") == FORMAT and size == vocab_size
    if not ok or any(not 0 <= t < vocab_size for t in ranked):
        raise DSparkError(f"{path} does not describe this target's {vocab_size}-token vocabulary")
    return ranked


def shortlist(ranked: Sequence[int], size: int, vocab_size: int, keep: Iterable[int] = ()) -> np.ndarray:
    """Sorted ids of the `size` tokens to draft from: `keep` (stop tokens) first, then by rank, then by id."""
    if not 1 <= size <= vocab_size:
        raise DSparkError(f"--draft-vocab must lie in 1..{vocab_size}")
    chosen = dict.fromkeys(int(t) for t in keep)
    if len(chosen) >= size:
        raise DSparkError(f"--draft-vocab {size} leaves no room beside the {len(chosen)} stop tokens")
    for t in ranked:
        if len(chosen) == size:
            break
        chosen.setdefault(int(t), None)
    next_id = 0
    while len(chosen) < size:
        chosen.setdefault(next_id, None)
        next_id += 1
    return np.array(sorted(chosen), dtype=np.int64)
