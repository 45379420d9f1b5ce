"""The recurrent state of RWKV blocks for generation: per block, the last token each mixer saw (token shift) and the
WKV state."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RWKVLayerState:
    """One block's state after the tokens seen so far; ``None`` before the first token."""

    att_shift: torch.Tensor | None = None
    """Time-mix input of the last token ``[b, h]``."""
    ffn_shift: torch.Tensor | None = None
    """Channel-mix input of the last token ``[b, h]``."""
    wkv: torch.Tensor | None = None
    """WKV state ``[b, heads, head_size, head_size]`` (fp32)."""
