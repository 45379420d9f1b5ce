"""GPT-NeoX's gradient noise scale (``log_gradient_noise_scale``; McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"): the simple noise scale B_simple = tr(Σ) / |G|², estimated from a small batch (one
iteration, ``train_batch_size`` samples) and a large one (the mean gradient of ``gradient_noise_scale_n_batches``
consecutive iterations):

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

each smoothed by a bias-corrected exponential moving average (β 0.99, corrected with the count of iterations seen).
An iteration whose gradient is not finite is left out entirely. Logged as ``train/noise_scale`` every iteration once
the first estimate exists, as GPT-NeoX does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def ema(avg: float | None, beta: float, value: float, i: int) -> tuple[float, float]:
    """The running average and its bias-corrected value after the ``i``-th update (0-based)."""
    avg = beta * (avg or 0.0) + (1 - beta) * value
    return avg, avg / (1 - beta ** (i + 1))


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖t‖² in float64, on the CPU."""
    return sum((t.detach().double().pow(2).sum().cpu() for t in tensors), torch.zeros((), dtype=torch.float64))


class GradientNoiseScale:
    """Feed every iteration's gradients (the same list of tensors each time) to :meth:`update`; ``noise_scale`` is
    the latest estimate (``None`` before the first ``n_batches`` finite iterations). ``reduce`` sums a squared norm
    over the ranks that hold the other shards of the gradients (tensor-parallel shards); ``cpu_offload`` keeps the
    accumulated gradient on the CPU."""

    def __init__(
        self,
        batch_size_small: int,
        n_batches: int,
        beta: float = 0.99,
        cpu_offload: bool = False,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.batch_size_small, self.n_batches, self.beta = batch_size_small, n_batches, beta
        self.batch_size_large = batch_size_small * n_batches
        self.cpu_offload = cpu_offload
        self.reduce = reduce
        self.buffer: list[torch.Tensor] | None = None
        self.ema_scale: float | None = None
        self.ema_noise: float | None = None
        self.noise_scale: float | None = None
        self.n_updates = 0

    def update(self, grads: list[torch.Tensor], finite: bool | None = None) -> None:
        """One iteration's gradients; ``finite``: whether every rank's gradients are finite (computed here if
        ``None``)."""
        if finite is None:
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            return
        grads = [g.detach().float().to("cpu" if self.cpu_offload else g.device) for g in grads]
        if self.buffer is None:
            self.buffer = [g.clone() for g in grads]
        else:
            for acc, g in zip(self.buffer, grads, strict=True):
                acc.add_(g)
        if self.n_updates % self.n_batches == self.n_batches - 1:
            big = [acc / self.n_batches for acc in self.buffer]
            self.buffer = None
            g_big, g_small = squared_norm(big), squared_norm(grads)
            if self.reduce is not None:
                g_big, g_small = self.reduce(g_big), self.reduce(g_small)
            if not (torch.isfinite(g_big) and torch.isfinite(g_small)):
                return
            b_small, b_big = self.batch_size_small, self.batch_size_large
            noise = (b_big * float(g_big) - b_small * float(g_small)) / (b_big - b_small)  # |G|²
            scale = (float(g_small) - float(g_big)) / (1 / b_small - 1 / b_big)  # tr(Σ)
            self.ema_noise, noise = ema(self.ema_noise, self.beta, noise, self.n_updates)
            self.ema_scale, scale = ema(self.ema_scale, self.beta, scale, self.n_updates)
            self.noise_scale = scale / noise
        self.n_updates += 1
