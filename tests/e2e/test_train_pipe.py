"""Pipeline execution (pipe_parallel_size 1) through DeepSpeed's PipelineEngine with the same loop: training,
gradient accumulation, evaluation, per-layer checkpoint files and exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def test_pipe_train_save_resume(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    common = {
        "pipe_parallel_size": 1,
        "zero_optimization": {"stage": 1},
        "gradient_accumulation_steps": 2,
        "train_iters": 6,
        "eval_interval": 3,
        "checkpoint_factor": 3,
    }
    full = run_distributed(run_pretrain, 2, tiny_config(data, world=2, save=str(tmp_path / "a"), **common))[0]
    losses = full["train_losses"]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    assert full["saved"] == [3, 6] and "validation/lm_loss" in full["valid"]
    names = {p.name for p in (tmp_path / "a" / "global_step3").iterdir()}
    # GPT-NeoX layer indices: embedding 0, transformer layers 2..L+1, final norm L+3 (tied head not stored twice)
    layers = sorted(n for n in names if n.startswith("layer_"))
    assert layers == [f"layer_{i:02d}-model_00-model_states.pt" for i in (0, 2, 3, 5)]
    assert "mp_rank_00_model_states.pt" in names and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in names
    resumed = run_distributed(
        run_pretrain, 2, tiny_config(data, world=2, load=str(tmp_path / "a"), iteration=3, **common)
    )[0]
    assert resumed["start_iteration"] == 3 and resumed["train_losses"] == losses[3:]
    _generate_from(tiny_config(data, world=2, load=str(tmp_path / "a"), **common), tmp_path)


def _generate_from(config: dict, tmp_path: Path) -> None:
    """generate.py's path (one process, no engine) on a checkpoint of any training layout."""
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    out = tmp_path / "samples.jsonl"
    gen = {"text_gen_type": "unconditional", "num_samples": 2, "maximum_tokens": 4, "sample_output_file": str(out)}
    records = run_generation(NeoXArgs.from_dict({**config, **gen}))
    assert len(records) == 2 and all(r["length"] > 0 or r["finished"] for r in records)
    assert len(out.read_text().splitlines()) == 2


def test_pipe_refuses_zero2(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    cfg = tiny_config(data, pipe_parallel_size=1, zero_optimization={"stage": 2}, train_iters=2)
    with pytest.raises(DistributedTestError, match="cannot be combined with pipe_parallel_size"):
        run_distributed(run_pretrain, 1, cfg, timeout=200)


def test_tensor_parallel_training_matches_one_rank(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    common = {"train_iters": 4, "eval_interval": 100, "eval_iters": 1, "zero_optimization": {"stage": 1}}
    tp = run_distributed(run_pretrain, 2, tiny_config(data, world=2, model_parallel_size=2, **common))
    ref = run_distributed(run_pretrain, 1, tiny_config(data, **common))[0]
    assert tp[0]["dp"] == 1 and tp[0]["train_losses"] == tp[1]["train_losses"]
    assert tp[0]["train_losses"] == pytest.approx(ref["train_losses"], rel=1e-5)


def test_resume_with_another_tensor_parallel_size_reshards_on_load(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    common = {"train_iters": 6, "eval_interval": 100, "eval_iters": 1, "checkpoint_factor": 3}
    tp2 = run_distributed(
        run_pretrain, 2, tiny_config(data, world=2, model_parallel_size=2, save=str(tmp_path / "a"), **common)
    )[0]
    tp1 = run_distributed(run_pretrain, 1, tiny_config(data, load=str(tmp_path / "a"), iteration=3, **common))[0]
    assert tp1["start_iteration"] == 3
    assert tp1["train_losses"] == pytest.approx(tp2["train_losses"][3:], rel=1e-5)
    assert list((tmp_path / "a" / ".resharded").iterdir())  # the tp=1 copy written next to the checkpoint
    _generate_from(tiny_config(data, world=2, model_parallel_size=2, load=str(tmp_path / "a"), **common), tmp_path)
    # and the other way: a tp=1 checkpoint continued by a tp=2 run
    tp1_full = run_distributed(run_pretrain, 1, tiny_config(data, save=str(tmp_path / "b"), **common))[0]
    tp2_resumed = run_distributed(
        run_pretrain,
        2,
        tiny_config(data, world=2, model_parallel_size=2, load=str(tmp_path / "b"), iteration=3, **common),
    )[0]
    assert tp2_resumed["train_losses"] == pytest.approx(tp1_full["train_losses"][3:], rel=1e-5)
