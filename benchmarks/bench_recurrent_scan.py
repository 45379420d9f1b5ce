"""Chunked recurrences vs a per-token loop: Mamba's selective scan and RWKV-6's WKV, fp32, forward + backward.

    python benchmarks/bench_recurrent_scan.py [--seq 2048] [--rounds 5] [--save]

Ours: :func:`megatron.model.mamba.scan.selective_scan` (chunks of 8 tokens) and
:func:`megatron.model.rwkv.wkv.wkv_chunked` (chunks of 8), the training paths of the Mamba and RWKV layers (both
run under autograd in training, so each side is timed forward + backward). Baseline: the recurrence written token
by token from its definition (the module docstrings), one Python iteration per token. The loop reads each token's
slice through ``unbind`` (its backward is one ``stack``; indexing ``x[..., t]`` in a loop would make the backward
quadratic in the length, a slower baseline than the recurrence needs).

Shapes: Mamba ``u [b, d_inner, seq]`` with ``d_state`` 16 (``--mamba-batch`` 1, ``--mamba-channels`` 512: the inner
width of a d=256 model); RWKV ``r, k, v, w [b, seq, heads, 64]`` (``--rwkv-batch`` 1, ``--rwkv-heads`` 4: a d=256
model). Gate: outputs, last states and every input gradient equal (largest difference ≤ 1e-4 of the largest
magnitude, fp32) before any timing. Rounds alternate (ours, then the loop); each operator's ratio is the median of
the per-round loop time / our time; the printed ratio is the smaller of the two.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, median, median_ratio, now

from megatron.model.mamba.scan import selective_scan
from megatron.model.rwkv.wkv import log_decay, wkv_chunked

Tensors = tuple[torch.Tensor, ...]
REL_TOL = 1e-4


def mamba_loop(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    delta_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan one token at a time: ``h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t``, ``y_t = C_t·h_t + D u_t``,
    ``out_t = y_t silu(z_t)`` with ``Δ = softplus(δ + bias)``. Returns ``(out [b, d, l], last state [b, d, n])``."""
    dt = F.softplus(delta + delta_bias[:, None])  # [b, d, l]
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for dt_t, u_t, b_t, c_t in zip(dt.unbind(-1), u.unbind(-1), B.unbind(-1), C.unbind(-1), strict=True):
        h = torch.exp(dt_t[..., None] * A) * h + (dt_t * u_t)[..., None] * b_t[:, None, :]
        ys.append((h * c_t[:, None, :]).sum(-1))
    y = torch.stack(ys, -1) + u * D[:, None]
    return y * F.silu(z), h


def wkv_loop(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV one token at a time: ``y_t = r_t·(diag(u) k_t v_tᵀ + S_t)``, ``S_{t+1} = diag(w_t) S_t + k_t v_tᵀ`` with
    ``w_t = exp(-exp(w_raw_t))`` (step log-decay floored as ours). Returns ``(y [B, T, H, N], state [B, H, N, N])``."""
    b, _, h, n = r.shape
    s = r.new_zeros(b, h, n, n)
    decay = torch.exp(log_decay(w))
    ys = []
    for r_t, k_t, v_t, w_t in zip(r.unbind(1), k.unbind(1), v.unbind(1), decay.unbind(1), strict=True):
        kv = k_t[..., :, None] * v_t[..., None, :]
        ys.append((r_t[..., :, None] * (u[None, :, :, None] * kv + s)).sum(-2))
        s = w_t[..., None] * s + kv
    return torch.stack(ys, 1), s


def mamba_inputs(b: int, d: int, length: int, seed: int = 0) -> Tensors:
    """Inputs as a Mamba layer gives them (Δ bias from the layer's init range, A = -exp(A_log) with S4D-real A_log)."""
    g = torch.Generator().manual_seed(seed)
    u, delta, z = (torch.randn(b, d, length, generator=g) for _ in range(3))
    A = -torch.arange(1, 17, dtype=torch.float32).repeat(d, 1) * torch.exp(0.1 * torch.randn(d, 16, generator=g))
    B, C = (torch.randn(b, 16, length, generator=g) for _ in range(2))
    D = torch.ones(d) + 0.1 * torch.randn(d, generator=g)
    dt = 0.001 * torch.exp(torch.rand(d, generator=g) * math.log(100.0))  # log-uniform in [0.001, 0.1]
    delta_bias = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt), the layer's Δ bias init
    return u, 0.1 * delta, A, B, C, D, z, delta_bias


def wkv_inputs(b: int, length: int, heads: int, n: int = 64, seed: int = 0) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(b, length, heads, n, generator=g) * 0.5 for _ in range(3))
    w = torch.randn(b, length, heads, n, generator=g) * 0.5 - 1.0
    u = torch.randn(heads, n, generator=g) * 0.5
    return r, k, v, w, u


