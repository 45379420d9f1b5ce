"""Mamba's selective scan (S6) in plain PyTorch: a chunked parallel form for training, a one-token step for decoding.

The recurrence, per batch ``b``, channel ``d`` and state dimension ``n`` (Mamba paper, Algorithm 2)::

    Δ_t = softplus(δ_t + δ_bias)            h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t
    y_t = C_t · h_t + D u_t                  out_t = y_t ⊙ silu(z_t)

:func:`selective_scan` splits the sequence into chunks of ``chunk_size`` tokens. Inside a chunk it forms the
cumulative log-decays ``S_t = Σ_{k≤t} Δ_k A`` and evaluates every ``h_t`` at once as ``Σ_{k≤t} exp(S_t - S_k) Δ_k B_k
u_k`` (exponents ≤ 0: no overflow however long the sequence); the state at the end of each chunk is carried to the
next one, ``exp(S_t) h_in`` adding its contribution. The only Python loop is over chunks (``L / chunk_size``
iterations on ``[b, d, n]`` tensors), never over tokens. Work and activation memory are ``chunk_size`` times those
of the sequential form. Everything is computed in fp32; the output has ``u``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 8


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
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, d, l] in u.dtype, last state [b, d, n] fp32)``, mamba_ssm's ``selective_scan`` signature.

    ``u``, ``delta``, ``z``: ``[b, d, l]``; ``A``: ``[d, n]``; ``B``, ``C``: ``[b, n, l]`` (input-dependent);
    ``D``, ``delta_bias``: ``[d]``; ``initial_state``: ``[b, d, n]`` (zeros when None).
    """
    dtype_in = u.dtype
    b, d, length = u.shape
    n = A.shape[1]
    uf = u.float()
    dt = discretized_delta(delta, delta_bias, delta_softplus)
    t = max(1, min(chunk_size, length))
    chunks = -(-length // t)
    pad = chunks * t - length
    # padded steps have Δ = 0: decay exp(0) = 1 and no input, so the carried state passes through unchanged
    dt_p = F.pad(dt, (0, pad)).reshape(b, d, chunks, t)
    du_p = F.pad(dt * uf, (0, pad)).reshape(b, d, chunks, t)
    b_p = F.pad(B.float(), (0, pad)).reshape(b, n, chunks, t)
    c_p = F.pad(C.float(), (0, pad)).reshape(b, n, chunks, t)

    log_decay = torch.cumsum(dt_p[..., None] * A.float()[:, None, None, :], dim=3)  # S [b, d, c, t, n]
    dbu = du_p[..., None] * b_p.permute(0, 2, 3, 1)[:, None]  # Δ_k B_k u_k [b, d, c, t, n]
    causal = torch.ones(t, t, dtype=torch.bool, device=u.device).tril()
    seg = log_decay[..., :, None, :] - log_decay[..., None, :, :]  # S_t - S_k [b, d, c, t, k, n]
    decay = torch.exp(seg.masked_fill(~causal[:, :, None], float("-inf")))
    c_tn = c_p.permute(0, 2, 3, 1)  # [b, c, t, n]
    states = torch.einsum("bdctkn,bdckn->bdctn", decay, dbu)  # every h_t from a zero chunk start
    y = torch.einsum("bdctn,bctn->bdct", states, c_tn)

    ends = states[:, :, :, -1]  # [b, d, c, n]: each chunk's last state from a zero start
    chunk_decay = torch.exp(log_decay[..., -1, :])  # [b, d, c, n]
    state = initial_state.float() if initial_state is not None else uf.new_zeros(b, d, n)
    carried = []
    for c in range(chunks):
        carried.append(state)
        state = chunk_decay[:, :, c] * state + ends[:, :, c]
    h_in = torch.stack(carried, dim=2)  # [b, d, c, n]: the state entering each chunk
    y = y + torch.einsum("bdctn,bdcn,bctn->bdct", torch.exp(log_decay), h_in, c_tn)
    y = y.reshape(b, d, chunks * t)[..., :length]
    return _gate(y, uf, D, z).to(dtype_in), state


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
