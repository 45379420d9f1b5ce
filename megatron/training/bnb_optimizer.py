"""``use_bnb_optimizer``: bitsandbytes' 8-bit Adam (``bnb.optim.Adam8bit``), as GPT-NeoX builds it for ``adam``.

bitsandbytes keeps Adam's two moments as 8-bit block-wise quantized tensors (``state1``/``state2``, uint8, with
per-block ``absmax``) for tensors of at least ``min_8bit_size`` (4096) elements, and in fp32 for smaller ones. Since
0.49 its CPU backend runs the 8-bit optimizers without a GPU (tested: ``tests/e2e/test_bnb_optimizer.py``).
bitsandbytes is an optional package (``requirements/requirements-bnb.txt``); without it the key fails in one line.
"""

from __future__ import annotations

from typing import Any

from megatron.neox_arguments.errors import ConfigError

INSTALL = "pip install -r requirements/requirements-bnb.txt"


def adam8bit(groups: list[dict[str, Any]], *, lr: float, betas: tuple, eps: float, **params: Any) -> Any:
    """``bitsandbytes.optim.Adam8bit`` over ``groups`` (their ``weight_decay`` kept per group)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ConfigError(f"use_bnb_optimizer: bitsandbytes is not installed ({e}); {INSTALL}") from None
    params.pop("adam_w_mode", None)  # DeepSpeed FusedAdam's flag; bitsandbytes' Adam has its own update
    return bnb.optim.Adam8bit(groups, lr=lr, betas=betas, eps=eps, **params)
