"""Optimizers GPT-NeoX ships itself: Lion, SM3 and MADGRAD with decoupled weight decay.

Written from the papers' update rules:

* Lion (Chen et al. 2023): ``p ← p·(1 − lr·wd)``; ``p ← p − lr·sign(β1·m + (1 − β1)·g)``; ``m ← β2·m + (1 − β2)·g``.
* SM3 (Anil et al. 2019): one accumulator per tensor axis; ``ν = min_axes(acc) + g²`` (or an EMA with ``beta``),
  each axis accumulator keeps the max of ``ν`` over the other axes; update ``g / sqrt(ν)``, optional momentum.
  Weight decay is not part of SM3 (GPT-NeoX passes none), the group's ``weight_decay`` is ignored.
* MADGRAD (Defazio & Jelassi 2021) with decoupled weight decay (GPT-NeoX's ``madgrad_wd``): dual averaging with
  ``λ_k = lr·sqrt(k+1)``, ``s ← s + λ·g``, ``ν ← ν + λ·g²``, ``z = x0 − s / (ν^(1/3) + eps)``,
  ``p ← (1 − c)·p + c·z`` with ``c = 1 − momentum``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch


class ParameterwiseOptimizer(torch.optim.Optimizer):
    """The ``step()`` every optimizer here shares: evaluate the closure (with gradients on), then update each
    param group through ``update_group`` (given the group's parameters that have a gradient)."""

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.update_group(group, [(p, p.grad) for p in group["params"] if p.grad is not None])
        return loss

    def update_group(self, group: dict[str, Any], params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Update ``params`` (``(parameter, its gradient)`` pairs) with ``group``'s hyperparameters, under ``torch.no_grad()``."""
        raise NotImplementedError


class Lion(ParameterwiseOptimizer):
    """Lion: sign of an interpolated momentum, decoupled weight decay."""

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0
    ) -> None:
        if lr <= 0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def update_group(self, group: dict[str, Any], params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One update of ``params``, the group's ``(parameter, gradient)`` pairs."""
        beta1, beta2 = group["betas"]
        for p, grad in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
            m = state["exp_avg"]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            update = m.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
            p.add_(update, alpha=-group["lr"])
            m.mul_(beta2).add_(grad, alpha=1 - beta2)


class SM3(ParameterwiseOptimizer):
    """SM3: memory-efficient adaptive optimizer with one accumulator per tensor axis."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.0,
        beta: float = 0.0,
        eps: float = 1e-30,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"SM3: lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0 or not 0.0 <= beta < 1.0:
            raise ValueError(f"SM3: momentum and beta must lie in [0, 1), got {momentum}, {beta}")
        # weight_decay is accepted (param groups carry it) and ignored, as in GPT-NeoX.
        super().__init__(
            params, {"lr": lr, "momentum": momentum, "beta": beta, "eps": eps, "weight_decay": weight_decay}
        )

    def update_group(self, group: dict[str, Any], params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One update of ``params``, the group's ``(parameter, gradient)`` pairs."""
        momentum, beta, eps = group["momentum"], group["beta"], group["eps"]
        for p, grad in params:
            state = self.state[p]
            shape = grad.shape
            rank = len(shape)
            if not state:
                state["step"] = 0
                state["momentum_buffer"] = torch.zeros_like(p)
                if rank <= 1:
                    state["acc_0"] = torch.zeros_like(p)
                else:
                    for axis in range(rank):
                        acc_shape = [1] * rank
                        acc_shape[axis] = shape[axis]
                        state[f"acc_{axis}"] = torch.zeros(acc_shape, dtype=p.dtype, device=p.device)
            state["step"] += 1
            if rank <= 1:
                nu = state["acc_0"].clone()
            else:
                nu = state["acc_0"]
                for axis in range(1, rank):
                    nu = torch.min(nu, state[f"acc_{axis}"])  # broadcast to the full shape
            if beta > 0:
                nu.mul_(beta).addcmul_(grad, grad, value=1 - beta)
            else:
                nu.add_(grad * grad)
            if rank <= 1:
                state["acc_0"].copy_(nu)
            else:
                for axis in range(rank):
                    other = [a for a in range(rank) if a != axis]
                    state[f"acc_{axis}"].copy_(torch.amax(nu, dim=other, keepdim=True))
            update = grad / nu.add(eps).sqrt()
            if momentum > 0:
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(update, alpha=1 - momentum)
                update = buf
            p.add_(update, alpha=-group["lr"])


class MADGRAD(ParameterwiseOptimizer):
    """MADGRAD with decoupled weight decay (GPT-NeoX's ``madgrad_wd``)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eps: float = 1e-6,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"MADGRAD: lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"MADGRAD: momentum must lie in [0, 1), got {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eps": eps, "k": 0})

    def update_group(self, group: dict[str, Any], params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One update of ``params``, the group's ``(parameter, gradient)`` pairs."""
        lr, eps, momentum, decay = group["lr"], group["eps"], group["momentum"], group["weight_decay"]
        ck = 1.0 - momentum
        lamb = lr * math.sqrt(group["k"] + 1)
        for p, grad in params:
            state = self.state[p]
            if not state:
                state["grad_sum_sq"] = torch.zeros_like(p)
                state["s"] = torch.zeros_like(p)
                state["x0"] = p.detach().clone()  # the dual-averaging anchor
            if decay != 0:
                p.mul_(1 - lr * decay)  # decoupled weight decay
            grad_sum_sq, s = state["grad_sum_sq"], state["s"]
            grad_sum_sq.addcmul_(grad, grad, value=lamb)
            rms = grad_sum_sq.pow(1 / 3).add_(eps)
            s.add_(grad, alpha=lamb)
            z = state["x0"].addcdiv(s, rms, value=-1)
            p.mul_(1 - ck).add_(z, alpha=ck)  # momentum 0 → ck = 1 → p = z
        group["k"] += 1
