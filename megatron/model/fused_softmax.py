"""GPT-NeoX's ``megatron.model.fused_softmax`` names: ``FusedScaleMaskSoftmax`` (scale, mask, softmax) and
``SoftmaxFusionTypes``. GPT-NeoX runs the first two fusion types through its CUDA kernels when the shapes allow
and falls back to PyTorch otherwise; here every type computes the same function with PyTorch ops."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn


class SoftmaxFusionTypes(enum.Enum):
    """GPT-NeoX's fusion choices: causal mask, general mask, no fusion."""

    upper_triang = 1
    general = 2
    none = 3


class FusedScaleMaskSoftmax(nn.Module):
    """``softmax(mask_func(x * scale, mask))`` over the last dimension of ``[b, heads, sq, sk]`` scores, computed
    in fp32 for fp16/bf16 inputs when ``softmax_in_fp32`` (GPT-NeoX's constructor arguments)."""

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        fusion_type: SoftmaxFusionTypes,
        mask_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        softmax_in_fp32: bool,
        scale: float | None,
    ) -> None:
        super().__init__()
        if not isinstance(fusion_type, SoftmaxFusionTypes):
            raise ValueError(f"fusion_type must be a SoftmaxFusionTypes, got {fusion_type!r}")
        if scale is not None and not softmax_in_fp32:
            raise ValueError("FusedScaleMaskSoftmax: a scale needs softmax_in_fp32")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.fusion_type = fusion_type
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax expects [b, heads, sq, sk] scores, got shape {tuple(input.shape)}")
        dtype = input.dtype
        x = input.float() if self.input_in_float16 and self.softmax_in_fp32 else input
        if self.scale is not None:
            x = x * self.scale
        if mask is not None:
            x = self.mask_func(x, mask)
        probs = torch.softmax(x, dim=-1)
        return probs.to(dtype) if self.input_in_float16 and self.softmax_in_fp32 else probs


def gpt2_attention_mask_func(attention_scores: torch.Tensor, ltor_mask: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's mask function for ``FusedScaleMaskSoftmax``: masked positions (``True``) get the dtype's lowest
    value, in place."""
    return attention_scores.masked_fill_(ltor_mask, torch.finfo(attention_scores.dtype).min)
