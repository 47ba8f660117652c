"""Training on a tiny pair: losses fall, teacher forcing matches inference, resume is exact; STS calibration."""
import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.bundle import Manifest
from dspark.calibration.calibrate import calibrate
from dspark.calibration.sts import Rounds, auc, ece, fit_sts, reliability
from dspark.errors import DSparkError
from dspark.models.checkpoint import save_draft
from dspark.models.reference import generate_ar
from dspark.tokenizer import ChatTokenizer
from dspark.train.data import compute_taps, generate_responses, import_responses, save_shared
from dspark.train.run import TrainRun
from dspark.train.trainer import Sample, Trainer, TrainConfig, load_samples, lr_at, split_samples
from support.tiny import TinyLoaded, tiny_pair, tiny_tokenizer_folder


def make_samples(tmp_path, target, drafter, n=6, length=24, seed=0):
    """Sequences the tiny target generates itself, with taps cached the way the generator stores them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 15, (6,), generator=g).tolist() for _ in range(n)]
    outs = generate_ar(target, prompts, length)
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens = torch.tensor(p + o.token_ids)
        with torch.no_grad():
            step = target(tokens[None, :-1], torch.zeros(1, 1, dtype=torch.long), target.new_cache(1, 1))
        path = tmp_path / f"{i}.npy"
        np.save(path, step.taps[0].numpy().astype(np.float16))
        samples.append(Sample(i, tokens.numpy(), len(p), path))
    return samples


@pytest.fixture()
def setup(tmp_path):
    hf, target, drafter = tiny_pair("qwen3", vocab=16, block_size=4, layers=4, tap_ids=(0, 1, 2), draft_layers=1)
    return target, drafter, make_samples(tmp_path, target, drafter)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_losses_fall_and_acceptance_rises(setup, tmp_path, precision):
    target, drafter, samples = setup
    tr = Trainer(target, drafter, samples, tmp_path / "run", TrainConfig(steps=60, seqs_per_step=2, anchors=8,
                                                                         lr=3e-3, save_every=1000,
                                                                         precision=precision))
    before = tr.evaluate(samples)
    hist = tr.run(progress=False)
    first, last = np.mean([h["loss"] for h in hist[:5]]), np.mean([h["loss"] for h in hist[-5:]])
    assert last < 0.7 * first
    assert np.mean([h["accept_at"][0] for h in hist[-5:]]) > np.mean([h["accept_at"][0] for h in hist[:5]]) + 0.1
    assert tr.evaluate(samples)["accept_at"][0] > before["accept_at"][0] + 0.1


def test_evaluate_is_repeatable_and_leaves_the_training_draws_alone(setup, tmp_path):
    target, drafter, samples = setup
    tr = Trainer(target, drafter, samples[:4], tmp_path / "e", TrainConfig(steps=1, seqs_per_step=1, anchors=6))
    drawn = tr.rng.bit_generator.state
    first, again = tr.evaluate(samples[4:]), tr.evaluate(samples[4:])
    assert first == again and first["sequences"] == 2 and len(first["accept_at"]) == drafter.cfg.block_size
    assert tr.rng.bit_generator.state == drawn
    assert tr.evaluate(samples[4:], seed=1) != first  # other anchors


def test_bf16_runs_the_drafter_in_bf16_and_keeps_fp32_weights(setup, tmp_path):
    target, drafter, samples = setup
    losses = {}
    for precision in ("fp32", "bf16"):
        tr = Trainer(target, copy.deepcopy(drafter), samples, tmp_path / precision,
                     TrainConfig(steps=1, seqs_per_step=1, anchors=6, seed=3, precision=precision))
        seen = []
        tr.drafter.layers[0].mlp.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        losses[precision] = tr.sequence_loss(samples[0])[0].item()
        assert seen == [torch.bfloat16 if precision == "bf16" else torch.float32]
        tr.train_step()
        assert {p.dtype for p in tr.drafter.parameters()} == {torch.float32}
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.03)
    with pytest.raises(DSparkError, match="precision"):
        Trainer(target, drafter, samples, tmp_path / "x", TrainConfig(precision="fp16"))


def test_resume_is_exact(setup, tmp_path):
    target, drafter, samples = setup
    cfg = TrainConfig(steps=4, seqs_per_step=1, anchors=4, save_every=2)
    a = copy.deepcopy(drafter)
    Trainer(target, a, samples, tmp_path / "straight", cfg).run(progress=False)
    b = copy.deepcopy(drafter)
    tr = Trainer(target, b, samples, tmp_path / "killed", cfg)
    tr.cfg = TrainConfig(**{**cfg.__dict__})
    for _ in range(2):
        tr.train_step()
    tr.save_state()
    c = copy.deepcopy(drafter)
    resumed = Trainer(target, c, samples, tmp_path / "killed", cfg)
    assert resumed.load_state() and resumed.step == 2
    resumed.run(progress=False)
    for (k, v), (_, w) in zip(a.trainable_state_dict().items(), c.trainable_state_dict().items()):
        torch.testing.assert_close(v, w, msg=k)


def test_resume_refuses_other_settings(setup, tmp_path):
    target, drafter, samples = setup
    tr = Trainer(target, drafter, samples, tmp_path / "r", TrainConfig(steps=2, seqs_per_step=1, anchors=4))
    tr.train_step()
    tr.save_state()
    other = Trainer(target, drafter, samples, tmp_path / "r", TrainConfig(steps=2, seqs_per_step=1, anchors=8))
    with pytest.raises(DSparkError, match="other settings"):
        other.load_state()


def test_balanced_domains_are_drawn_uniformly_and_resume_exactly(setup, tmp_path):
    """Five of six sequences are math: drawn plainly, code comes ~1/6 of the time; balanced, ~1/2, each domain
    walked in epochs (every pass over a pool sees each of its sequences once), and a resumed trainer continues
    the same draws."""
    target, drafter, samples = setup
    samples = [dataclasses.replace(s, domain="code" if s.index == 0 else "math") for s in samples]

    def draws(cfg, out, n):
        tr = Trainer(target, drafter, samples, tmp_path / out, cfg)
        return tr, [tr.next_sample().index for _ in range(n)]

    _, plain = draws(TrainConfig(seed=1), "plain", 600)
    assert 0.1 < plain.count(0) / 600 < 0.25
    tr, got = draws(TrainConfig(seed=1, balance_domains=True), "bal", 600)
    assert 0.42 < got.count(0) / 600 < 0.58
    math = [i for i in got if i != 0]
    for k in range(0, len(math) - 5, 5):
        assert sorted(math[k:k + 5]) == [1, 2, 3, 4, 5]
    tr.save_state()
    more = [tr.next_sample().index for _ in range(50)]
    again = Trainer(target, drafter, samples, tmp_path / "bal", TrainConfig(seed=1, balance_domains=True))
    assert again.load_state()
    assert [again.next_sample().index for _ in range(50)] == more


def test_draft_vocabulary_training_loss(setup, tmp_path):
    """Over the whole vocabulary (as a list) it is the full loss; over a shortlist only those logit rows and
    Markov-bias rows learn, labels outside carry no CE, and the target keeps its full normalizer."""
    target, drafter, samples = setup
    v = drafter.cfg.vocab_size
    cfg = TrainConfig(steps=2, seqs_per_step=1, anchors=6, seed=3)
    full = Trainer(target, copy.deepcopy(drafter), samples, tmp_path / "a", cfg)
    listed = Trainer(target, copy.deepcopy(drafter), samples, tmp_path / "b", TrainConfig(**{**cfg.__dict__,
                                                                                           "draft_vocab": v}),
                     np.arange(v))
    want, want_st = full.sequence_loss(samples[0])
    got, got_st = listed.sequence_loss(samples[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_st["accept_at"], want_st["accept_at"], rtol=1e-5, atol=1e-6)

    ids = np.array(sorted({int(t) for s in samples for t in s.tokens[s.prompt_len:]})[: v // 2])
    short = Trainer(target, copy.deepcopy(drafter), samples, tmp_path / "c",
                    TrainConfig(**{**cfg.__dict__, "draft_vocab": len(ids)}), ids)
    loss, st = short.sequence_loss(samples[0])
    assert torch.isfinite(loss) and all(0 <= a <= 1 for a in st["accept_at"] if a == a)
    loss.backward()
    grad = short.drafter.markov_head.markov_w2.weight.grad
    outside = np.setdiff1d(np.arange(v), ids)
    assert grad[ids].abs().sum() > 0 and grad[outside].abs().sum() == 0
    assert samples[0].index in short._lse  # the normalizer is kept for the next visit
    again, _ = short.sequence_loss(samples[0])
    assert torch.isfinite(again)
    saved = list(Path(samples[0].taps_path).parent.glob("*.lse-*.npy"))
    assert len(saved) == 1  # ... and on disk, where a later run finds it: same loss, no full-vocabulary logits
    later = Trainer(target, copy.deepcopy(drafter), samples, tmp_path / "e",
                    TrainConfig(**{**cfg.__dict__, "draft_vocab": len(ids)}), ids)
    target.logits = None  # would raise if called
    try:
        torch.testing.assert_close(later.sequence_loss(samples[0])[0], loss)
    finally:
        del target.logits
    np.save(saved[0], np.zeros_like(np.load(saved[0])))  # and it really is what the later run reads
    assert not torch.allclose(Trainer(target, copy.deepcopy(drafter), samples, tmp_path / "f", TrainConfig(
        **{**cfg.__dict__, "draft_vocab": len(ids)}), ids).sequence_loss(samples[0])[0], loss)
    saved[0].unlink()
    with pytest.raises(DSparkError, match="draft_vocab"):
        Trainer(target, drafter, samples, tmp_path / "d", TrainConfig(draft_vocab=3))


def test_cache_files_survive_a_concurrent_writer(tmp_path, monkeypatch):
    """Two runs on one data cache (DSpark and its DFlash ablation) may write the same normalizer file at the same
    moment: the second writer's save and rename land between the first one's save and rename."""
    path = tmp_path / "7.lse-ab.npy"
    real_save, nested = np.save, []

    def save_with_a_rival(f, arr):
        real_save(f, arr)
        if not nested:
            nested.append(1)
            save_shared(path, arr + 1)  # the other run, same file

    monkeypatch.setattr(np, "save", save_with_a_rival)  # the np.save save_shared calls
    save_shared(path, np.arange(3.0))
    assert np.load(path).tolist() == [0.0, 1.0, 2.0]  # whichever rename lands last; nothing left behind
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_warmup_cosine_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.5, abs=0.02) and lr_at(99, cfg) < 0.01


def test_split_is_stable_as_data_grows():
    mk = lambda n: [Sample(i, np.zeros(3, dtype=np.int64), 1, None) for i in range(n)]  # noqa: E731
    _, held_small = split_samples(mk(200), 0.1)
    _, held_big = split_samples(mk(400), 0.1)
    assert {s.index for s in held_small} <= {s.index for s in held_big}
    assert 5 < len(held_small) < 40
    # data arrives in domain order: a sample's fate must not depend on which other indices are present
    every_third = [s for s in mk(400) if s.index % 3 == 0]
    _, held_sparse = split_samples(every_third, 0.1)
    assert {s.index for s in held_sparse} == {s.index for s in held_big if s.index % 3 == 0}


def test_metrics_against_known_values():
    pred = np.array([0.1, 0.4, 0.35, 0.8])
    label = np.array([0.0, 0.0, 1.0, 1.0])
    assert auc(pred, label) == pytest.approx(0.75)
    assert ece(np.array([0.2, 0.2, 0.8, 0.8]), np.array([0.0, 1.0, 1.0, 1.0])) == pytest.approx(0.25)


def test_sts_fixes_an_overconfident_head():
    rng = np.random.default_rng(0)
    n, bk = 6000, 5
    z = rng.normal(1.5, 2.0, (n, bk))
    accepted_each = rng.random((n, bk)) < 1 / (1 + np.exp(-z / 2.5))  # the truth is sigmoid(z / 2.5)
    rounds = Rounds(z, np.full(n, bk), np.cumprod(accepted_each, axis=1).sum(axis=1))
    temps = fit_sts(rounds)
    assert np.all(np.abs(temps - 2.5) < 0.8)
    before = [r["ece"] for r in reliability(rounds, np.ones(bk))]
    after = [r["ece"] for r in reliability(rounds, temps)]
    assert max(after) < 0.03 < min(before)
    # temperature scaling is monotone: the ranking, hence AUC, is unchanged at position 1
    assert reliability(rounds, temps)[0]["auc"] == pytest.approx(reliability(rounds, np.ones(bk))[0]["auc"])


def test_calibrate_writes_manifest_plot_and_report(tiny_bundle_v6, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle_v6[3], bundle)
    prompts = [" ".join(f"w{(i * 7 + j) % 5}" for j in range(4)) for i in range(40)]
    rep = calibrate(bundle, prompts, tmp_path / "cal", max_tokens=24, temperature=1.0)
    man = Manifest.read(bundle)
    assert man.calibration["sts_temperatures"] == rep["sts_temperatures"]
    assert len(rep["after"]) == man.block_size and rep["rounds"] > 50
    assert (tmp_path / "cal" / "reliability.png").stat().st_size > 1000
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["rounds"] == rep["rounds"]


def test_init_from_continues_from_a_trained_drafter(tmp_path):
    """--init-from: the drafter starts from the checkpoint's weights and architecture, without its STS temperatures."""
    hf, target, drafter = tiny_pair("llama", vocab=16, block_size=3, markov_rank=4, draft_layers=2)
    drafter.cfg = dataclasses.replace(drafter.cfg, confidence_temperatures=(1.5, 2.0, 3.0))
    ckpt = save_draft(drafter, tmp_path / "ckpt")
    loaded = TinyLoaded(hf, tiny_tokenizer_folder(tmp_path / "tok", 16))
    run = TrainRun(target="tiny", prompts=tmp_path / "p.jsonl", output=tmp_path / "run", layers=1, block_size=7,
                   markov_rank=0, init_from=str(ckpt))
    warm = run._warm_start(loaded)
    assert (warm.cfg.num_layers, warm.cfg.block_size, warm.cfg.markov_rank) == (2, 3, 4)
    assert warm.cfg.confidence_temperatures == () and torch.all(warm.sts_temperatures == 1.0)
    mine, theirs = warm.trainable_state_dict(), drafter.trainable_state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k].to(torch.bfloat16).to(mine[k].dtype))  # stored as bf16
    # a continued run draws other anchors than its starting point did, deterministically; an explicit seed wins
    seed = run._anchor_seed(warm)
    assert seed != 42 and seed == run._anchor_seed(run._warm_start(loaded))
    other = tiny_pair("llama", vocab=16, block_size=3, markov_rank=4, draft_layers=2, seed=5)[2]
    assert run._anchor_seed(other) != seed
    assert dataclasses.replace(run, seed=7)._anchor_seed(warm) == 7
    assert dataclasses.replace(run, init_from=None)._anchor_seed(warm) == 42


