"""Weight initialisers of GPT-NeoX (``init_method`` / ``output_layer_init_method``).

Each returns a callable ``init(tensor)`` that fills the FULL fp32 master weight in place from the current torch
default RNG (the mpu layers call it on the full tensor and keep their shard, so init is TP-layout invariant). On
a meta tensor (the model built on the meta device to count its parameters) they do nothing: there are no values,
and torch's meta random fills run Python decompositions that import ``torch._dynamo`` (~1 s of ``--plan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron.model.config import GPTModelConfig

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def normal_init(sigma: float) -> InitMethod:
    """N(0, sigma²)."""

    def init(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:  # no values to draw (module docstring)
            return t
        return torch.nn.init.normal_(t, mean=0.0, std=sigma)

    return init


def _orthogonal(n_layers: int = 1) -> InitMethod:
    gain = math.sqrt(2.0 / n_layers)

    def init(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        return torch.nn.init.orthogonal_(t, gain=gain)

    return init


def _xavier(kind: str) -> InitMethod:
    def init(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        if kind == "uniform":
            return torch.nn.init.xavier_uniform_(t)
        return torch.nn.init.xavier_normal_(t)

    return init


def get_init_method(name: str, sigma: float, num_layers: int, hidden_size: int) -> InitMethod:
    """The GPT-NeoX initialiser ``name`` for std ``sigma`` (``init_method_std``), depth L and width h.

    normal σ; scaled_normal σ/√(2L); single_residual_scaled_normal σ/√L; small_init √(2/(5h));
    wang_init 2/(L·√h); orthogonal gain √2 (GPT-NeoX's `orthogonal` always raises: it passes use_mup as the
    layer count; we build its evident intent, L = 1); scaled_orthogonal gain √(2/L); xavier_uniform / xavier_normal.
    """
    if name == "normal":
        return normal_init(sigma)
    if name == "scaled_normal":
        return normal_init(sigma / math.sqrt(2.0 * num_layers))
    if name == "single_residual_scaled_normal":
        return normal_init(sigma / math.sqrt(num_layers))
    if name == "small_init":
        return normal_init(math.sqrt(2.0 / (5.0 * hidden_size)))
    if name == "wang_init":
        return normal_init(2.0 / (num_layers * math.sqrt(hidden_size)))
    if name == "orthogonal":
        return _orthogonal(1)
    if name == "scaled_orthogonal":
        return _orthogonal(num_layers)
    if name == "xavier_uniform":
        return _xavier("uniform")
    if name == "xavier_normal":
        return _xavier("normal")
    raise ValueError(f"init method {name!r} is unknown")


def init_methods(cfg: GPTModelConfig) -> tuple[InitMethod, InitMethod]:
    """``(init_method, output_layer_init_method)`` for a ``GPTModelConfig``."""
    args = (cfg.init_method_std, cfg.num_layers, cfg.hidden_size)
    return get_init_method(cfg.init_method, *args), get_init_method(cfg.output_layer_init_method, *args)
