"""gMLP / aMLP blocks on 2 gloo ranks at TP 2 (for tests/distributed/test_gmlp_tp.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron import mpu
from megatron.model.gmlp import GMLPBlock
from megatron.training.grad_clipping import clip_grad_norm
from tests.unit.test_gmlp_gpt_neox_golden import CASES, config, load


def run_tp2_cases() -> dict[str, dict[str, Any]]:
    """Per TP-2 case of GPT-NeoX's fixture: this rank's block on its weights, through mpu's real collectives:
    output, input gradient, the gradient norm the training step computes, and the squares it should sum."""
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    try:
        rank = mpu.get_model_parallel_rank()
        out: dict[str, dict[str, Any]] = {}
        for case in (c for c in CASES if c["tp"] == 2):
            block = GMLPBlock(config(case), 0, 2)
            load(block, case["rank_weights"][rank])
            x = torch.tensor(case["x"], requires_grad=True)
            with FlopCounterMode(
                display=False
            ) as forward:  # this rank's matrix multiplies (tests/unit/test_layer_flops)
                y = block((x, None, torch.tensor(case["attention_mask"])))[0]
            with FlopCounterMode(display=False) as backward:
                (y * torch.tensor(case["output_grad"])).sum().backward()
            assert x.grad is not None
            squares = {n: float(p.grad.pow(2).sum()) for n, p in block.named_parameters() if p.grad is not None}
            norm = clip_grad_norm(list(block.parameters()), 1e9, mpu.get_model_parallel_group())
            out[case["name"]] = {
                "output": y.detach().numpy(),
                "x_grad": x.grad.numpy(),
                "grad_norm": float(norm),
                "squares": squares,
                "unused": sorted(n for n, p in block.named_parameters() if p.grad is None),
                "flops": (forward.get_total_flops(), backward.get_total_flops()),
            }
        return out
    finally:
        mpu.destroy_model_parallel()


def run_cases_and_training(configs: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """:func:`run_tp2_cases`, then the training runs of ``configs`` one after the other (one start of the ranks)."""
    from tests.distributed.fns_train import run_pretrain_many

    return run_tp2_cases(), run_pretrain_many(configs)
