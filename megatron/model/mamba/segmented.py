"""The selective scan's recurrence as one autograd function that runs the sequence in time segments.

For every token ``t`` (``[b, d, n]`` per token, ``Δ`` already discretized)::

    dA_t = exp(Δ_t ⊗ A)     x_t = (Δ_t u_t) ⊗ B_t     h_t = dA_t ⊙ h_{t-1} + x_t     y_t = Σ_n h_t ⊙ C_t

Autograd over these ops keeps ``dA``, ``x``-sized products and every state ``h`` (``[l, b, d, n]`` each) and makes
some fifteen passes over such tensors. :class:`SegmentedScan` instead walks the sequence in segments of
``segment`` tokens: the forward keeps only each segment's start state; the backward recomputes one segment's
``dA``, ``x`` and states from it, then runs the reverse recurrence
``G_t = C_t ⊗ ∂y_t + dA_{t+1} ⊙ G_{t+1}`` (``G`` the gradient reaching ``h_t``) within the segment, carrying
``dA_{s} ⊙ G_{s}`` into the segment before. Every tensor of the loop is ``segment × b·d·n``: it stays in cache, and
activation memory is the inputs plus ``l / segment`` states. States are laid out ``[b, n, d]`` (channels innermost). Gradients, with ``h_{t-1}`` the previous state::

    ∂B_t = Σ_d G_t (Δ_t u_t)     ∂(Δ_t u_t) = Σ_n G_t B_t     ∂C_t = Σ_d ∂y_t h_t
    ∂Δ_t += Σ_n (G_t ⊙ h_{t-1} ⊙ dA_t) A     ∂A = Σ_{b,t} (G_t ⊙ h_{t-1} ⊙ dA_t) Δ_t     ∂h_{-1} = dA_0 ⊙ G_0

Within a segment the recurrences run as :mod:`~megatron.model.linear_scan`'s chunked scan (no per-token loop).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.model.linear_scan import chunked_scan

DEFAULT_SEGMENT = 64


def _segment_tensors(
    dt: torch.Tensor, u: torch.Tensor, At: torch.Tensor, B: torch.Tensor, sl: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dA, du, x)`` of the tokens in ``sl``: ``[T, b, n, d]``, ``[T, b, d]``, ``[T, b, n, d]`` (time-first inputs,
    ``At = Aᵀ`` ``[n, d]``; ``d`` innermost, so every broadcast runs along contiguous channels)."""
    dA = (dt[sl].unsqueeze(2) * At).exp_()
    du = dt[sl] * u[sl]
    return dA, du, du.unsqueeze(2) * B[sl].unsqueeze(-1)


def _states(dA: torch.Tensor, x: torch.Tensor, start: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Every ``h_t = dA_t ⊙ h_{t-1} + x_t`` of a segment, ``h_{-1} = start``: ``[T, b, n, d]``."""
    t = dA.shape[0]
    return chunked_scan(dA.reshape(t, -1), x.reshape(t, -1), start.reshape(-1), chunk).view(dA.shape)


class SegmentedScan(torch.autograd.Function):
    """``(y [l, b, d], h_{l-1} [b, n, d])`` from time-first ``dt``, ``u`` ``[l, b, d]``, ``At = Aᵀ`` ``[n, d]``,
    ``B``, ``C`` ``[l, b, n]`` and the start state ``h0`` ``[b, n, d]`` (all contiguous, the same float dtype)."""

    @staticmethod
    def forward(
        ctx: Any,
        dt: torch.Tensor,
        u: torch.Tensor,
        At: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        h0: torch.Tensor,
        segment: int,
        chunk: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = dt.shape[0]
        y = dt.new_empty(dt.shape)
        starts, h = [], h0
        for lo in range(0, length, segment):
            sl = slice(lo, min(lo + segment, length))
            dA, _, x = _segment_tensors(dt, u, At, B, sl)
            starts.append(h)
            hs = _states(dA, x, h, chunk)
            y[sl] = torch.einsum("tbnd,tbn->tbd", hs, C[sl])
            h = hs[-1].clone()
        ctx.save_for_backward(dt, u, At, B, C, torch.stack(starts))
        ctx.segment, ctx.chunk = segment, chunk
        return y, h

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, g_last: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        dt, u, At, B, C, starts = ctx.saved_tensors
        segment, chunk = ctx.segment, ctx.chunk
        length = dt.shape[0]
        g_dt, g_u, g_B, g_C = (torch.empty_like(t) for t in (dt, u, B, C))
        g_At = torch.zeros_like(At)
        carry = g_last if g_last is not None else torch.zeros_like(starts[0])  # dA_s ⊙ G_s of the next segment
        for i in range(len(starts) - 1, -1, -1):
            sl = slice(i * segment, min((i + 1) * segment, length))
            dA, du, x = _segment_tensors(dt, u, At, B, sl)
            hs = _states(dA, x, starts[i], chunk)
            # G_t = C_t ⊗ ∂y_t + dA_{t+1} ⊙ G_{t+1}, run backwards; the segment's last token gets the carry
            src = gy[sl].unsqueeze(2) * C[sl].unsqueeze(-1)
            src[-1] += carry
            a_next = torch.cat([dA[1:], torch.zeros_like(dA[:1])])
            steps = dA.shape[0]
            G = chunked_scan(a_next.reshape(steps, -1), src.reshape(steps, -1), torch.zeros_like(carry).reshape(-1),
                             chunk, reverse=True).view(dA.shape)  # fmt: skip
            g_C[sl] = torch.einsum("tbnd,tbd->tbn", hs, gy[sl])
            g_B[sl] = torch.einsum("tbnd,tbd->tbn", G, du)
            g_du = torch.einsum("tbnd,tbn->tbd", G, B[sl])
            g_z = G * dA  # times h_{t-1}: the gradient reaching Δ_t ⊗ A
            g_z[1:] *= hs[:-1]
            g_z[0] *= starts[i]
            g_dt[sl] = (g_z * At).sum(2) + g_du * u[sl]
            g_At += (g_z * dt[sl].unsqueeze(2)).sum((0, 1))
            g_u[sl] = g_du * dt[sl]
            carry = dA[0] * G[0]  # into the segment before
        return g_dt, g_u, g_At, g_B, g_C, carry, None, None


def segmented_scan(
    dt: torch.Tensor,
    u: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    segment: int = DEFAULT_SEGMENT,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`SegmentedScan` on ``A`` ``[d, n]`` and ``h0`` ``[b, d, n]``, returning the last state as
    ``[b, d, n]`` (``chunk``: the inner chunk of the scan within a segment; None: ≈√segment)."""
    At, h0t = A.t().contiguous(), h0.transpose(1, 2).contiguous()
    y, last = SegmentedScan.apply(dt, u, At, B, C, h0t, segment, chunk)
    return y, last.transpose(1, 2)
