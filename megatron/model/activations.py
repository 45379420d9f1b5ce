"""MLP activations of GPT-NeoX, including the gated variants (``x, gate = chunk(y, 2)`` → ``act(gate) · x``).

``ACTIVATIONS`` holds one entry per ``activation`` value: the element-wise function (chosen from the config, for
GELU's variants) and whether the MLP is gated. ``GPTModelConfig.is_gated``, the MLP and MoE experts read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.model.variant_config import ActivationConfig
from megatron.registry import Registry

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximate GELU (what GPT-NeoX's ``bias_gelu_fusion`` computes; HF ``gelu_new``/``gelu_fast``)."""
    return F.gelu(x, approximate="tanh")


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU written with erf (GPT-NeoX ``onnx_safe``)."""
    return x * 0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class ActivationSpec:
    """One ``activation`` value."""

    function: Callable[[ActivationConfig], Activation]
    """``cfg`` -> the element-wise function (for gated ones: the function applied to the gate)."""
    gated: bool
    """The MLP's first projection produces ``[x | gate]`` and the output is ``function(gate) · x``."""


ACTIVATIONS: Registry[ActivationSpec] = Registry("activation")


def _gelu(cfg: ActivationConfig) -> Activation:
    if cfg.onnx_safe:
        return erf_gelu
    return gelu_tanh if cfg.bias_gelu_fusion else F.gelu


def _fixed(fn: Activation) -> Callable[[ActivationConfig], Activation]:
    return lambda cfg: fn


ACTIVATIONS.register("gelu", ActivationSpec(_gelu, gated=False))
ACTIVATIONS.register("geglu", ActivationSpec(_gelu, gated=True))
ACTIVATIONS.register("relu", ActivationSpec(_fixed(F.relu), gated=False))
ACTIVATIONS.register("softsign", ActivationSpec(_fixed(F.softsign), gated=False))
ACTIVATIONS.register("swish", ActivationSpec(_fixed(F.silu), gated=False))
ACTIVATIONS.register("mish", ActivationSpec(_fixed(F.mish), gated=False))
ACTIVATIONS.register("silu", ActivationSpec(_fixed(F.silu), gated=False))
ACTIVATIONS.register("reglu", ActivationSpec(_fixed(F.relu), gated=True))
ACTIVATIONS.register("swiglu", ActivationSpec(_fixed(F.silu), gated=True))
ACTIVATIONS.register("bilinear", ActivationSpec(_fixed(_identity), gated=True))
ACTIVATIONS.register("glu", ActivationSpec(_fixed(torch.sigmoid), gated=True))


def get_activation(cfg: ActivationConfig) -> Activation:
    """The element-wise function of ``cfg.activation`` (for gated ones: the function applied to the gate)."""
    return ACTIVATIONS.get(cfg.activation).function(cfg)


def apply_activation(y: torch.Tensor, bias: torch.Tensor | None, fn: Activation, gated: bool) -> torch.Tensor:
    """``fn(y + bias)``; gated: ``y`` is ``[.., 2f]`` = ``[x | gate]`` and the result is ``fn(gate) · x``."""
    if bias is not None:
        y = y + bias
    if not gated:
        return fn(y)
    x, gate = torch.chunk(y, 2, dim=-1)
    return fn(gate) * x
