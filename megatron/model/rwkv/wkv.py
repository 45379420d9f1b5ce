"""RWKV-6's WKV operator in plain PyTorch: chunked for training and prefill, one step for generation.

Per head, with ``N = head_size``, the state ``S`` is ``[N (key), N (value)]`` and, for t = 0, 1, ...::

    y_t     = r_t · (diag(u) k_t v_tᵀ + S_t)          # y_t[j] = Σ_i r_t[i] (u[i] k_t[i] v_t[j] + S_t[i, j])
    S_{t+1} = diag(w_t) S_t + k_t v_tᵀ,   w_t = exp(-exp(w_raw_t)) ∈ (0, 1)

(GPT-NeoX's ``wkv6_cuda.cu`` forward, ``S_0 = 0``). The chunked form splits the sequence into chunks of ``chunk``
tokens. With ``a_t = Σ_{j<t} log w_j`` inside a chunk (``a_0 = 0``, every ``log w ≤ 0``)::

    y_t = (r_t ⊙ e^{a_t}) · S_0  +  Σ_{s<t} (Σ_i r_t[i] k_s[i] e^{a_t[i] - a_{s+1}[i]}) v_s  +  (r_t ⊙ u ⊙ k_t)·1 v_t
    S_L = diag(e^{a_L}) S_0 + Σ_s diag(e^{a_L - a_{s+1}}) k_s v_sᵀ

Every exponent is a sum of log-decays over a span (``≤ 0``); pairs with ``s ≥ t`` are masked to ``-inf`` before
``exp``, so nothing overflows whatever the chunk size and decay (the factored form ``(r e^{a}) (k e^{-a})ᵀ`` would
overflow fp32 once a chunk's decay passes e^88). The price is a ``[.., chunk, chunk, N]`` tensor per chunk, so chunks
stay small (8 by default). The state carried across chunks is a linear recurrence over the chunks
(:func:`~megatron.model.linear_scan.linear_scan`), so there is no Python loop over chunks either. Step log-decays are floored at -30 (:data:`LOG_DECAY_FLOOR`). Half-precision inputs are computed in fp32 (as the CUDA kernel does); the output has ``r``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.linear_scan import linear_scan

DEFAULT_CHUNK = 8
LOG_DECAY_FLOOR = -30.0
"""Step log-decays below this are raised to it (decay e^-30 ≈ 1e-13 instead of less: far below fp32's resolution
of the state it scales). Without the floor one huge decay (``exp(w_raw)`` in the millions) makes the chunk's running
sums of log-decays so large that fp32 loses the small differences of the later tokens (errors of several percent)."""


def log_decay(w: torch.Tensor) -> torch.Tensor:
    """``log w_t = -exp(w_raw)`` (fp32 at least), floored at :data:`LOG_DECAY_FLOOR`."""
    return (-torch.exp(w.to(_compute_dtype(w)))).clamp(min=LOG_DECAY_FLOOR)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (as the CUDA kernel), else the input's own (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def wkv_chunked(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [B, T, H, N], final state [B, H, N, N])`` of the WKV recurrence (see the module docstring).

    ``r, k, v, w`` ``[B, T, H, N]`` (``w`` the raw decay: the step decay is ``exp(-exp(w))``), ``u`` ``[H, N]``,
    ``state`` ``[B, H, N, N]`` (None: zeros) carried in from earlier tokens.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    out_dtype, dt = r.dtype, _compute_dtype(r)
    b, t, h, n = r.shape
    r, k, v, u = r.to(dt), k.to(dt), v.to(dt), u.to(dt)
    logw = log_decay(w)
    pad = (-t) % chunk
    if pad:  # padded steps: r = k = v = 0 (no output, no state change), decay 1 (log 0)
        r, k, v, logw = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (r, k, v, logw))
    nc = (t + pad) // chunk
    # [C, B, H, L, N]: the sequence cut into C chunks of L tokens, chunks outermost and contiguous, so every batched
    # matmul below reads its operands in place and the scan over chunks reads whole states
    r, k, v, logw = (x.view(b, nc, chunk, h, n).permute(1, 0, 3, 2, 4).contiguous() for x in (r, k, v, logw))
    a = torch.cumsum(logw, dim=3)  # a[.., t] = Σ_{j<=t} log w_j (inclusive): a_{t+1} of the docstring
    a_excl = a - logw  # a_t of the docstring (exclusive)

    # inside each chunk: att[t, s] = Σ_i r_t[i] k_s[i] exp(a_t[i] - a_{s+1}[i]) for s < t
    diff = a_excl.unsqueeze(4) - a.unsqueeze(3)  # [C, B, H, L(t), L(s), N]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-1)
    decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
    att = (r.unsqueeze(4) * k.unsqueeze(3) * decay).sum(-1)  # [C, B, H, L(t), L(s)]
    y = att @ v + (r * u[:, None, :] * k).sum(-1, keepdim=True) * v

    # across chunks: the state after chunk c is S_{c+1} = diag(e^{a_L}) S_c + Σ_s diag(e^{a_L - a_{s+1}}) k_s v_sᵀ,
    # a first-order linear recurrence over the chunks (megatron/model/linear_scan.py), its inputs one batched matmul
    r_in = r * torch.exp(a_excl)  # what the chunk's start state contributes: (r_t ⊙ e^{a_t}) · S_c
    k_out = k * torch.exp(a[:, :, :, -1:] - a)  # k_s ⊙ e^{a_L - a_{s+1}}
    chunk_decay = torch.exp(a[:, :, :, -1]).unsqueeze(-1).expand(nc, b, h, n, n)  # diag(e^{a_L}) on the key axis
    s0 = state.to(dt) if state is not None else r.new_zeros(b, h, n, n)
    states = linear_scan(chunk_decay, k_out.transpose(-1, -2) @ v, s0)  # [C, B, H, N, N]: after each chunk
    inter = torch.cat([(r_in[0] @ s0).unsqueeze(0), r_in[1:] @ states[:-1]])
    y = (y + inter).permute(1, 0, 3, 2, 4).reshape(b, nc * chunk, h, n)[:, :t]
    return y.to(out_dtype), states[-1]


def wkv_step(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``r, k, v, w`` ``[B, H, N]``, ``u`` ``[H, N]``, ``state`` ``[B, H, N, N]`` →
    ``(y [B, H, N], next state)``."""
    out_dtype, dt = r.dtype, _compute_dtype(r)
    r, k, v, u, state = r.to(dt), k.to(dt), v.to(dt), u.to(dt), state.to(dt)
    kv = k.unsqueeze(-1) * v.unsqueeze(-2)  # [B, H, N, N]
    y = (r.unsqueeze(-1) * (u[None, :, :, None] * kv + state)).sum(-2)
    state = torch.exp(log_decay(w)).unsqueeze(-1) * state + kv
    return y.to(out_dtype), state
