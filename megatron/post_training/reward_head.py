"""The reward-model head: ``rm_linear``, row-parallel ``hidden → 1`` without bias, replacing the LM head (spec L+4)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.seeding import seeded


class RewardHead(nn.Module):
    """``[b, s, h]`` → scores ``[b, s, 1]`` (the same on every TP rank: the row-parallel output is all-reduced)."""

    def __init__(self, cfg: GPTModelConfig, spec_index: int) -> None:
        super().__init__()
        with seeded(cfg.seed + spec_index):
            init_method, _ = init_methods(cfg)
            self.rm_linear = mpu.RowParallelLinear(
                cfg.hidden_size, 1, bias=False, input_is_parallel=False, init_method=init_method,
                params_dtype=cfg.params_dtype,
            )  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores per position."""
        return self.rm_linear(hidden)[0]


def with_reward_head(model: Any, cfg: GPTModelConfig) -> Any:
    """Replace the sequential model's output layer by :class:`RewardHead` (GPT-NeoX's ``is_rm`` output layer)."""
    model.sequential[-1] = RewardHead(cfg, cfg.num_layers + 4)
    return model
