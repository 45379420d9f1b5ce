"""The ``curriculum_learning`` block: GPT-NeoX's shape is accepted for each of DeepSpeed's fixed schedules (and
DeepSpeed's own ``CurriculumScheduler`` takes every accepted block), a mistake is one ConfigError naming the sub-key
and what is valid; the block stays out of the DeepSpeed config (the step drives the scheduler); and the logged
throughput of an interval whose steps had different lengths is their mean."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

from megatron.logging.flops import FlopsConfig, flops_per_iteration, throughput_metrics
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.training.curriculum import CurriculumConfig, SeqlenCurriculum, build_curriculum
from tests.unit.test_neox_args import CPU1, TINY

SEQ = TINY["seq_length"]
LINEAR = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": SEQ,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
}
ROOT = {**LINEAR, "schedule_type": "fixed_root", "schedule_config": {**LINEAR["schedule_config"], "root_degree": 2}}
DISCRETE = {**LINEAR, "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, SEQ], "max_step": [3]}}


@pytest.mark.parametrize(
    "block", [LINEAR, ROOT, DISCRETE, {"enabled": False}], ids=["linear", "root", "discrete", "off"]
)
def test_gpt_neox_blocks_are_accepted(block: dict[str, Any]) -> None:
    args = NeoXArgs({**TINY, "curriculum_learning": block}, env=CPU1)
    assert "curriculum_learning" not in args.deepspeed_config  # DeepSpeed's engine would pass curriculum_seqlen
    curriculum = build_curriculum(CurriculumConfig.from_neox_args(args), 0)
    if not block["enabled"]:
        assert curriculum is None
        return
    assert curriculum is not None
    reference = CurriculumScheduler(block)
    got = [curriculum.advance() for _ in range(15)]
    assert got == [reference.update_difficulty(i) for i in range(1, 16)]
    assert len(set(got)) >= 2 and got[-1] == SEQ and min(got) >= 8


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("seqlen", "curriculum_learning='seqlen' in the configuration: expected dict or null"),
        ({**LINEAR, "enabled": "yes"}, "curriculum_learning.enabled='yes' must be true or false"),
        ({**LINEAR, "curriculum_type": "vocab"}, "curriculum_learning.curriculum_type='vocab': only 'seqlen'"),
        ({**LINEAR, "schedule_type": "custom"}, "curriculum_learning.schedule_type='custom' must be one of fixed_"),
        ({**LINEAR, "min_difficulty": 0}, "curriculum_learning.min_difficulty=0 must be a sequence length >= 1"),
        ({**LINEAR, "max_difficulty": SEQ * 2}, f"curriculum_learning.max_difficulty={SEQ * 2} must be <= seq_length"),
        ({**LINEAR, "min_difficulty": 24, "max_difficulty": 16}, "min_difficulty=24 must be <= max_difficulty=16"),
        ({**LINEAR, "max_seqlen": 8}, "curriculum_learning.max_seqlen is not a setting (valid: enabled,"),
        (
            {**LINEAR, "schedule_config": {"total_curriculum_step": 10}},
            "curriculum_learning.schedule_config.difficulty_step is required for schedule_type fixed_linear",
        ),
        (
            {**LINEAR, "schedule_config": {**LINEAR["schedule_config"], "root_degree": 2}},
            "schedule_config.root_degree is not a setting of schedule_type fixed_linear (valid: total_curriculum_step",
        ),
        (
            {**ROOT, "schedule_config": {**ROOT["schedule_config"], "root_degree": 0}},
            "root_degree=0 must be an integer",
        ),
        (
            {**DISCRETE, "schedule_config": {"difficulty": [8, 16], "max_step": [2, 4]}},
            "schedule_config.max_step=[2, 4] must be a list of 1 steps >= 1 (one less than difficulty)",
        ),
        (
            {**DISCRETE, "schedule_config": {"difficulty": [8, SEQ * 2], "max_step": [2]}},
            f"must not exceed seq_length={SEQ}",
        ),
    ],
)
def test_mistakes_name_the_sub_key(block: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="curriculum_learning") as err:
        NeoXArgs({**TINY, "curriculum_learning": block}, env=CPU1)
    assert message in str(err.value)


def test_the_message_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "curriculum.yml"
    config.write_text(yaml.safe_dump({**TINY, "curriculum_learning": {**LINEAR, "schedule_type": "linear"}}))
    with pytest.raises(ConfigError) as err:
        NeoXArgs.from_ymls([str(config)])
    assert "curriculum_learning.schedule_type='linear' must be one of fixed_linear, fixed_root, fixed_discrete" in str(
        err.value
    )
    assert f"(set in {config.name})" in str(err.value) or f"(set in {config})" in str(err.value)


def test_post_training_objectives_refuse_it() -> None:
    with pytest.raises(ConfigError, match=r"not supported yet: curriculum_learning with train_impl='dpo'"):
        NeoXArgs({**TINY, "curriculum_learning": LINEAR, "train_impl": "dpo", "pack_impl": "unpacked"}, env=CPU1)


def test_deepspeed_extra_args_cannot_carry_it() -> None:
    with pytest.raises(
        ConfigError,
        match=r"deepspeed_extra_args.curriculum_learning: set curriculum_learning at the top level",
    ):
        NeoXArgs({**TINY, "deepspeed_extra_args": {"curriculum_learning": LINEAR}}, env=CPU1)


def test_resume_continues_where_the_run_stopped() -> None:
    """Built at a loaded iteration, the next lengths are the uninterrupted run's (non-monotone discrete too)."""
    for block in (LINEAR, ROOT, {**DISCRETE, "schedule_config": {"difficulty": [16, 8, SEQ], "max_step": [2, 5]}}):
        whole = SeqlenCurriculum(block)
        lengths = [whole.advance() for _ in range(12)]
        for stop in range(1, 12):
            resumed = SeqlenCurriculum(block, start_iteration=stop)
            assert resumed.seqlen == lengths[stop - 1]
            assert [resumed.advance() for _ in range(12 - stop)] == lengths[stop:], (block["schedule_type"], stop)


def test_interval_throughput_is_the_mean_over_its_steps() -> None:
    cfg = FlopsConfig(train_batch_size=8, seq_length=64, num_layers=2, hidden_size=64, padded_vocab_size=128)
    out = throughput_metrics(cfg, iteration_time=0.5, world_size=2, seq_lengths=[16, 48])
    assert out["runtime/tokens_per_sec"] == 8 / 0.5 * 32
    mean = (flops_per_iteration(replace(cfg, seq_length=16)) + flops_per_iteration(replace(cfg, seq_length=48))) / 2
    assert out["runtime/flops_per_sec_per_gpu"] == pytest.approx(mean / (0.5 * 2))
    full = throughput_metrics(cfg, iteration_time=0.5, world_size=2)
    assert full["runtime/tokens_per_sec"] == 8 / 0.5 * 64 and full["runtime/flops_per_sec_per_gpu"] > mean
