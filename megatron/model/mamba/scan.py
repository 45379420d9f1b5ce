"""Mamba's selective scan (S6) in plain PyTorch: a chunked parallel form for training, a one-token step for decoding.

The recurrence, per batch ``b``, channel ``d`` and state dimension ``n`` (Mamba paper, Algorithm 2)::

    Δ_t = softplus(δ_t + δ_bias)            h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t
    y_t = C_t · h_t + D u_t                  out_t = y_t ⊙ silu(z_t)

:func:`selective_scan` forms ``exp(Δ_t A)`` and ``Δ_t B_t u_t`` for every token (``[l, b, d, n]``, time first)
and runs the recurrence with :func:`megatron.model.linear_scan.linear_scan`: linear work, about ``2·√l`` Python steps
on whole chunks, no exponent beyond ``Δ_t A ≤ 0`` (nothing overflows however strong the decay), and a backward that
is the same recurrence run backwards. Activation memory: the decays, the inputs' and the states ``[l, b, d, n]``.
Everything is computed in fp32; the output has ``u``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.linear_scan import linear_scan


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
    dt_l = dt.permute(2, 0, 1).contiguous()  # [l, b, d]
    decay = torch.exp(dt_l[..., None] * A.float())  # exp(Δ_t A) [l, b, d, n]
    du = (dt * uf).permute(2, 0, 1)[..., None]  # Δ_t u_t [l, b, d, 1]
    dbu = du * B.float().permute(2, 0, 1)[:, :, None, :]  # Δ_t B_t u_t [l, b, d, n]
    state = initial_state.float() if initial_state is not None else uf.new_zeros(b, d, n)
    h = linear_scan(decay, dbu, state, chunk_size)  # [l, b, d, n]
    y = (h * C.float().permute(2, 0, 1)[:, :, None, :]).sum(-1).permute(1, 2, 0)  # C_t · h_t [b, d, l]
    return _gate(y, uf, D, z).to(dtype_in), h[-1]


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
