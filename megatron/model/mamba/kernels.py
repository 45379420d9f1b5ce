"""Which implementation runs Mamba's causal conv1d and selective scan: mamba_ssm's / causal_conv1d's CUDA kernels
when ``mamba_*_fusion`` asks for them and they are importable with the tensors on a GPU, else the plain-PyTorch
path of :mod:`megatron.model.mamba.scan`. The choice is logged once per process."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


@functools.cache
def kernels_importable() -> tuple[bool, bool]:
    """``(mamba_ssm importable, causal_conv1d importable)``."""
    return (importlib.util.find_spec("mamba_ssm") is not None, importlib.util.find_spec("causal_conv1d") is not None)


@dataclass(frozen=True)
class MambaKernels:
    """The fused kernels a forward on ``device`` uses (None: the PyTorch path)."""

    selective_scan: Callable[..., Any] | None
    causal_conv1d: Callable[..., Any] | None


def choose_kernels(scan_fusion: bool, conv_fusion: bool, device: torch.device) -> MambaKernels:
    """The kernels for the given ``mamba_selective_scan_fusion`` / ``mamba_causal_conv_fusion`` (either is implied
    by ``mamba_inner_func_fusion``); logs once which path runs and why."""
    has_scan, has_conv = kernels_importable()
    on_gpu = device.type == "cuda"
    scan: Callable[..., Any] | None = None
    conv: Callable[..., Any] | None = None
    if scan_fusion and has_scan and on_gpu:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn  # type: ignore[import-not-found]

        scan = selective_scan_fn
    if conv_fusion and has_conv and on_gpu:
        from causal_conv1d import causal_conv1d_fn  # type: ignore[import-not-found]

        conv = causal_conv1d_fn
    why = "on a GPU" if on_gpu else "the tensors are not on a GPU"
    _log_once(
        "Mamba selective scan: "
        + (
            "mamba_ssm's selective_scan_fn"
            if scan
            else _fallback("mamba_selective_scan_fusion", scan_fusion, has_scan, why)
        )
    )
    _log_once(
        "Mamba causal conv1d: "
        + (
            "causal_conv1d's causal_conv1d_fn"
            if conv
            else _fallback("mamba_causal_conv_fusion", conv_fusion, has_conv, why)
        )
    )
    return MambaKernels(scan, conv)


def _fallback(key: str, asked: bool, importable: bool, why: str) -> str:
    if not asked:
        return f"the PyTorch path ({key} is off)"
    if not importable:
        return f"the PyTorch path ({key} is set, but its package is not installed)"
    return f"the PyTorch path ({key} is set, but {why})"
