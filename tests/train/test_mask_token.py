"""The draft's mask slot: found in the tokenizer, or named with `dspark train --mask-token-id`."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from dspark.errors import DSparkError
from dspark.models.pair import mask_token, random_drafter
from support.tiny import TinyLoaded, tiny_hf, tiny_tokenizer_folder

VOCAB = 12


@pytest.fixture()
def full_vocab(tmp_path):
    """A target whose tokenizer uses every id of the vocabulary and has no special tokens."""
    return TinyLoaded(tiny_hf("qwen3", vocab=VOCAB, layers=2), tiny_tokenizer_folder(tmp_path / "tok", VOCAB))


def test_a_full_vocabulary_names_the_option_that_helps(full_vocab):
    with pytest.raises(DSparkError, match=r"uses all 12 ids.*dspark train --mask-token-id ID"):
        random_drafter(full_vocab)


def test_the_named_mask_token_is_the_drafts(full_vocab):
    assert random_drafter(full_vocab, mask_token_id=0).cfg.mask_token_id == 0  # 0 is an id, not "unset"
    assert random_drafter(full_vocab, mask_token_id=VOCAB - 1).cfg.mask_token_id == VOCAB - 1


@pytest.mark.parametrize("asked", [VOCAB, VOCAB + 100])
def test_a_mask_token_outside_the_vocabulary_is_refused(full_vocab, asked):
    with pytest.raises(DSparkError, match=rf"--mask-token-id {asked}: .* ids 0\.\.{VOCAB - 1}"):
        mask_token(full_vocab, asked)


def test_train_takes_the_option_and_refuses_a_negative_id():
    from dspark.cli import main_cli

    runner = CliRunner()
    assert "--mask-token-id" in runner.invoke(main_cli, ["train", "--help"]).output
    result = runner.invoke(main_cli, ["train", "--target", "x", "--prompts", "p", "-o", "o", "--mask-token-id", "-1"])
    assert result.exit_code == 2 and "--mask-token-id" in result.output


def test_a_training_run_starts_its_drafter_with_the_named_mask_token(full_vocab, tmp_path):
    from dspark.train.run import TrainRun

    run = TrainRun(target="tiny", prompts=tmp_path / "p.jsonl", output=tmp_path / "run", mask_token_id=3, layers=1,
                   markov_rank=4, intermediate_size=16)
    assert run._random_drafter(full_vocab).cfg.mask_token_id == 3
