"""The model's view of its MoE layers: finding them, adding their aux loss to the training loss, their statistics.

Above both :mod:`megatron.model.moe.layer` and :mod:`megatron.model.moe.aux_loss` (the layer attaches its aux loss's
gradient itself; the loss here only carries the value and the probe, see aux_loss's docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron.model.moe.aux_loss import probe_loss_grad
from megatron.model.moe.layer import ParallelDroplessMoE


def moe_layers(model: nn.Module) -> list[ParallelDroplessMoE]:
    """The model's MoE MLPs in layer order."""
    return [m for m in model.modules() if isinstance(m, ParallelDroplessMoE)]


def with_aux_loss(loss_fn: Callable[..., torch.Tensor], model: nn.Module) -> Callable[..., torch.Tensor]:
    """``loss_fn`` plus ``moe_loss_weight ×`` the mean aux loss of ``model``'s MoE layers in training (unchanged
    for dense models; evaluation losses stay pure LM losses)."""
    layers = moe_layers(model)
    if not layers:
        return loss_fn
    weight = layers[0].loss_weight

    def loss_with_aux(output: torch.Tensor, labels: Any) -> torch.Tensor:
        loss = loss_fn(output, labels)
        if not layers[0].training:
            return loss
        if weight > 0.0:
            aux = torch.stack([layer.last_aux_loss.float() for layer in layers]).mean()
            loss = loss + weight * aux.to(loss.device)
        return probe_loss_grad(loss)

    return loss_with_aux


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Router statistics of the last training forward (this rank): aux loss and tokens per expert per layer."""
    out: dict[str, float] = {}
    layers = [layer for layer in moe_layers(model) if layer.last_tokens_per_expert is not None]
    if not layers:
        return out
    out["train/moe_aux_loss"] = float(torch.stack([layer.last_aux_loss.float() for layer in layers]).mean())
    for layer in layers:
        tokens = layer.last_tokens_per_expert
        assert tokens is not None  # layers without statistics were left out above
        counts = tokens.tolist()
        total = max(sum(counts), 1)
        out[f"moe/layer_{layer.layer_index:02d}/max_expert_fraction"] = max(counts) / total
        for e, n in enumerate(counts):
            out[f"moe/layer_{layer.layer_index:02d}/tokens_expert_{e}"] = float(n)
    return out
