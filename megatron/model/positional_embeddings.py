"""Positional encodings: learned, rotary (half-split, HF/GPT-NeoX convention), sinusoidal, ALiBi and T5 relative
bias; ``POSITION_EMBEDDINGS`` (end of file) says for each ``pos_emb`` value which of them the model builds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.variant_config import PositionEmbeddingConfig
from megatron.registry import Registry

InitMethod = Callable[[torch.Tensor], object]


class LearnedPositionEmbedding(nn.Module):
    """Replicated learned position table ``weight`` ``[max_position_embeddings, h]`` (drawn in fp32, then cast;
    the parameter is created in ``__init__`` so DeepSpeed ``zero.Init`` can partition it). Positions are shifted by
    ``opt_pos_emb_offset``."""

    def __init__(self, cfg: PositionEmbeddingConfig, init_method: InitMethod) -> None:
        super().__init__()
        master = torch.empty(cfg.max_position_embeddings, cfg.hidden_size, dtype=torch.float32)
        init_method(master)
        self.weight = nn.Parameter(master.to(cfg.params_dtype))
        # the table's length kept apart: under ZeRO-3 the partitioned weight is empty outside its gather
        self.offset, self.max_positions = cfg.opt_pos_emb_offset, cfg.max_position_embeddings

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[..., h]`` rows for integer ``position_ids`` (``dtype``: the parameter's own is kept)."""
        positions = position_ids + self.offset
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond max_position_embeddings={self.max_positions} "
                "(learned position embeddings)"
            )
        return F.embedding(positions, self.weight)


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the first ``dim`` dims of each head; ``inv_freq = 1/base^(2i/dim)``.

    ``forward(positions)`` returns ``(cos, sin)`` of shape ``[*positions.shape, dim]`` computed in fp32 (as HF
    does) and cast to ``dtype``; positions come from ``position_ids`` so packed/reset positions and KV-cache
    offsets are honoured.
    """

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, dim: int, base: float = 10000.0, save_inv_freq: bool = False) -> None:
        super().__init__()
        self.dim = dim
        if torch.empty(0).is_meta:  # built on the meta device (parameter counting): no values, and meta arithmetic
            inv_freq = torch.empty((dim + 1) // 2)  # would import torch._dynamo (~1 s of deepy.py --plan)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=save_inv_freq)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for integer ``positions``.

        The last result is reused while the same ``positions`` tensor (unchanged) comes back with equal ``inv_freq``
        values: every layer of one forward asks for the same tables (identical values, which never require grad;
        only the recomputation per layer is saved). Not while ``torch.compile`` traces (inductor fuses the tables).
        """
        return self._tables(positions, dtype, signed=False)

    def signed_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin')`` with the first half of ``sin'`` negated, sequence-first ``[s, b, 1, dim]`` for
        :func:`rotate_in_place` on ``[s, b, heads, hn]`` (cached alike)."""
        return self._tables(positions, dtype, signed=True)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        caching = not torch.compiler.is_compiling() and not self.inv_freq.requires_grad
        key = (
            (positions, 0 if positions.is_inference() else positions._version, dtype, self.dim, signed)
            if caching
            else ()
        )
        last = _LAST_ROTARY.get(signed) if caching else None
        if (
            last is not None
            and last[0][0] is positions
            and last[0][1:] == key[1:]
            and (last[1] is self.inv_freq or torch.equal(last[1], self.inv_freq))
        ):
            return last[2]
        freqs = positions[..., None].float() * self.inv_freq.float().to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if signed:
            sin = torch.cat((-sin[..., : freqs.shape[-1]], sin[..., freqs.shape[-1] :]), dim=-1)
            cos, sin = cos.transpose(0, 1).unsqueeze(2), sin.transpose(0, 1).unsqueeze(2)
        out = cos.to(dtype), sin.to(dtype)
        if caching:
            _LAST_ROTARY[signed] = (key, self.inv_freq, out)
        return out


_LAST_ROTARY: dict[bool, tuple] = {}  # per ``signed``: the last (key, inv_freq, (cos, sin)) of RotaryEmbedding


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (``cos``/``sin`` broadcast against ``x``)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """:func:`apply_rotary` written into ``x`` itself (no autograd): the same products and sums, so bitwise equal.

    ``signed_sin`` comes from :meth:`RotaryEmbedding.signed_tables`; ``rotate_half(x) * sin`` equals
    ``roll(x, half) * signed_sin`` exactly (a sign flip is exact), which saves the slices, negation and concatenations.
    """
    rot = cos.shape[-1]
    x_rot = x[..., :rot]
    turned = x_rot.roll(rot // 2, dims=-1).mul_(signed_sin)
    x_rot.mul_(cos).add_(turned)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed ``cat(sin, cos)`` of ``pos × inv_freq`` with ``inv_freq = 1/10000^(2i/h)``."""

    inv_freq: torch.Tensor  # a registered buffer

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        # persistent like GPT-NeoX's (its checkpoints carry ``position_embeddings.inv_freq``)
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[*positions.shape, dim]`` embeddings."""
        angles = positions[..., None].float() * self.inv_freq
        return torch.cat((angles.sin(), angles.cos()), dim=-1).to(dtype)


def alibi_slopes(num_heads: int) -> list[float]:
    """Standard ALiBi slopes (geometric ``2^(-8/n)``; non-powers of two interleave the next power's slopes)."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


class AliBi(nn.Module):
    """ALiBi bias ``-(i - j)·slope_head`` for this TP rank's heads (``[np, sq, sk]``, fp32)."""

    slopes: torch.Tensor  # a registered buffer

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        tp, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        per = mpu.divide(num_heads, tp)
        slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)[rank * per : (rank + 1) * per]
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bias for query positions ``q_pos`` [sq] and key positions ``k_pos`` [sk]."""
        dist = (q_pos[:, None] - k_pos[None, :]).clamp(min=0).float()  # [sq, sk]
        return -self.slopes[:, None, None] * dist[None]


def t5_relative_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal T5 bucketing of ``relative = k - q`` (only the past is bucketed; the future maps to bucket 0)."""
    n = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """T5 relative position bias (GPT-NeoX ``pos_emb: rpe``): weight ``[buckets, heads/tp]`` × ``scale``.

    The full ``[buckets, heads]`` table is drawn with ``init_method`` and this TP rank keeps its heads (the
    mpu API has no layer for it). One instance is shared by all layers, as in GPT-NeoX.
    """

    def __init__(
        self,
        num_heads: int,
        num_buckets: int,
        max_distance: int,
        scale: float,
        init_method: InitMethod,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        tp, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        per = mpu.divide(num_heads, tp)
        full = torch.empty(num_buckets, num_heads, dtype=torch.float32)
        init_method(full)
        self.weight = nn.Parameter(full[:, rank * per : (rank + 1) * per].contiguous().to(dtype))
        if tp > 1:
            marked: Any = self.weight  # ad-hoc TP attributes, read by name (see mpu.layers)
            marked.model_parallel = True
            marked.tensor_model_parallel = True
            marked.partition_dim = 1
            marked.partition_stride = 1
        self.num_buckets, self.max_distance, self.scale = num_buckets, max_distance, scale

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``[np, sq, sk]`` bias."""
        buckets = t5_relative_bucket(k_pos[None, :] - q_pos[:, None], self.num_buckets, self.max_distance)
        return (self.weight[buckets] * self.scale).permute(2, 0, 1).float()


@dataclass(frozen=True)
class PositionEmbeddingSpec:
    """What one ``pos_emb`` value adds to the model; every hook is optional (``none``: nothing)."""

    embedding: Callable[[PositionEmbeddingConfig, InitMethod], nn.Module] | None = None
    """Added to the word embeddings (``embedding.position_embeddings``): ``module(position_ids, dtype)`` →
    ``[b, s, h]``."""
    rotary: Callable[[PositionEmbeddingConfig], RotaryEmbedding] | None = None
    """Rotates queries and keys in every attention layer (``attention.rotary_emb``)."""
    attention_bias: Callable[[PositionEmbeddingConfig], nn.Module] | None = None
    """Per attention layer (``attention.position_bias``): ``module(q_pos, k_pos)`` → ``[heads/tp, sq, sk]``
    added to the scores."""
    shared_attention_bias: Callable[[PositionEmbeddingConfig, InitMethod], nn.Module] | None = None
    """Like ``attention_bias`` but one module shared by all layers (``attention.rpe``), built once under
    ``seed + 1``."""


POSITION_EMBEDDINGS: Registry[PositionEmbeddingSpec] = Registry("pos_emb")


def _rotary(cfg: PositionEmbeddingConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rotary_ndims, cfg.rotary_emb_base, cfg.rotary_save_freqs_buffer)


def _rpe(cfg: PositionEmbeddingConfig, init_method: InitMethod) -> nn.Module:
    return RelativePositionBias(
        cfg.num_attention_heads,
        cfg.rpe_num_buckets,
        cfg.rpe_max_distance,
        scale=cfg.head_dim**0.5,
        init_method=init_method,
        dtype=cfg.params_dtype,
    )


POSITION_EMBEDDINGS.register("learned", PositionEmbeddingSpec(embedding=LearnedPositionEmbedding))
POSITION_EMBEDDINGS.register("rotary", PositionEmbeddingSpec(rotary=_rotary))
POSITION_EMBEDDINGS.register(
    "sinusoidal", PositionEmbeddingSpec(embedding=lambda cfg, init: SinusoidalPositionalEmbedding(cfg.hidden_size))
)
POSITION_EMBEDDINGS.register("rpe", PositionEmbeddingSpec(shared_attention_bias=_rpe))
POSITION_EMBEDDINGS.register("alibi", PositionEmbeddingSpec(attention_bias=lambda cfg: AliBi(cfg.num_attention_heads)))
POSITION_EMBEDDINGS.register("none", PositionEmbeddingSpec())
