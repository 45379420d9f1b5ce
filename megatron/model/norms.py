"""Normalisation layers with GPT-NeoX parameter names: LayerNorm (``weight``/``bias``), RMSNorm (``scale``),
ScaleNorm (``g``), and a non-parametric LayerNorm."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.variant_config import NormConfig
from megatron.registry import Registry


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (names ``weight``/``bias``); ``bias=False`` honours ``use_bias_in_norms``."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32: ``scale · x / sqrt(mean(x²) + eps)``, cast back to the input dtype."""

    def __init__(self, dim: int | list[int], eps: float = 1e-8, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dims = (dim,) if isinstance(dim, int) else tuple(dim)
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(self.dims, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the trailing ``len(self.dims)`` dims."""
        reduce = tuple(range(-len(self.dims), 0))
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=reduce, keepdim=True) + self.eps)
        return (self.scale.float() * normed).to(x.dtype)


class ScaleNorm(nn.Module):
    """ScaleNorm: ``g · x / max(‖x‖, eps)`` with one learned scalar ``g``."""

    def __init__(self, dim: int | list[int], eps: float = 1e-8, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dims = (dim,) if isinstance(dim, int) else tuple(dim)
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale each vector (over the trailing dims) to norm ``g``."""
        reduce = tuple(range(-len(self.dims), 0))
        norm = torch.linalg.vector_norm(x.float(), dim=reduce, keepdim=True).clamp(min=self.eps)
        return (x.float() / norm * self.g.float()).to(x.dtype)


class NonParametricLayerNorm(nn.Module):
    """LayerNorm without affine parameters."""

    def __init__(self, dim: int | list[int], eps: float = 1e-5) -> None:
        super().__init__()
        self.dims = (dim,) if isinstance(dim, int) else tuple(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardise over the trailing dims."""
        return F.layer_norm(x, self.dims, eps=self.eps)


Norm = LayerNorm | RMSNorm | ScaleNorm | NonParametricLayerNorm


@dataclass(frozen=True)
class NormSpec:
    """One ``norm`` type: its module class, the builder and which config key holds its epsilon."""

    cls: type[nn.Module]
    build: Callable[[NormConfig, int | list[int], float], nn.Module]
    """``(cfg, dim, epsilon)`` -> the norm over the trailing ``dim``."""
    epsilon_key: str
    """The GPTModelConfig field with this norm's epsilon."""


NORMS: Registry[NormSpec] = Registry("norm")


def _layernorm(cfg: NormConfig, dim: int | list[int], eps: float) -> nn.Module:
    return LayerNorm(dim, eps=eps, bias=cfg.use_bias_in_norms, dtype=cfg.params_dtype)


def _rmsnorm(cfg: NormConfig, dim: int | list[int], eps: float) -> nn.Module:
    return RMSNorm(dim, eps=eps, dtype=cfg.params_dtype)


def _scalenorm(cfg: NormConfig, dim: int | list[int], eps: float) -> nn.Module:
    return ScaleNorm(dim, eps=eps, dtype=cfg.params_dtype)


def _non_parametric(cfg: NormConfig, dim: int | list[int], eps: float) -> nn.Module:
    return NonParametricLayerNorm(dim, eps=eps)


NORMS.register("layernorm", NormSpec(LayerNorm, _layernorm, "layernorm_epsilon"))
NORMS.register("rmsnorm", NormSpec(RMSNorm, _rmsnorm, "rms_norm_epsilon"))
NORMS.register("non_parametric_layernorm", NormSpec(NonParametricLayerNorm, _non_parametric, "layernorm_epsilon"))
NORMS.register("scalenorm", NormSpec(ScaleNorm, _scalenorm, "scalenorm_epsilon"))
# TransformerEngine is not used: its norms are the plain equivalents (GPTModelConfig.from_neox_args warns).
NORMS.register("te_rmsnorm", NormSpec(RMSNorm, _rmsnorm, "rms_norm_epsilon"))
NORMS.register("te_layernorm", NormSpec(LayerNorm, _layernorm, "layernorm_epsilon"))


def build_norm(cfg: NormConfig, dim: int | list[int] | None = None) -> Norm:
    """The norm selected by ``cfg.norm`` over ``dim`` (default ``hidden_size``) with its epsilon."""
    spec = NORMS.get(cfg.norm)
    return cast(Norm, spec.build(cfg, cfg.hidden_size if dim is None else dim, getattr(cfg, spec.epsilon_key)))


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: a registered norm class, or any class named ``...Norm`` (torch's, TransformerEngine's)."""
    classes = tuple(spec.cls for _, spec in NORMS.items())
    return isinstance(module, classes) or type(module).__name__.lower().endswith("norm")
