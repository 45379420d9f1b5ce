"""Post-training config rules: each mistake is refused with a message naming the key (no silent LM training)."""

from __future__ import annotations

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.post_training.config import PostTrainingConfig
from tests.unit.test_config_keys_consumed import CPU1
from tests.unit.test_config_keys_consumed import TINY as KEY_TEST_TINY

TINY = {**KEY_TEST_TINY, "pack_impl": "unpacked"}
LM = {f"{s}_data_paths": ["d"] for s in ("train", "valid", "test")}
PAIRS = {"dataset_impl": "pairwise", "pos_train_data_paths": ["c"], "neg_train_data_paths": ["r"]}


def problems(**kw: object) -> str:
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, **kw}, env=CPU1)
    return "\n".join(e.value.problems)


def test_kto_without_reward_data_names_the_missing_key() -> None:
    assert "train_impl: kto needs train_reward_data_paths" in problems(train_impl="kto", **LM)


def test_kto_needs_two_examples_per_micro_batch() -> None:
    reward = {f"{s}_reward_data_paths": ["w"] for s in ("train", "valid", "test")}
    msg = problems(train_impl="kto", train_micro_batch_size_per_gpu=1, **LM, **reward)
    assert "train_micro_batch_size_per_gpu >= 2" in msg


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"train_impl": "dpo", **LM}, "train_impl: dpo needs dataset_impl: pairwise"),
        ({"train_impl": "rm", **PAIRS, "pack_impl": "packed"}, "set pack_impl: unpacked"),
        ({"train_impl": "dpo", "dataset_impl": "pairwise"}, "needs pos_train_data_paths and neg_train_data_paths"),
        ({**PAIRS}, "dataset_impl: pairwise is read by train_impl dpo or rm, not 'normal'"),
        ({"train_impl": "dpo", **PAIRS, "neg_train_data_paths": ["a", "b"]}, "need the same number of entries"),
        ({"train_impl": "dpo", **PAIRS, "pipe_parallel_size": 1}, "does not run on the pipeline engine"),
        ({"train_reward_data_paths": ["w"], **LM}, "read by train_impl: kto only"),
    ],
)
def test_post_training_mistakes_are_refused(kw: dict, message: str) -> None:
    assert message in problems(**kw)


def test_valid_dpo_config_reads_every_post_training_key() -> None:
    args = NeoXArgs({**TINY, "train_impl": "dpo", **PAIRS, "dpo_beta": 0.5, "dpo_reference_free": True}, env=CPU1)
    cfg = PostTrainingConfig.from_neox_args(args)
    assert (cfg.train_impl, cfg.dpo_beta, cfg.dpo_reference_free, cfg.pairwise) == ("dpo", 0.5, True, True)
    assert cfg.paths("train", "pos") == ["c"] and cfg.paths("train", "neg_label") is None


def test_eod_mask_loss_reaches_the_post_training_objectives() -> None:
    """``eod_mask_loss`` is read for dpo/kto/rm too (GPT-NeoX applies it in their batch function)."""
    args = NeoXArgs({**TINY, **PAIRS, "train_impl": "dpo", "eod_mask_loss": True}, env=CPU1)
    assert PostTrainingConfig.from_neox_args(args).eod_mask_loss is True
