"""Mamba's selective scan (S6) in plain PyTorch: a chunked parallel form for training, a one-token step for decoding.

The recurrence, per batch ``b``, channel ``d`` and state dimension ``n`` (Mamba paper, Algorithm 2)::

    Δ_t = softplus(δ_t + δ_bias)            h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t
    y_t = C_t · h_t + D u_t                  out_t = y_t ⊙ silu(z_t)

:func:`selective_scan` runs the recurrence time-first with :func:`~megatron.model.mamba.segmented.segmented_scan`:
segments of 64 tokens, each a chunked linear scan (:mod:`megatron.model.linear_scan`: linear work, no exponent beyond
``Δ_t A ≤ 0``, so nothing overflows however strong the decay), with its own backward that recomputes each segment's
``[T, b, n, d]`` decays and states from the segment's start state. Activation memory: the ``[l, b, d]`` and
``[l, b, n]`` inputs and one state per segment, not the ``[l, b, d, n]`` tensors.
Everything is computed in fp32; the output has ``u``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.mamba.segmented import segmented_scan


def discretized_delta(delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    """``softplus(delta + delta_bias)`` in fp32 (``delta`` ``[b, d, l]`` or ``[b, d]``, ``delta_bias`` ``[d]``)."""
    delta = delta.float()
    if delta_bias is not None:
        bias = delta_bias.float()
        delta = delta + (bias[..., None] if delta.dim() == 3 else bias)
    return F.softplus(delta) if delta_softplus else delta


def _gate(y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + D u) ⊙ silu(z)``; ``D`` broadcast over the channel dimension 1."""
    if D is not None:
        shape = (-1,) + (1,) * (u.dim() - 2)
        y = y + u * D.float().reshape(shape)
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, d, l] in u.dtype, last state [b, d, n] fp32)``, mamba_ssm's ``selective_scan`` signature.

    ``u``, ``delta``, ``z``: ``[b, d, l]``; ``A``: ``[d, n]``; ``B``, ``C``: ``[b, n, l]`` (input-dependent);
    ``D``, ``delta_bias``: ``[d]``; ``initial_state``: ``[b, d, n]`` (zeros when None).
    """
    dtype_in = u.dtype
    b, d, _ = u.shape
    n = A.shape[1]
    uf = u.float()
    dt = discretized_delta(delta, delta_bias, delta_softplus)
    # time first, so that the scan's steps read contiguous [b, d, n] slices
    dt_l, u_l = (x.permute(2, 0, 1).contiguous() for x in (dt, uf))  # [l, b, d]
    B_l, C_l = (x.float().permute(2, 0, 1).contiguous() for x in (B, C))  # [l, b, n]
    state = initial_state.float() if initial_state is not None else uf.new_zeros(b, d, n)
    y, last = segmented_scan(dt_l, u_l, A.float(), B_l, C_l, state, chunk=chunk_size)  # y: C_t · h_t [l, b, d]
    return _gate(y.permute(1, 2, 0), uf, D, z).to(dtype_in), last


def selective_state_step(
    state: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: ``(out [b, d] in u.dtype, new state [b, d, n] fp32)``.

    ``state`` ``[b, d, n]``; ``u``, ``delta``, ``z`` ``[b, d]``; ``B``, ``C`` ``[b, n]``.
    """
    dt = discretized_delta(delta, delta_bias, delta_softplus)
    uf = u.float()
    new_state = torch.exp(dt[..., None] * A.float()) * state.float() + (dt * uf)[..., None] * B.float()[:, None]
    y = torch.einsum("bdn,bn->bd", new_state, C.float())
    return _gate(y, uf, D, z).to(u.dtype), new_state
