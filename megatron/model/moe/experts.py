"""Dropless expert computation: every (token, expert) assignment is computed, none is dropped (no capacity).

The experts of a layer are sharded over the tensor-parallel group (expert parallelism, as GPT-NeoX does): rank
``r`` of ``tp`` owns experts ``[r·E/tp, (r+1)·E/tp)``. Tokens are replicated over the TP group, so every rank
computes its own experts' share of every token and the shares are summed by the caller's TP reduction.

Parameters (GPT-NeoX's grouped-MLP layout, no biases), ``E_r = E/tp`` local experts of width ``f``:
``mlp.w1`` [E_r·f, h] (input projection; the gate of gated experts), ``mlp.w3`` [E_r·f, h] (gated experts only,
``moe_gated_experts`` with a gated activation: the up projection) and ``mlp.w2`` [E_r·f, h] (output projection, used as ``y = a @ w2_e``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron import mpu
from megatron.model.activations import get_activation
from megatron.model.config import GPTModelConfig

InitMethod = Callable[[torch.Tensor], object]


class GroupedExpertMLP(nn.Module):
    """This rank's experts as stacked weights ``w1``/``w2`` (and ``w3`` when gated)."""

    def __init__(self, cfg: GPTModelConfig, init_method: InitMethod, output_layer_init_method: InitMethod) -> None:
        super().__init__()
        tp = mpu.get_model_parallel_world_size()
        if cfg.moe_num_experts % tp:
            raise ValueError(
                f"moe_num_experts={cfg.moe_num_experts} must be divisible by model_parallel_size={tp} "
                "(experts are sharded over the tensor-parallel group)"
            )
        self.num_experts = cfg.moe_num_experts
        self.local_experts = cfg.moe_num_experts // tp
        self.first_expert = mpu.get_model_parallel_rank() * self.local_experts
        self.ffn = cfg.moe_ffn_size
        self.gated = cfg.moe_experts_gated
        self.activation = get_activation(cfg)
        shape = (cfg.moe_num_experts * self.ffn, cfg.hidden_size)
        self.w1 = self._weight(shape, init_method, cfg)
        if self.gated:
            self.w3 = self._weight(shape, init_method, cfg)
        self.w2 = self._weight(shape, output_layer_init_method, cfg)

    @staticmethod
    def _weight(shape: tuple[int, int], init: InitMethod, cfg: GPTModelConfig) -> nn.Parameter:
        weight = mpu.sharded_master_weight(shape, init, 0, cfg.params_dtype)
        mpu.set_tensor_model_parallel_attributes(weight, partition_dim=0)
        return weight

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` (0-based on this rank) applied to ``x`` [n, h]."""
        rows = slice(e * self.ffn, (e + 1) * self.ffn)
        a = self.activation(x @ self.w1[rows].t())
        if self.gated:
            a = a * (x @ self.w3[rows].t())
        return a @ self.w2[rows]


class DroplessExperts(nn.Module):
    """Permute tokens by expert, run this rank's experts on their tokens, un-permute with the routing weights."""

    def __init__(self, cfg: GPTModelConfig, init_method: InitMethod, output_layer_init_method: InitMethod) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.mlp = GroupedExpertMLP(cfg, init_method, output_layer_init_method)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [T, h], ``weights``/``indices`` [T, k] → (this rank's share of the output [T, h], tokens per
        expert [E] over all experts)."""
        mlp = self.mlp
        flat = indices.reshape(-1)
        tokens_per_expert = torch.bincount(flat, minlength=mlp.num_experts)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = tokens_per_expert.tolist()
        start = sum(counts[: mlp.first_expert])
        local_counts = counts[mlp.first_expert : mlp.first_expert + mlp.local_experts]
        local = order[start : start + sum(local_counts)]
        token = torch.div(local, self.top_k, rounding_mode="floor")
        routed = x.index_select(0, token)
        outputs = [mlp.expert(e, chunk) for e, chunk in enumerate(torch.split(routed, local_counts)) if len(chunk)]
        out = torch.zeros_like(x)
        if outputs:
            y = torch.cat(outputs) * weights.reshape(-1).index_select(0, local).unsqueeze(1).to(x.dtype)
            out = out.index_add(0, token, y)
        return out, tokens_per_expert
