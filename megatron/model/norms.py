"""Normalisation layers with GPT-NeoX parameter names: LayerNorm (``weight``/``bias``), RMSNorm (``scale``),
ScaleNorm (``g``), and a non-parametric LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTModelConfig


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


NORM_CLASSES = (LayerNorm, RMSNorm, ScaleNorm, NonParametricLayerNorm)


Norm = LayerNorm | RMSNorm | ScaleNorm | NonParametricLayerNorm


def build_norm(cfg: GPTModelConfig, dim: int | list[int] | None = None) -> Norm:
    """The norm selected by ``cfg.norm`` over ``dim`` (default ``hidden_size``) with its epsilon."""
    dim = cfg.hidden_size if dim is None else dim
    eps = cfg.norm_epsilon
    if cfg.norm in ("layernorm", "te_layernorm"):
        return LayerNorm(dim, eps=eps, bias=cfg.use_bias_in_norms, dtype=cfg.params_dtype)
    if cfg.norm in ("rmsnorm", "te_rmsnorm"):
        return RMSNorm(dim, eps=eps, dtype=cfg.params_dtype)
    if cfg.norm == "scalenorm":
        return ScaleNorm(dim, eps=eps, dtype=cfg.params_dtype)
    if cfg.norm == "non_parametric_layernorm":
        return NonParametricLayerNorm(dim, eps=eps)
    raise ValueError(f"norm={cfg.norm!r} is not supported")
