"""Load-balancing auxiliary loss of MoE layers, and how its gradient reaches the router.

``lbl = E · Σ_e f_e · P_e`` per layer (Switch-Transformer form): ``f_e`` = share of the ``T·k`` assignments that
went to expert ``e``, ``P_e`` = mean router probability of ``e``; 1.0 when perfectly balanced. The training loss is
``lm_loss + moe_loss_weight · mean over MoE layers of lbl``.

Activation checkpointing recomputes layers inside the backward pass, after the loss was formed, so the loss cannot
simply hold the layers' aux-loss graphs. Instead the loss carries the aux-loss *value*, and every MoE layer
injects the aux loss's gradient itself: :func:`attach_aux_loss` puts a node on the layer output whose backward
hands ``coeff × s`` to the layer's aux loss, where ``s`` is the gradient the final loss received (DeepSpeed's
``1/gas`` and fp16 loss scale), recorded by :func:`probe_loss_grad` on the loss (the root of the backward pass,
so it is recorded before any layer's backward runs). The result equals differentiating ``lm + w·mean(lbl)``.
"""

from __future__ import annotations

from typing import Any

import torch

_LOSS_GRAD: list[torch.Tensor | None] = [None]  # gradient reaching the training loss in the current backward


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """``E · Σ_e f_e · P_e`` for router probabilities ``probs`` [T, E] and assignment counts [E]."""
    num_tokens, num_experts = probs.shape
    fraction = tokens_per_expert.to(probs.dtype) / float(num_tokens * top_k)
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


class _InjectAuxGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, coeff: float) -> torch.Tensor:
        ctx.coeff = coeff
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device = ctx.aux_meta
        scale = _LOSS_GRAD[0]
        aux_grad = torch.full((), ctx.coeff, dtype=dtype, device=device)
        if scale is not None:
            aux_grad = aux_grad * scale.to(dtype=dtype, device=device)
        return grad, aux_grad, None


class _ProbeLossGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _LOSS_GRAD[0] = grad.detach().reshape(())
        return grad


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, coeff: float) -> torch.Tensor:
    """``out`` unchanged; in backward, ``aux`` receives ``coeff`` × the gradient of the training loss."""
    return _InjectAuxGrad.apply(out, aux, coeff)


def probe_loss_grad(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged; its backward records the gradient it receives for the MoE layers' aux losses."""
    _LOSS_GRAD[0] = None  # a backward without this probe uses scale 1 (plain ``aux.backward()`` semantics)
    return _ProbeLossGrad.apply(loss)


def reset_loss_grad() -> None:
    """Forget the recorded loss gradient (aux gradients then use scale 1)."""
    _LOSS_GRAD[0] = None