def test_imported_responses_get_the_taps_generation_records(tiny_bundle_v6, tmp_path):
    """Responses made elsewhere (a GPU box, taps=False) are merged into a cache and their taps computed here in
    prefill: the same features autoregressive generation records, for the first --max-prompts only."""
    bundle = tiny_bundle_v6[3]
    rows = [{"prompt": " ".join(f"w{(i * 3 + j) % 5}" for j in range(3 + i % 4)), "domain": "ab"[i % 2]}
            for i in range(6)]
    made, here = tmp_path / "gpu" / "responses.jsonl", tmp_path / "here" / "responses.jsonl"
    generate_responses(bundle, rows, made, max_tokens=12, batch_size=3)
    encode = ChatTokenizer(bundle).encode_chat
    assert import_responses(made, here, rows, encode) == 6
    assert import_responses(made, here, rows, encode) == 0  # already there
    tap_ids = tuple(json.loads(made.read_text().splitlines()[0])["tap_ids"])
    taps = load_samples(made.parent, tap_ids)
    assert len(taps) > 3 and load_samples(here.parent, tap_ids) == []  # no taps yet: nothing to train on
    assert compute_taps(bundle, here, rows, limit=4, batch_size=2, chunk=3) == 4
    assert compute_taps(bundle, here, rows, limit=4) == 0
    got = {s.index: s for s in load_samples(here.parent, tap_ids)}
    assert sorted(got) == [0, 1, 2, 3]  # interleaved order a, b, a, b: the first four prompts
    for s in taps:
        if s.index in got:
            want, have = np.load(s.taps_path).astype(np.float32), np.load(got[s.index].taps_path).astype(np.float32)
            assert want.shape == have.shape == (len(s.tokens) - 1, want.shape[1])
            np.testing.assert_allclose(have, want, rtol=1e-2, atol=1e-2)
    # a file from other prompts, or not a responses file at all, is refused with one line
    lines = made.read_text().splitlines()
    moved = [json.dumps({**json.loads(line), "index": (json.loads(line)["index"] + 1) % 6}) for line in lines]
    (tmp_path / "other.jsonl").write_text("\n".join(moved) + "\n")
    with pytest.raises(DSparkError, match="does not answer prompt"):
        import_responses(tmp_path / "other.jsonl", tmp_path / "x" / "responses.jsonl", rows, encode)
    (tmp_path / "foreign.jsonl").write_text('{"id": 3, "text": "hello"}\n')
    with pytest.raises(DSparkError, match="not a dspark responses file"):
        import_responses(tmp_path / "foreign.jsonl", tmp_path / "x" / "responses.jsonl", rows, encode)
