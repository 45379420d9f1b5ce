"""The real training path (``pretrain``: NeoXArgs → mpu → model → DeepSpeed → loop) under 3D layouts on 4 ranks
equals the one-rank run on the same data (tiny dataset built with the project's tools)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.fns_parallel_train import run_pretrain_with_checkpointing_state
from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

COMMON = {
    "train_iters": 4,
    "eval_interval": 100,
    "eval_iters": 1,
    "zero_optimization": {"stage": 1},
    "gradient_accumulation_steps": 2,
    "checkpoint_activations": True,
}
# (model_parallel_size, pipe_parallel_size, micro-batch, sequence_parallel): global batch 4 in every layout
LAYOUTS = [(2, 2, 2, False), (2, 0, 1, False), (2, 0, 1, True), (2, 2, 2, True)]
# GPT-NeoX's checkpoint storage keys, honoured by the real path (pretrain's model setup configures DeepSpeed once)
STORAGE = {"partition_activations": True, "contiguous_checkpointing": True, "synchronize_each_layer": True}


def test_pretrain_3d_layouts_match_one_rank(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    ref = run_distributed(run_pretrain, 1, tiny_config(data, train_micro_batch_size_per_gpu=2, **COMMON))[0]
    configs = [
        tiny_config(
            data,
            world=4,
            model_parallel_size=tp,
            pipe_parallel_size=pp,
            train_micro_batch_size_per_gpu=mbs,
            sequence_parallel=sp,
            **({} if sp else STORAGE),  # partition_activations is refused with sequence_parallel
            **COMMON,
        )
        for tp, pp, mbs, sp in LAYOUTS
    ]
    results = run_distributed(run_pretrain_with_checkpointing_state, 4, configs, timeout=300)
    for i, (tp, pp, _, sp) in enumerate(LAYOUTS):
        runs = [rank_results[i] for rank_results in results]
        assert runs[0]["dp"] == 4 // (tp * max(pp, 1))
        assert all(r["train_losses"] == runs[0]["train_losses"] for r in runs), (tp, pp)
        assert runs[0]["train_losses"] == pytest.approx(ref["train_losses"], abs=1e-5), (tp, pp)
        assert runs[0]["valid"]["validation/lm_loss"] == pytest.approx(ref["valid"]["validation/lm_loss"], abs=1e-5)
        state = runs[0]["checkpointing"]
        assert all(state[key] is (not sp) for key in STORAGE), state
        assert state["num_checkpoints"] == 2 * max(pp, 1), state  # 2 layers x micro-batches in flight
