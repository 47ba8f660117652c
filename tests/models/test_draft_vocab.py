"""Draft vocabulary shortlists: ranking files, shortlist choice, and a shortlisted bundle that stays exact
(greedy) and lossless (temperature 1) although the draft can never propose some tokens."""
import json

import numpy as np
import pytest
import torch

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle
from dspark.export.trace.onnx_export import export_bundle
from dspark.models.draft_vocab import FILE, rank_tokens, read_ranking, shortlist, write_ranking
from dspark.models.pair import Pair
from dspark.runtime import DecodeOptions, Runtime
from support.stats import chi_square_pvalue, exact_joint
from support.tiny import TinyLoaded, tiny_pair, tiny_tokenizer_folder

V = 6
KEEP = [2, 4]  # ranking handed to the export; the stop token (if any) is added, the rest is left out


def test_shortlist_keeps_stop_tokens_then_rank_then_ids():
    assert shortlist([7, 3, 9], 5, 10, keep=[9, 8]).tolist() == [0, 3, 7, 8, 9]
    assert shortlist([], 3, 10).tolist() == [0, 1, 2]
    assert shortlist([5, 5, 1], 2, 10).tolist() == [1, 5]
    for size, keep in ((0, []), (11, []), (2, [1, 2])):
        with pytest.raises(DSparkError):
            shortlist([1], size, 10, keep)


def test_ranking_round_trip_and_foreign_files(tmp_path):
    write_ranking(tmp_path, *rank_tokens([[5, 5, 3], [3, 5, 99, 1]], 10), vocab_size=10, source="test")
    assert read_ranking(tmp_path, 10) == [5, 3, 1]  # by count, ties by id; out-of-vocabulary ids dropped
    with pytest.raises(DSparkError, match="vocabulary"):
        read_ranking(tmp_path, 12)
    (tmp_path / FILE).write_text(json.dumps({"ranked_ids": "x"}))
    with pytest.raises(DSparkError, match="not a dspark draft-vocabulary"):
        read_ranking(tmp_path, 10)
    with pytest.raises(DSparkError, match="no draft_vocab.json"):
        read_ranking(tmp_path / "missing", 10)


@pytest.fixture(scope="module")
def shortlisted(tmp_path_factory):
    hf, target, drafter = tiny_pair("llama", vocab=V, layers=2, block_size=3, seed=11)
    root = tmp_path_factory.mktemp("shortlist")
    loaded = TinyLoaded(hf, tiny_tokenizer_folder(root / "tok", V))
    path = export_bundle(Pair(loaded, target, drafter, "random"), root / "bundle", max_context=256, quiet=True,
                         draft_vocab=3, ranking=KEEP)
    return hf, target, drafter, path


def test_shortlisted_drafter_only_proposes_its_tokens(shortlisted):
    hf, target, drafter, path = shortlisted
    ids = drafter.draft_ids.tolist()
    assert len(ids) == 3 and set(KEEP) <= set(ids)
    g = torch.Generator().manual_seed(0)
    block = drafter.sample_block(torch.randn(64, 3, drafter.cfg.hidden_size, generator=g),
                                 torch.randint(0, V, (64,), generator=g), torch.ones(64), torch.rand(64, 3, generator=g))
    assert set(block.tokens.unique().tolist()) <= set(ids)
    outside = [t for t in range(V) if t not in ids]
    assert torch.all(block.probs[..., outside] == 0)
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(64, 3))


def test_shortlisted_bundle_passes_check_and_matches_ar(shortlisted):
    hf, target, drafter, path = shortlisted
    assert Manifest.read(path).draft["draft_vocab"] == 3
    rep = check_bundle(path, trt_lint=True)
    assert rep.passed, [r for r in rep.rows if not r.passed]
    rt = Runtime(path)
    ps = [[1, 4, 2, 0], [3, 3, 5], [0, 1]]
    ds = rt.generate(ps, DecodeOptions(max_tokens=24))
    ar = rt.generate(ps, DecodeOptions(max_tokens=24, policy="ar"))
    assert [r.token_ids for r in ds] == [r.token_ids for r in ar]


def test_shortlisted_bundle_sampling_is_lossless(shortlisted):
    """The draft never proposes half the vocabulary; the verifier's residual must still produce it exactly."""
    hf, target, drafter, path = shortlisted
    prompt = [1, 4, 2, 0]
    rt = Runtime(path)
    res = rt.generate([prompt] * 24000, DecodeOptions(max_tokens=3, temperature=1.0, seed=5, batch_size=4000))
    stop = set(rt.manifest.stop_token_ids)
    samples = [tuple(r.token_ids) for r in res if len(r.token_ids) == 3]
    expected = {k: p for k, p in exact_joint(hf, prompt, 3, V).items() if not stop.intersection(k[:2])}
    assert chi_square_pvalue(samples, expected) > 1e-3
    outside = [t for t in range(V) if t not in drafter.draft_ids.tolist()]
    assert sum(s[0] in outside for s in samples) > 0.05 * len(samples)  # tokens the draft cannot propose do occur
    assert np.mean([a for r in res for a in r.accepted]) > 0.05
