"""Drafter backbone: the incremental (cached, cropped) forward equals a full recomputation."""
import pytest
import torch

from support.tiny import tiny_pair


def _mask(lengths, capacity):
    return (torch.arange(capacity)[None] < torch.tensor(lengths)[:, None]).long()


@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_incremental_equals_full_recomputation(markov):
    _, target, drafter = tiny_pair("qwen3", vocab=16, block_size=4, markov_head_type=markov, draft_layers=2)
    torch.manual_seed(0)
    m_d = drafter.cfg.num_taps * drafter.cfg.hidden_size
    # Two requests whose rounds accept different numbers of drafts (a + 1 new context rows per round).
    schedules = [[6, 3, 1, 5, 2], [4, 1, 4, 1, 8]]
    total = [sum(s) for s in schedules]
    feats = torch.randn(2, max(total), m_d)
    anchors = torch.randint(0, 15, (2, len(schedules[0])))
    cache = drafter.new_cache(2, 64)
    cache_len = [0, 0]
    with torch.no_grad():
        for r in range(len(schedules[0])):
            counts = [s[r] for s in schedules]
            c = max(counts)
            new = torch.zeros(2, c, m_d)
            for b in range(2):
                new[b, :counts[b]] = feats[b, cache_len[b]:cache_len[b] + counts[b]]
            mask = _mask(cache_len, 64)
            hidden, new_kv = drafter.backbone(new, torch.tensor(counts), anchors[:, r], mask, cache)
            for b in range(2):
                cache[:, :, b, :, cache_len[b]:cache_len[b] + counts[b]] = new_kv[:, :, b, :, :counts[b]]
                cache_len[b] += counts[b]
                # Full recomputation: every context row from position 0, empty cache.
                full, _ = drafter.backbone(feats[b:b + 1, :cache_len[b]], torch.tensor([cache_len[b]]),
                                           anchors[b:b + 1, r], torch.zeros(1, 1, dtype=torch.long),
                                           drafter.new_cache(1, 1))
                torch.testing.assert_close(hidden[b:b + 1], full, rtol=1e-5, atol=1e-5)


def test_block_attention_sees_only_strictly_earlier_context():
    """Changing a context row at or after the anchor's position must not matter; an earlier one must."""
    _, _, drafter = tiny_pair("llama", vocab=16, block_size=4)
    m_d = drafter.cfg.num_taps * drafter.cfg.hidden_size
    feats = torch.randn(1, 6, m_d)
    empty = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        base, _ = drafter.backbone(feats, torch.tensor([5]), torch.tensor([3]), empty, drafter.new_cache(1, 1))
        changed = feats.clone()
        changed[0, 5] += 1.0  # padding row beyond ctx_count: invisible
        same, _ = drafter.backbone(changed, torch.tensor([5]), torch.tensor([3]), empty, drafter.new_cache(1, 1))
        changed[0, 0] += 1.0
        diff, _ = drafter.backbone(changed, torch.tensor([5]), torch.tensor([3]), empty, drafter.new_cache(1, 1))
    torch.testing.assert_close(base, same)
    assert not torch.allclose(base, diff)


def test_markov_teacher_forcing_matches_sampling_loop():
    """With the sampled tokens as teacher-forced previous tokens, training-time heads give the same logits."""
    for kind in ("vanilla", "gated", "rnn"):
        _, _, drafter = tiny_pair("qwen3", vocab=16, block_size=5, markov_head_type=kind)
        hidden = torch.randn(3, 5, drafter.cfg.hidden_size)
        anchor = torch.tensor([1, 2, 3])
        with torch.no_grad():
            block = drafter.sample_block(hidden, anchor, torch.ones(3), torch.rand(3, 5).clamp(min=1e-6))
            prev = torch.cat([anchor[:, None], block.tokens[:, :-1]], dim=1)
            logits, conf = drafter.teacher_forced_heads(hidden, prev)
        torch.testing.assert_close(torch.softmax(logits, -1), block.probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(conf, block.conf_logits)
