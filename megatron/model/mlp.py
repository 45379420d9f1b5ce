"""The transformer MLP: ``linear1`` (column parallel, h → ffn) → activation → ``linear2`` (row parallel,
ffn_in → h).

Gated activations: ``linear1`` outputs ``[up | gate]`` per TP rank (full weight ``[up | gate]``, split per
sub-matrix, i.e. ``stride=2``), and the result is ``act(gate) · up``. Widths follow GPT-NeoX's sizing rule
(``GPTModelConfig.mlp_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron import mpu
from megatron.model.activations import apply_activation, get_activation
from megatron.model.config import GPTModelConfig
from megatron.model.residual_projection import residual_projection


class ParallelMLP(nn.Module):
    """GPT-NeoX ``ParallelMLP``; ``forward`` returns ``(output, linear2_bias_or_None)`` (bias not yet added)."""

    def __init__(self, cfg: GPTModelConfig, init_method: Callable, output_layer_init_method: Callable) -> None:
        super().__init__()
        ffn, ffn_in = cfg.mlp_sizes
        self.gated = cfg.is_gated
        self.activation = get_activation(cfg)
        self.linear1 = mpu.ColumnParallelLinear(
            cfg.hidden_size,
            ffn,
            bias=cfg.use_bias_in_mlp,
            gather_output=False,
            init_method=init_method,
            skip_bias_add=True,
            params_dtype=cfg.params_dtype,
            sequence_parallel=cfg.sequence_parallel,
            seq_dim=0,
            stride=2 if self.gated else 1,
        )
        self.linear2 = residual_projection(cfg, ffn_in, cfg.use_bias_in_mlp, output_layer_init_method)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` [s, b, h] → ``([s, b, h], bias)``."""
        inter, bias = self.linear1(hidden)  # [s, b, ffn/tp]
        inter = apply_activation(inter, bias, self.activation, self.gated)  # [s, b, ffn_in/tp]
        return self.linear2(inter)
