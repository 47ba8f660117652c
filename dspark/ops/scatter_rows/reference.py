"""numpy reference of the row-scatter kernel (scatter_rows.cu): what the GPU runtime's cache appends must do."""
from __future__ import annotations

import numpy as np


def scatter_rows(src: np.ndarray, dst: np.ndarray, src_index, dst_index, offset, count) -> None:
    """src [P, Bs, H, Ts, W] -> dst [P, Bd, H, Td, W] in place: rows [0, count[e]) of src batch row src_index[e]
    go to rows [offset[e], offset[e] + count[e]) of dst batch row dst_index[e]. Out-of-range rows are skipped."""
    for s, d, at, n in zip(src_index, dst_index, offset, count):
        s, d, at, n = int(s), int(d), int(at), int(n)
        if not (0 <= s < src.shape[1] and 0 <= d < dst.shape[1]):
            continue
        lo, hi = max(0, -at), min(n, src.shape[3], dst.shape[3] - at)
        if lo < hi:
            dst[:, d, :, at + lo:at + hi] = src[:, s, :, lo:hi]
