"""MLP activations of GPT-NeoX, including the gated variants (``x, gate = chunk(y, 2)`` → ``act(gate) · x``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.model.config import GPTModelConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximate GELU (what GPT-NeoX's ``bias_gelu_fusion`` computes; HF ``gelu_new``/``gelu_fast``)."""
    return F.gelu(x, approximate="tanh")


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU written with erf (GPT-NeoX ``onnx_safe``)."""
    return x * 0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def get_activation(cfg: GPTModelConfig) -> Activation:
    """The element-wise function of ``cfg.activation`` (for gated ones: the function applied to the gate)."""
    kind = cfg.activation
    if kind in ("gelu", "geglu"):
        if cfg.onnx_safe:
            return erf_gelu
        return gelu_tanh if cfg.bias_gelu_fusion else F.gelu
    table: dict[str, Activation] = {
        "relu": F.relu,
        "reglu": F.relu,
        "silu": F.silu,
        "swish": F.silu,
        "swiglu": F.silu,
        "mish": F.mish,
        "softsign": F.softsign,
        "glu": torch.sigmoid,
        "bilinear": _identity,
    }
    if kind not in table:
        raise ValueError(f"activation={kind!r} is not supported")
    return table[kind]


def apply_activation(y: torch.Tensor, bias: torch.Tensor | None, fn: Activation, gated: bool) -> torch.Tensor:
    """``fn(y + bias)``; gated: ``y`` is ``[.., 2f]`` = ``[x | gate]`` and the result is ``fn(gate) · x``."""
    if bias is not None:
        y = y + bias
    if not gated:
        return fn(y)
    x, gate = torch.chunk(y, 2, dim=-1)
    return fn(gate) * x
