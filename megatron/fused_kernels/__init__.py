"""GPT-NeoX's ``megatron.fused_kernels``: ``load()`` builds its CUDA softmax/rotary kernels there. neox-forge has
no separately built kernels (the model's attention runs on PyTorch/flash-attn ops), so both calls succeed and
do nothing; scripts that call them before training keep working."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load(neox_args: Any = None) -> None:
    """Nothing to build (GPT-NeoX compiles its fused CUDA kernels here)."""
    del neox_args
    logger.info("fused_kernels.load: neox-forge has no separately built kernels; nothing to build")


def load_fused_kernels() -> None:
    """Nothing to import: the fused operations are PyTorch's (GPT-NeoX imports its compiled modules here)."""
