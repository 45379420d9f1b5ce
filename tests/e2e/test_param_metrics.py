"""GPT-NeoX's per-parameter metrics (``log_grad_pct_zeros``, ``log_grad_norm``, ``log_param_norm``,
``log_optimizer_states``) written to TensorBoard every iteration, and equal with ZeRO-0/1/2, the pipeline engine and tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tensorboard_scalars, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

KEYS = {
    "no_weight_tying": True,
    "log_grad_pct_zeros": True,
    "log_grad_norm": True,
    "log_param_norm": True,
    "log_optimizer_states": True,
    "log_gradient_noise_scale": True,
    "gradient_noise_scale_n_batches": 2,
}


def _sequential_name(tag: str) -> str:
    section, name = tag.split("/", 1)
    named = section in ("gradient_norms", "pct_grad_zeros", "parameter_norms")
    return f"{section}/sequential.{name}" if named else tag


def test_param_metrics_zero_and_tp_agree(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    layouts = {
        "zero0": {"zero_optimization": {"stage": 0}},
        "zero1": {"zero_optimization": {"stage": 1}},
        "zero2": {"zero_optimization": {"stage": 2}, "gradient_noise_scale_cpu_offload": True},
        "pipe": {"pipe_parallel_size": 1},  # DeepSpeed's pipeline engine (its schedule's optimizer step)
        # one data-parallel rank: two micro-batches make the same global batch of 8
        "tp2": {"model_parallel_size": 2, "gradient_accumulation_steps": 2},
    }
    configs = [
        tiny_config(data, world=2, train_iters=3, eval_interval=100, tensorboard_dir=str(tmp_path / name), **KEYS, **o)
        for name, o in layouts.items()
    ]
    run_distributed(run_pretrain_many, 2, configs, timeout=400)
    logged = {name: tensorboard_scalars(tmp_path / name) for name in layouts}
    ref = logged["zero0"]
    grads = sorted(t for t in ref if t.startswith("gradient_norms/"))
    zeros = sorted(t for t in ref if t.startswith("pct_grad_zeros/"))
    params = sorted(t for t in ref if t.startswith("parameter_norms/"))
    states = sorted(t for t in ref if t.startswith("optimizer_state_norms/"))
    assert grads and len(grads) == len(zeros) == len(params)
    assert {t.split("/", 1)[1].split("_", 1)[1] for t in states} == {"exp_avg", "exp_avg_sq"}  # "step" left out
    assert len(states) == 2 * len(params)  # exp_avg and exp_avg_sq of every parameter
    for tag in grads + zeros + params + states:
        assert [s for s, _ in ref[tag]] == [1, 2, 3], tag  # every iteration, as GPT-NeoX logs them
    assert all(0.0 <= v <= 100.0 for t in zeros for _, v in ref[t])
    # tokens absent from the batch leave zero rows in the embedding's gradient
    assert max(v for t in zeros if "word_embeddings" in t for _, v in ref[t]) > 0.0
    assert all(v > 0.0 for t in grads + params for _, v in ref[t])
    # the per-parameter norms make up the global ones (train/grad_norm: before clipping, train/param_norm)
    for it in range(3):
        total = sum(ref[t][it][1] ** 2 for t in grads) ** 0.5
        assert total == pytest.approx(ref["train/grad_norm"][it][1], rel=1e-4)
        assert sum(ref[t][it][1] ** 2 for t in params) ** 0.5 == pytest.approx(ref["train/param_norm"][it][1], rel=1e-4)
    # the gradient noise scale: first estimate after gradient_noise_scale_n_batches iterations, then every iteration
    assert [s for s, _ in ref["train/noise_scale"]] == [2, 3]
    assert ref["train/noise_scale"][0][1] == ref["train/noise_scale"][1][1]  # the next estimate is at iteration 4
    for name in ("zero1", "zero2", "pipe", "tp2"):
        # the pipeline module names its layers "0.", "2.": the sequential one "sequential.0.", as in GPT-NeoX
        other = {_sequential_name(t) if name == "pipe" else t: v for t, v in logged[name].items()}
        for tag in grads + zeros + params + states + ["train/noise_scale"]:
            assert tag in other, (name, tag)
            rel = 1e-3 if name == "tp2" else 1e-5
            assert [v for _, v in other[tag]] == pytest.approx([v for _, v in ref[tag]], rel=rel, abs=1e-7), (name, tag)
