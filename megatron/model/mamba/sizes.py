"""Sizes of GPT-NeoX's Mamba layer (fixed in GPT-NeoX except the inner width)."""

from __future__ import annotations

import math

from megatron.model.config import GPTModelConfig

D_STATE = 16
"""SSM state dimensions per channel."""
D_CONV = 4
"""Width of the causal depthwise convolution."""


def mamba_inner_size(cfg: GPTModelConfig) -> int:
    """``d_inner``: ``intermediate_size``, else ``int((expansion_factor or 2) · hidden_size)`` (GPT-NeoX)."""
    if cfg.intermediate_size:
        return cfg.intermediate_size
    return int((cfg.expansion_factor or 2) * cfg.hidden_size)


def mamba_dt_rank(cfg: GPTModelConfig) -> int:
    """Rank of the Δ projection: ``⌈hidden_size / 16⌉``."""
    return math.ceil(cfg.hidden_size / 16)
