"""Host KV caches as wide as the longest valid prefix needs (dspark.runtime.kv.HostKV): re-laid as requests grow
and leave, every valid entry and the mask kept, views of the leading slots taken again."""
import numpy as np
from hypothesis import given, settings, strategies as st

from dspark.runtime.kv import WINDOW_STEP, HostKV, LeadingKV, _columns, move_kv

CAPACITY = 16 * WINDOW_STEP


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 400), st.booleans()), min_size=1, max_size=25))
def test_a_windowed_cache_holds_what_a_full_width_one_holds(ops):
    """Each op writes `count` entries after slot b's prefix and commits them, or (False) rolls it back to `count`
    and then fits a step of 3 positions; the valid entries and mask equal a full-width reference's throughout."""
    kv = HostKV(2, 3, 2, CAPACITY, 4)
    lead = LeadingKV(kv, 2)
    ref = np.zeros((2, 2, 3, 2, CAPACITY, 4), np.float32)
    rng = np.random.default_rng(0)
    for b, count, grow in ops:
        length = int(kv.lengths[b])
        if grow:
            count = min(count, CAPACITY - length)
            new = rng.standard_normal((2, 2, 3, 2, count, 4)).astype(np.float32)
            kv.write(new, b, count)
            ref[:, :, b, :, length:length + count] = new[:, :, b]
            kv.commit(b, length + count)
        else:
            kv.commit(b, min(count, length))
            kv.fit(3)
        longest = int(kv.lengths.max())
        assert kv.width % WINDOW_STEP == 0 or kv.width == CAPACITY
        assert longest <= kv.width
        if not grow:  # fitted: wide enough for the step, and under twice that
            need = _columns(longest + 3, CAPACITY)
            assert longest + 3 <= need <= max(WINDOW_STEP, (longest + 3) * 9 // 8 + WINDOW_STEP) or need == CAPACITY
            assert need <= kv.width < 2 * need
        for slot in range(3):
            n = int(kv.lengths[slot])
            assert np.array_equal(kv.buffer[:, :, slot, :, :n], ref[:, :, slot, :, :n])
            assert kv.past_mask()[slot].sum() == n and kv.past_mask()[slot, :n].all()
        assert not np.isnan(kv.buffer).any()
        key = lead.feeds["past.1.key"]
        assert key.shape == (2, 2, kv.width, 4) and np.shares_memory(key, kv.buffer)
        assert lead.past_mask().shape == (2, kv.width) and np.shares_memory(lead.past_mask(), kv.past_mask())


def test_a_long_request_leaving_narrows_the_cache_and_moves_keep_entries():
    kv = HostKV(1, 2, 1, CAPACITY, 2)
    kv.write(np.ones((1, 2, 2, 1, 200, 2), np.float32), 0, 200)
    kv.commit(0, 200)
    kv.write(np.full((1, 2, 2, 1, 10, 2), 2.0, np.float32), 1, 10)
    kv.commit(1, 10)
    assert kv.width == 4 * WINDOW_STEP
    kv.commit(0, 0)  # the long one leaves
    move_kv(kv, 1, 0)
    kv.fit(1)
    assert kv.width == WINDOW_STEP and kv.lengths.tolist() == [10, 0]
    assert (kv.buffer[:, :, 0, :, :10] == 2.0).all()
