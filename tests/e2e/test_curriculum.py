"""Sequence-length curriculum learning (``curriculum_learning``): every training step's batches have the length
DeepSpeed's own ``CurriculumScheduler`` gives for that step, in one run and across a resume, on the sequential
and the pipeline engine; the logged tokens/s and FLOPs follow that length."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

from tests.distributed.fns_curriculum import curriculum_run, curriculum_runs
from tests.distributed.fns_train import make_tiny_data, tensorboard_scalars, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

ITERS = 6
ROOT = {  # 16, 16, 24, 24, 24, 32 over six steps
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": 32,
    "schedule_type": "fixed_root",
    "schedule_config": {"total_curriculum_step": ITERS, "difficulty_step": 8, "root_degree": 2},
}
DISCRETE = {  # 8, 8, 16, 16, 32, 32
    "enabled": True,
    "min_difficulty": 8,
    "max_difficulty": 32,
    "schedule_type": "fixed_discrete",
    "schedule_config": {"difficulty": [8, 16, 32], "max_step": [2, 4]},
}


def deepspeed_schedule(block: dict[str, Any], iterations: int) -> list[int]:
    """DeepSpeed's scheduler asked as its engine asks it: ``update_difficulty(i)`` before training step ``i``."""
    scheduler = CurriculumScheduler(block)
    return [scheduler.update_difficulty(i) for i in range(1, iterations + 1)]


def seen_lengths(run: dict[str, Any]) -> list[int]:
    """The one length each step's forwards saw, after checking tokens, position ids and mask agree."""
    lengths = []
    for step in run["steps"]:
        assert len(step["seen"]) == 1, step  # every micro-batch of the step the same length
        tokens, positions, rows, cols = step["seen"][0]
        assert tokens == positions == rows == cols, step
        assert step["reported"] == tokens, step
        lengths.append(tokens)
    return lengths


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


def test_steps_follow_deepspeed_schedule_and_resume(data: dict[str, str], tmp_path: Path) -> None:
    base = {"eval_interval": 100, "eval_iters": 0, "log_interval": 1, "curriculum_learning": ROOT}
    ckpt = str(tmp_path / "ckpt")
    tb = str(tmp_path / "tb")
    configs = [
        tiny_config(data, train_iters=ITERS, tensorboard_dir=tb, **base),  # uninterrupted
        tiny_config(data, train_iters=ITERS, exit_interval=3, save=ckpt, checkpoint_factor=3, **base),  # stops at 3
        tiny_config(data, train_iters=ITERS, load=ckpt, **base),  # resumed
        tiny_config(data, train_iters=4, **{**base, "curriculum_learning": DISCRETE}),
    ]
    whole, first, resumed, discrete = run_distributed(curriculum_runs, 1, configs, timeout=600)[0]
    expected = deepspeed_schedule(ROOT, ITERS)
    assert expected == [16, 16, 24, 24, 24, 32]  # the schedule changes length within the run
    assert seen_lengths(whole) == expected
    assert [s["iteration"] for s in whole["steps"]] == list(range(1, ITERS + 1))
    assert seen_lengths(first) == expected[:3]
    assert resumed["start"] == 3 and [s["iteration"] for s in resumed["steps"]] == [4, 5, 6]
    assert seen_lengths(resumed) == expected[3:]  # the schedule continues where the stopped run left it
    assert resumed["losses"] == pytest.approx(whole["losses"][3:], rel=1e-5)
    assert seen_lengths(discrete) == deepspeed_schedule(DISCRETE, 4) == [8, 8, 16, 16]

    # the logged metrics of the uninterrupted run: its length each step, and tokens/s and FLOPs at that length
    from megatron.logging.flops import FlopsConfig, flops_per_iteration

    scalars = tensorboard_scalars(tb)
    assert [v for _, v in scalars["train/curriculum_seqlen"]] == expected
    cfg = FlopsConfig(
        train_batch_size=4, seq_length=32, num_layers=2, hidden_size=64, padded_vocab_size=vocab_rows(data)
    )
    for i, length in enumerate(expected):
        time = scalars["runtime/iteration_time"][i][1]
        samples = scalars["runtime/samples_per_sec"][i][1]
        assert scalars["runtime/tokens_per_sec"][i][1] == pytest.approx(samples * length, rel=1e-5)
        flops = flops_per_iteration(replace(cfg, seq_length=length), 3) / time
        assert scalars["runtime/flops_per_sec_per_gpu"][i][1] == pytest.approx(flops, rel=1e-5)


def vocab_rows(data: dict[str, str]) -> int:
    """The tiny tokenizer's vocabulary padded as the run pads it."""
    from tokenizers import Tokenizer

    from megatron.tokenizer import padded_vocab_size

    return padded_vocab_size(Tokenizer.from_file(data["vocab_file"]).get_vocab_size(), 64, 1)


def test_pipeline_stages_follow_the_schedule(data: dict[str, str]) -> None:
    """Two pipeline stages: the first stage's batches are cut each step, DeepSpeed's activation buffers are sized
    again when the length changes (the stages exchange activations of the new length), and the losses equal the
    sequential engine's on the same steps."""
    base = {"eval_interval": 2, "eval_iters": 1, "log_interval": 1, "curriculum_learning": DISCRETE, "train_iters": 5}
    pipe = tiny_config(data, world=2, pipe_parallel_size=2, **base)
    per_rank = run_distributed(curriculum_run, 2, pipe, timeout=600)
    expected = deepspeed_schedule(DISCRETE, 5)
    assert expected == [8, 8, 16, 16, 32]
    assert seen_lengths(per_rank[0]) == expected  # stage 0
    assert per_rank[0]["evaluated"] == [(32, 32, 32, 32)]  # evaluation in between and after: the full length
    assert [s["reported"] for s in per_rank[1]["steps"]] == expected
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
    sequential = run_distributed(curriculum_run, 1, tiny_config(data, **base), timeout=600)[0]
    assert per_rank[0]["losses"] == pytest.approx(sequential["losses"], rel=1e-4)
    assert sequential["evaluated"] == [(32, 32, 32, 32)]
