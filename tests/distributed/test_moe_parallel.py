"""MoE through the real training path (``pretrain``): expert parallelism over the TP group (TP=2) and data
parallelism (DP=2, against the pipe engine with one stage) reproduce the one-rank losses; ZeRO 0/1, activation checkpointing, the pipe engine (pp=1),
router statistics in TensorBoard, expert weights in the checkpoint and an exact resume from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tensorboard_scalars, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

TOPK = {
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_router_type": "topk",
    "moe_loss_weight": 0.05,
    "zero_optimization": {"stage": 1},
    "checkpoint_activations": True,
}
SINKHORN = {
    "moe_num_experts": 4,
    "moe_expert_interval": 2,
    "moe_router_type": "sinkhorn",
    "num_layers": 3,
    "gpt_j_residual": True,
}
COMMON = {"train_iters": 5, "eval_interval": 5, "eval_iters": 1, "log_interval": 1}


def test_moe_tp2_and_dp2_equal_one_rank(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    save, tb, resume = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "resume"
    one_rank = [
        tiny_config(data, **TOPK, **COMMON, save=str(save), checkpoint_factor=5, tensorboard_dir=str(tb)),
        tiny_config(data, **SINKHORN, **COMMON),
        tiny_config(data, **{**TOPK, "moe_loss_weight": 0.0}, **COMMON, pipe_parallel_size=1),
        # resume: 2 iterations saved, then loaded and continued to 5 (same schedule: lr_decay_iters 5)
        tiny_config(
            data, **TOPK, **{**COMMON, "train_iters": 2}, lr_decay_iters=5, save=str(resume), checkpoint_factor=2
        ),
        tiny_config(data, **TOPK, **COMMON, load=str(resume)),
    ]
    ref = run_distributed(run_pretrain_many, 1, one_rank, timeout=300)[0]
    two_ranks = [
        tiny_config(
            data, world=2, model_parallel_size=2, **TOPK, **COMMON, save=str(tmp_path / "ckpt_tp2"), checkpoint_factor=5
        ),
        tiny_config(data, world=2, model_parallel_size=2, **SINKHORN, **COMMON),
        tiny_config(data, world=2, train_micro_batch_size_per_gpu=2, **{**TOPK, "moe_loss_weight": 0.0}, **COMMON),
    ]
    runs = run_distributed(run_pretrain_many, 2, two_ranks, timeout=300)
    # DP: the aux loss and Sinkhorn balance each rank's micro-batch, so only top-k without aux loss is DP-invariant
    for i, j in ((0, 0), (1, 1), (2, 2)):
        assert len(ref[i]["train_losses"]) == 5
        assert runs[0][j]["train_losses"] == pytest.approx(ref[i]["train_losses"], abs=1e-5), (i, j)
        assert runs[1][j]["train_losses"] == runs[0][j]["train_losses"]
    assert ref[0]["train_losses"][-1] < ref[0]["train_losses"][0]
    assert runs[0][2]["dp"] == 2 and runs[0][0]["dp"] == 1
    assert ref[4]["start_iteration"] == 2
    assert ref[4]["train_losses"] == pytest.approx(ref[0]["train_losses"][2:], abs=1e-6)  # exact resume

    scalars = tensorboard_scalars(tb)
    counts = [scalars[f"moe/layer_00/tokens_expert_{e}"][-1][1] for e in range(4)]
    assert sum(counts) == 4 * 32 * 2  # micro-batch 4 × seq 32 tokens, each routed to exactly 2 experts
    assert 0.5 < scalars["train/moe_aux_loss"][-1][1] < 4.0

    # Experts in the checkpoint under GPT-NeoX's names; the TP=2 ranks hold two of the four experts each.
    def module(path: Path) -> dict[str, torch.Tensor]:
        return torch.load(path, weights_only=False)["module"]  # written by this test's own run

    full = module(save / "global_step5" / "mp_rank_00_model_states.pt")
    assert full["sequential.2.mlp.experts.mlp.w1"].shape == (4 * 256, 64)
    assert full["sequential.3.mlp.router.layer.weight"].shape == (4, 64)
    tp2 = [module(save.parent / "ckpt_tp2" / "global_step5" / f"mp_rank_0{r}_model_states.pt") for r in (0, 1)]
    assert [s["sequential.2.mlp.experts.mlp.w2"].shape for s in tp2] == [(2 * 256, 64)] * 2
