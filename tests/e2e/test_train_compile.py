"""``torch_compile: true``: the same losses as eager training, the compile time logged, refused layouts named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.distributed.fns_compile import run_pretrain_with_log_many
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import run_distributed
from tests.unit.test_neox_args import CPU1, TINY

pytestmark = pytest.mark.distributed


def test_compiled_layers_train_like_eager_and_log_the_compile_time(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    common = {"train_iters": 4, "eval_interval": 100, "eval_iters": 0, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    configs = [tiny_config(data, **common), tiny_config(data, torch_compile=True, **common)]
    configs.append(tiny_config(data, torch_compile=True, checkpoint_activations=True, **common))
    eager, compiled, recomputed = run_distributed(run_pretrain_with_log_many, 1, configs, timeout=600)[0]
    assert len(compiled["train_losses"]) == len(eager["train_losses"]) == 4
    assert compiled["train_losses"] == pytest.approx(eager["train_losses"], rel=1e-5)
    # activation checkpointing recomputes the compiled layers in the backward pass: the same losses again
    assert recomputed["train_losses"] == pytest.approx(eager["train_losses"], rel=1e-5)
    assert "torch_compile: 2 transformer layers compiled with torch.compile (inductor)" in compiled["log"]
    timing = [m for m in compiled["log"] if m.startswith("torch_compile: compile time")]
    assert len(timing) == 1, compiled["log"]
    assert re.fullmatch(
        r"torch_compile: compile time ≈ [\d.]+ s \(first step [\d.]+ s, then [\d.]+ s per step\)", timing[0]
    )
    assert not any("torch_compile" in m for m in eager["log"])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"pipe_parallel_size": 1}, "pipe_parallel_size=1"),
        ({"zero_optimization": {"stage": 3}}, "zero_stage=3"),
        ({"model_parallel_size": 2, "global_num_gpus": 2}, "model_parallel_size=2"),
    ],
)
def test_unsupported_layouts_are_refused(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=rf"torch_compile: true is not supported yet with {re.escape(named)}"):
        NeoXArgs({**TINY, "torch_compile": True, **overrides}, env=CPU1)
