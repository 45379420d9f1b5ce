"""``ParallelDroplessMoE``: the MLP of an MoE layer (router + dropless experts), GPT-NeoX's tensor names
``mlp.router.layer.weight`` and ``mlp.experts.mlp.w1`` / ``w2`` (``w3`` with ``moe_gated_experts``).

Same call signature as the dense MLP: ``[s, b, h] → (output [s, b, h], None)`` (no bias). Expert parallelism over
the TP group goes through ``megatron.mpu``: the tokens and routing weights enter with ``copy_to_model_parallel_region``
(their gradients are summed over the group) and the experts' shares are summed with
``reduce_from_model_parallel_region`` (left to the layer's single reduction with ``gpt_j_residual``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.moe.aux_loss import attach_aux_loss, load_balancing_loss
from megatron.model.moe.experts import DroplessExperts
from megatron.model.moe.router import Router


class ParallelDroplessMoE(nn.Module):
    """Router + experts of one MoE layer; keeps the last forward's aux loss and tokens per expert."""

    def __init__(
        self,
        cfg: GPTModelConfig,
        layer_index: int,
        init_method: Callable[[torch.Tensor], object],
        output_layer_init_method: Callable[[torch.Tensor], object],
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.top_k = cfg.moe_top_k
        self.parallel_output = cfg.gpt_j_residual
        self.loss_weight = cfg.moe_loss_weight
        self.aux_coeff = self.loss_weight / max(cfg.num_moe_layers, 1)
        self.router = Router(cfg, init_method)
        self.experts = DroplessExperts(cfg, init_method, output_layer_init_method)
        self.last_aux_loss: torch.Tensor = torch.zeros(())
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``hidden`` [s, b, h] → ``(output [s, b, h], None)``."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        weights, indices, probs = self.router(x)
        out, tokens_per_expert = self.experts(
            mpu.copy_to_model_parallel_region(x), mpu.copy_to_model_parallel_region(weights), indices
        )
        if not self.parallel_output:
            out = mpu.reduce_from_model_parallel_region(out)
        aux = load_balancing_loss(probs, tokens_per_expert, self.top_k)
        self.last_aux_loss = aux.detach()
        self.last_tokens_per_expert = tokens_per_expert.detach()
        if self.training and self.aux_coeff > 0.0 and torch.is_grad_enabled():
            out = attach_aux_loss(out, aux, self.aux_coeff)
        return out.reshape(shape), None
