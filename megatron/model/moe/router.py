"""MoE routers (GPT-NeoX semantics): a replicated ``layer`` (``Linear(h → E)``, no bias, ``init_method``).

* ``topk``: ``scores = softmax(layer(x · jitter))``; the top-k scores are the expert weights (renormalised to sum
  1 only with ``moe_normalize_expert_weights``, Mixtral's routing).
* ``sinkhorn``: in training the experts are the top-k of the Sinkhorn-balanced ``exp(logits)`` (fp32, 3 iterations,
  no gradient); the weights are the activation (sigmoid for k=1, softmax for k>1) of the logits at those experts.
  In evaluation the top-k of the activation is taken directly.

Every router returns ``(weights [T, k], indices [T, k], probs [T, E])``; ``probs`` (softmax of the logits) feeds
the load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron.model.config import GPTModelConfig


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, max_iter: int = 3) -> torch.Tensor:
    """GPT-NeoX's Sinkhorn normalisation of ``exp(cost)`` [T, E] (at most ``max_iter`` iterations)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 1e-8
    d1_old = d1
    for _ in range(max_iter):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if error < tol:
            break
    return d1 * cost * d0.unsqueeze(1)


class Router(nn.Module):
    """Routes each token [T, h] to ``moe_top_k`` of ``moe_num_experts`` experts."""

    def __init__(self, cfg: GPTModelConfig, init_method: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.kind = str(cfg.moe_router_type).lower()
        self.top_k = cfg.moe_top_k
        self.jitter_eps = cfg.moe_jitter_eps
        self.lbl_in_fp32 = cfg.moe_lbl_in_fp32
        self.normalize = cfg.moe_normalize_expert_weights
        weight = torch.empty(cfg.moe_num_experts, cfg.hidden_size, dtype=torch.float32)
        init_method(weight)
        self.layer = nn.Linear(cfg.hidden_size, cfg.moe_num_experts, bias=False, dtype=cfg.params_dtype)
        with torch.no_grad():
            self.layer.weight.copy_(weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [T, h] → ``(weights [T, k], indices [T, k], probs [T, E])``."""
        if self.kind == "topk" and self.training and self.jitter_eps:
            noise = torch.rand(x.size(), dtype=x.dtype, device=x.device)
            x = x * (1.0 - self.jitter_eps + noise * 2.0 * self.jitter_eps)
        logits = self.layer(x)
        probs = torch.softmax(logits.float() if self.lbl_in_fp32 else logits, dim=-1)
        if self.kind == "topk":
            scores = probs.to(logits.dtype)
            weights, indices = torch.topk(scores, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, indices, probs
        if self.top_k == 1:
            activated = torch.sigmoid(logits)
        else:
            activated = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.detach().float()), self.top_k, dim=-1)
            weights = torch.gather(activated, 1, indices)
        else:
            weights, indices = torch.topk(activated, self.top_k, dim=-1)
        return weights, indices, probs