def ours_mamba(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    delta_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)


def ours_wkv(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return wkv_chunked(r, k, v, w, u)


def fwd_bwd(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: Tensors, gy: torch.Tensor) -> Tensors:
    """Forward and backward of ``fn``; returns output, last state and the gradients of every float input."""
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    y, state = fn(*leaves)
    grads = torch.autograd.grad((y * gy).sum() + state.sum(), leaves)
    return (y.detach(), state.detach(), *grads)


def max_rel_error(ours: Tensors, ref: Tensors) -> float:
    """Largest ``max|a - b| / max|b|`` over the paired tensors."""
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(ours, ref, strict=True))


def compare(name: str, ours: Callable, loop: Callable, inputs: Tensors, rounds: int) -> dict:
    y_shape = ours(*inputs)[0].shape
    gy = torch.randn(y_shape, generator=torch.Generator().manual_seed(1))
    err = max_rel_error(fwd_bwd(ours, inputs, gy), fwd_bwd(loop, inputs, gy))
    if not err <= REL_TOL:  # the gate
        raise SystemExit(f"gate failed: {name}: chunked vs loop differ by {err:.2e} of the largest value")
    t_ours, t_loop = [], []
    for _ in range(rounds):
        start = now()
        fwd_bwd(ours, inputs, gy)
        mid = now()
        fwd_bwd(loop, inputs, gy)
        t_ours.append(mid - start)
        t_loop.append(now() - mid)
        print(f"{name} round: chunked {t_ours[-1]:.3f} s, loop {t_loop[-1]:.3f} s", flush=True)
    return {
        "ratio": round(median_ratio(t_loop, t_ours), 3),
        "chunked_s": round(median(t_ours), 4),
        "loop_s": round(median(t_loop), 4),
        "per_round_ratios": [round(a / b, 3) for a, b in zip(t_loop, t_ours, strict=True)],
        "max_rel_error": float(f"{err:.3g}"),
        "shape": list(inputs[0].shape),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mamba-batch", type=int, default=1)
    p.add_argument("--mamba-channels", type=int, default=512)
    p.add_argument("--rwkv-batch", type=int, default=1)
    p.add_argument("--rwkv-heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--save", action="store_true")
    a = p.parse_args()
    report = Report("recurrent_scan", " ".join(["python", *sys.argv]), seq=a.seq, rounds=a.rounds, precision="fp32")
    results = {
        "mamba_selective_scan": compare(
            "mamba", ours_mamba, mamba_loop, mamba_inputs(a.mamba_batch, a.mamba_channels, a.seq), a.rounds
        ),
        "rwkv6_wkv": compare("rwkv", ours_wkv, wkv_loop, wkv_inputs(a.rwkv_batch, a.seq, a.rwkv_heads), a.rounds),
    }
    for name, res in results.items():
        print(name, res, flush=True)
    report.finish(
        min(r["ratio"] for r in results.values()),
        "per-token loop / chunked time, forward + backward; the smaller of Mamba's scan and RWKV-6's WKV",
        save=a.save,
        **results,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
