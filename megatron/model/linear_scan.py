"""The first-order linear recurrence ``h_t = a_t ⊙ h_{t-1} + x_t`` along dim 0, in linear work and ~2·√L Python steps.

Mamba's selective scan (``a_t = exp(Δ_t A)``) and RWKV's WKV state across chunks (``a = `` the chunk's decay) are
both this recurrence, element-wise over every other dimension. :func:`linear_scan` cuts the ``L`` steps into ``C`` chunks of
``T ≈ √L`` (a divisor of ``L`` when one is near): (1) ``T`` steps over every chunk at once from a zero start, keeping
only each chunk's last state and the product of its ``a``; (2) ``C`` steps carrying the state entering each chunk;
(3) ``T`` steps again from those states, writing every ``h_t``. Only products of the ``a`` appear (no division, no
exponent): nothing overflows for ``0 ≤ a ≤ 1``. The backward is the same recurrence run backwards:
``g_t = ∂h_t + a_{t+1} ⊙ g_{t+1}``, ``∂x_t = g_t``, ``∂a_t = g_t ⊙ h_{t-1}``, ``∂h_0 = a_0 ⊙ g_0``. Autograd keeps
``a``, ``h`` and ``h_0``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def chunk_length(length: int, chunk: int | None = None) -> int:
    """``chunk`` if given, else a divisor of ``length`` near ``√length`` (no padding), else ``⌈√length⌉``."""
    if chunk:
        return max(1, min(chunk, length))
    root = math.isqrt(length)
    for t in sorted(range(max(1, root // 2), 2 * root + 1), key=lambda t: abs(t - root)):
        if length % t == 0:
            return t
    return math.ceil(math.sqrt(length))


def chunked_scan(
    a: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, chunk: int | None, reverse: bool = False
) -> torch.Tensor:
    """The recurrence without autograd: ``a``, ``x`` ``[L, M]``, ``h0`` ``[M]`` → ``h`` ``[L, M]``; ``reverse``: from
    the last step to the first (``h_t = a_t ⊙ h_{t+1} + x_t``)."""
    length, m = x.shape
    t = chunk_length(length, chunk)
    c = -(-length // t)
    pad = c * t - length
    if pad:  # padded steps (at the end the scan reaches last): a = 1, x = 0, cut off again
        a = F.pad(a, (0, 0, pad, 0) if reverse else (0, 0, 0, pad), value=1.0)
        x = F.pad(x, (0, 0, pad, 0) if reverse else (0, 0, 0, pad))
    a3, x3 = a.reshape(c, t, m), x.reshape(c, t, m)
    steps = range(t - 1, -1, -1) if reverse else range(t)
    # (1) each chunk from a zero start: only its last state and the product of its a
    end, prod = torch.zeros(c, m, dtype=x.dtype, device=x.device), torch.ones(c, m, dtype=x.dtype, device=x.device)
    for j in steps:
        end = torch.addcmul(x3[:, j], a3[:, j], end)
        prod.mul_(a3[:, j])
    # (2) the state entering each chunk
    entering = torch.empty(c, m, dtype=x.dtype, device=x.device)
    state = h0
    for i in range(c - 1, -1, -1) if reverse else range(c):
        entering[i] = state
        state = torch.addcmul(end[i], prod[i], state)
    # (3) each chunk again from its true start, every state written
    h = torch.empty(c, t, m, dtype=x.dtype, device=x.device)
    prev = entering
    for j in steps:
        prev = torch.addcmul(x3[:, j], a3[:, j], prev, out=h[:, j])
    h2 = h.reshape(c * t, m)
    return h2[pad:] if reverse else h2[:length]


class _LinearScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, chunk: int | None) -> torch.Tensor:
        h = chunked_scan(a, x, h0, chunk)
        ctx.save_for_backward(a, h, h0)
        ctx.chunk = chunk
        return h

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, h, h0 = ctx.saved_tensors
        a_next = torch.cat([a[1:], a.new_zeros(1, a.shape[1])])  # a_{t+1}; nothing follows the last step
        g = chunked_scan(a_next, grad_h.contiguous(), torch.zeros_like(h0), ctx.chunk, reverse=True)
        grad_a = g * torch.cat([h0[None], h[:-1]]) if ctx.needs_input_grad[0] else None
        grad_h0 = a[0] * g[0] if ctx.needs_input_grad[2] else None
        return grad_a, g, grad_h0, None


def linear_scan(a: torch.Tensor, x: torch.Tensor, h0: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Every ``h_t = a_t ⊙ h_{t-1} + x_t`` (``t`` along dim 0), ``h_{-1} = h0``.

    ``a``, ``x``: ``[L, *rest]`` (same dtype); ``h0``: ``rest``; ``chunk``: the inner chunk length (None: ⌈√L⌉).
    Returns ``h`` ``[L, *rest]``. Differentiable in ``a``, ``x`` and ``h0``.
    """
    rest = x.shape[1:]
    flat = _LinearScan.apply(
        a.reshape(a.shape[0], -1).contiguous(), x.reshape(x.shape[0], -1).contiguous(), h0.reshape(-1), chunk
    )
    return flat.reshape(x.shape[0], *rest)
