"""Causal self-attention with GPT-NeoX's fused ``query_key_value`` layout, GQA, rotary/ALiBi/RPE, QK-norm,
sliding-window and block-sparse attention (``local``, ``sparse_fixed``, ... : ``sparse_attention.py``), and a KV cache.

Layouts: the layer works on ``[s, b, h]``; attention itself runs on ``[b, heads, s, hn]``.
Fused QKV (per TP rank): MHA is per-head interleaved ``[np][q|k|v][hn]`` (HF GPTNeoX layout); GQA is blocked
``[q_local | k_local | v_local]`` (GPT-NeoX's layout; see ``tp_sharding``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.kv_cache import KVCache
from megatron.model.mup import attention_scale
from megatron.model.norms import Norm, RMSNorm, ScaleNorm, build_norm
from megatron.model.positional_embeddings import POSITION_EMBEDDINGS, apply_rotary, rotate_in_place
from megatron.model.residual_projection import residual_projection
from megatron.model.sparse_attention import SparseAttention
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES

logger = logging.getLogger(__name__)

try:  # flash-attn 2 is optional (CUDA only); SDPA is used everywhere else
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - not installed on CPU machines
    flash_attn_func = None


def model_parallel_rng_fork(dropout: float = 1.0) -> contextlib.AbstractContextManager:
    """Fork into the model-parallel RNG stream (attention-prob dropout) when dropout is active and the tracker is
    seeded (unseeded, e.g. a plain single-process run, the default stream is used)."""
    if dropout <= 0.0:
        return contextlib.nullcontext()
    tracker = mpu.get_cuda_rng_tracker()
    try:
        seeded = "model-parallel-rng" in tracker.get_states()
    except Exception:  # pragma: no cover - defensive: unknown tracker implementation
        seeded = False
    return tracker.fork() if seeded else contextlib.nullcontext()


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over TP ranks with an all-reduce in forward AND backward (every rank uses the result)."""
    return mpu.reduce_from_model_parallel_region(mpu.copy_to_model_parallel_region(t))


def qk_norm(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    """Apply a QK norm over ``[heads, hn]`` with statistics over ALL heads (TP-invariant).

    ``x`` ``[s, b, heads/tp, hn]``; the norm's parameters ``[heads/tp, hn]`` are this rank's slice. At tp=1 this
    is exactly ``norm(x)`` (GPT-NeoX's norm over ``[heads, hn]``); at tp>1 the sums are all-reduced.
    """
    tp = mpu.get_model_parallel_world_size()
    if tp == 1:
        return norm(x)
    xf = x.float()
    count = xf.shape[-1] * xf.shape[-2] * tp
    if isinstance(norm, (RMSNorm, ScaleNorm)):
        sq = _tp_sum(xf.pow(2).sum(dim=(-2, -1), keepdim=True))
        if isinstance(norm, RMSNorm):
            return (norm.scale.float() * xf * torch.rsqrt(sq / count + norm.eps)).to(x.dtype)
        return (xf / sq.sqrt().clamp(min=norm.eps) * norm.g.float()).to(x.dtype)
    mean = _tp_sum(xf.sum(dim=(-2, -1), keepdim=True)) / count
    centred = xf - mean
    var = _tp_sum(centred.pow(2).sum(dim=(-2, -1), keepdim=True)) / count
    out = centred * torch.rsqrt(var + norm.eps)
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class ParallelSelfAttention(nn.Module):
    """Self-attention of layer ``layer_index`` (0-based) with GPT-NeoX tensor names.

    ``use_qk_layernorm`` adds GPT-NeoX's ``qk_layernorm`` ``[heads/tp, hn]`` (the configured norm type over all
    heads jointly, applied to q and to k; statistics all-reduced over TP so the model is TP-invariant); with GQA
    k gets its own ``k_layernorm`` ``[kv_heads/tp, hn]``.

    Parameters: ``query_key_value`` (column parallel), ``dense`` (row parallel), optional ``qk_layernorm``
    (+ ``k_layernorm`` with GQA), ``rotary_emb`` buffer. ``forward`` returns ``(output, dense_bias_or_None)``
    (bias not yet added) where ``output`` is reduced over TP unless ``gpt_j_residual`` (then partial sums,
    reduced once by the layer).
    """

    def __init__(
        self,
        cfg: GPTModelConfig,
        layer_index: int,
        init_method: Callable,
        output_layer_init_method: Callable,
        rpe: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.attention_type = cfg.layer_types[layer_index]
        tp = mpu.get_model_parallel_world_size()
        self.tp = tp
        self.hn = cfg.head_dim
        for key, value in (("num_attention_heads", cfg.num_attention_heads), ("num_kv_heads", cfg.kv_heads)):
            if value % tp:
                raise ValueError(f"{key}={value} must be divisible by model_parallel_size={tp}")
        self.np = cfg.num_attention_heads // tp
        self.nkv = cfg.kv_heads // tp
        kv = cfg.kv_heads * cfg.head_dim
        self.query_key_value = mpu.ColumnParallelLinear(
            cfg.hidden_size,
            cfg.qkv_size,
            bias=cfg.use_bias_in_attn_linear,
            gather_output=False,
            init_method=init_method,
            params_dtype=cfg.params_dtype,
            sequence_parallel=cfg.sequence_parallel,
            seq_dim=0,
            output_sizes=(cfg.hidden_size, kv, kv) if cfg.is_gqa else None,
        )
        if cfg.use_qk_layernorm and cfg.norm == "scalenorm" and mpu.get_model_parallel_world_size() > 1:
            # ScaleNorm's single gain would be shared by all heads across TP ranks (a replicated parameter with
            # partial gradients), which no sync handles yet.
            raise ValueError("use_qk_layernorm with norm: scalenorm is not supported with model_parallel_size > 1")
        if cfg.use_qk_layernorm:  # GPT-NeoX: ONE norm over [heads/tp, hn] applied to q and to k
            self.qk_layernorm = build_norm(cfg, [self.np, self.hn])
            if cfg.is_gqa:  # extension (GPT-NeoX has no QK norm with GQA): k has its own [kv/tp, hn] norm
                self.k_layernorm = build_norm(cfg, [self.nkv, self.hn])
            # Their parameters hold this rank's heads: TP shards along dim 0 (grad-norm clipping and the
            # sequence-parallel norm sync must treat them as such).
            for norm in (self.qk_layernorm, getattr(self, "k_layernorm", None)):
                for param in norm.parameters() if norm is not None else ():
                    mpu.set_tensor_model_parallel_attributes(param, 0)
        position = POSITION_EMBEDDINGS.get(cfg.pos_emb)
        self.rotary_emb = position.rotary(cfg) if position.rotary is not None else None
        self.position_bias = position.attention_bias(cfg) if position.attention_bias is not None else None
        self.rpe = rpe
        self.scale = attention_scale(self.hn, cfg.use_mup, cfg.mup_attn_temp)
        self.layer_scale = float(max(1, layer_index)) if cfg.apply_query_key_layer_scaling else 1.0
        self.dense = residual_projection(cfg, cfg.hidden_size, cfg.use_bias_in_attn_linear, output_layer_init_method)
        self.sparse = (
            SparseAttention(
                self.attention_type,
                cfg.sparsity_config,
                cfg.num_attention_heads,
                cfg.seq_length,
                cfg.seed,
                layer_index,
            )
            if self.attention_type in SPARSE_TYPES
            else None
        )

    # ------------------------------------------------------------------------------------------------------

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, b = mixed.shape[:2]
        if not self.cfg.is_gqa:  # [s, b, np * 3 * hn] -> per-head [q|k|v]
            q, k, v = mixed.view(s, b, self.np, 3, self.hn).unbind(3)
            return q, k, v
        q, k, v = mixed.split([self.np * self.hn, self.nkv * self.hn, self.nkv * self.hn], dim=-1)
        return q.view(s, b, self.np, self.hn), k.view(s, b, self.nkv, self.hn), v.view(s, b, self.nkv, self.hn)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden`` [s(/tp with SP), b, h], ``position_ids`` [b, s], ``attention_mask`` bool (True = masked)."""
        mixed, _ = self.query_key_value(hidden)  # [s, b, qkv/tp]
        rope = None if torch.is_grad_enabled() else self.rotary_emb  # inference: rotate in place (bitwise equal)
        if rope is not None and not self.cfg.is_gqa and not self.cfg.use_qk_layernorm:
            # q and k together inside the fresh QKV output ([s, b, np, q|k|v, hn])
            s, b = mixed.shape[:2]
            cos, sin = rope.signed_tables(position_ids, mixed.dtype)  # [s, b, 1, rot]
            rotate_in_place(mixed.view(s, b, self.np, 3, self.hn)[:, :, :, :2], cos.unsqueeze(2), sin.unsqueeze(2))
            rope = None
        q, k, v = self._split_qkv(mixed)  # [s, b, heads, hn]
        if self.cfg.use_qk_layernorm:
            k_norm = self.k_layernorm if self.cfg.is_gqa else self.qk_layernorm
            q, k = qk_norm(self.qk_layernorm, q), qk_norm(k_norm, k)
        if rope is not None:  # GQA or QK norm: q and k rotated where they are
            cos, sin = rope.signed_tables(position_ids, q.dtype)
            rotate_in_place(q, cos, sin)
            rotate_in_place(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        if self.rotary_emb is not None and torch.is_grad_enabled():
            cos, sin = self.rotary_emb(position_ids, q.dtype)  # [b, s, rot]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        sq = q.shape[2]
        past = 0
        if kv_cache is not None:  # the cache copies k and v into its storage: no contiguous copies first
            past = kv_cache.past_length(self.layer_index)
            k, v = kv_cache.update(self.layer_index, k, v)
        context = self._attend(q, k, v, attention_mask, past)  # [b, np, sq, hn]
        b = context.shape[0]
        context = context.permute(2, 0, 1, 3).reshape(sq, b, self.np * self.hn)  # [s, b, h/tp]
        return self.dense(context)

    # ------------------------------------------------------------------------------------------------------

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, past: int
    ) -> torch.Tensor:
        sq, sk = q.shape[2], k.shape[2]
        if self.sparse is not None and self._sparse_kernel_applies(mask, past, sq, sk):
            return self._sparse_attention(q, k, v)
        allowed, bias = None, None  # allowed: bool [b|1, 1, sq, sk] or None = plain causal
        mask_is_causal = True  # the given mask adds nothing to causality (a window or local blocks may still)
        if not self._always_causal(mask):
            q_pos, k_pos = self._positions(past, sq, sk, q.device)
            allowed, mask_is_causal = self._allowed(mask, q_pos, k_pos, past)
            if self.position_bias is not None:
                bias = self.position_bias(q_pos, k_pos)
            if self.rpe is not None:
                rpe = self.rpe(q_pos, k_pos)
                bias = rpe if bias is None else bias + rpe
        dropout = self.cfg.attention_dropout if self.training else 0.0

        if self._use_flash(q, past, bias, mask_is_causal):  # pragma: no cover - CUDA + flash-attn only
            window = (self.cfg.sliding_window_width, -1) if self.cfg.sliding_window_width else (-1, -1)
            with model_parallel_rng_fork(dropout):
                out = flash_attn_func(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout, causal=True, window_size=window
                )
            return out.transpose(1, 2)

        if self.nkv != self.np:
            k = k.repeat_interleave(self.np // self.nkv, dim=1)
            v = v.repeat_interleave(self.np // self.nkv, dim=1)
        low_precision = q.dtype != torch.float32
        if low_precision and (
            self.cfg.attention_softmax_in_fp32 or self.cfg.apply_query_key_layer_scaling or bias is not None
        ):
            return self._math_attention(q, k, v, allowed, bias, dropout, past)
        if allowed is None and bias is None and past == 0 and sq == sk:
            with model_parallel_rng_fork(dropout):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale)
        if allowed is None and bias is None and sq == 1:  # one new token after the cache: it sees every key
            with model_parallel_rng_fork(dropout):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.scale)
        if allowed is None:
            allowed = self._causal(past, sq, sk, q.device)
        # Additive mask with finfo.min (as GPT-NeoX's masked_fill): a fully masked row (e.g. a padding query)
        # gets uniform weights instead of NaN, so padding can never poison real tokens.
        attn_mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, torch.finfo(q.dtype).min
        )
        if bias is not None:
            attn_mask = attn_mask + bias.to(q.dtype).unsqueeze(0)
        with model_parallel_rng_fork(dropout):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=self.scale)

    def _math_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | None,
        bias: torch.Tensor | None,
        dropout: float,
        past: int,
    ) -> torch.Tensor:
        """Explicit attention: scores in the param dtype, softmax in fp32 (``attention_softmax_in_fp32``)."""
        coeff = self.layer_scale
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.scale / coeff)  # [b, np, sq, sk]
        scores = scores.float() * coeff
        if bias is not None:
            scores = scores + bias.unsqueeze(0)
        if allowed is None:
            allowed = self._causal(past, q.shape[2], k.shape[2], q.device)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        if dropout > 0.0:
            with model_parallel_rng_fork(dropout):
                probs = F.dropout(probs, p=dropout)
        return torch.matmul(probs, v)

    def _always_causal(self, mask: torch.Tensor | None) -> bool:
        """True when nothing but causality restricts attention (no mask, ALiBi, RPE, window or local blocks)."""
        return (
            mask is None
            and self.position_bias is None
            and self.rpe is None
            and self.cfg.sliding_window_width is None
            and self.sparse is None
        )

    def _sparse_kernel_applies(self, mask: torch.Tensor | None, past: int, sq: int, sk: int) -> bool:
        """The block-sparse kernel covers self-attention of a whole sequence (no cache) whose length is a multiple
        of the block, with nothing but causality and the layout restricting it (no other mask, window or bias)."""
        assert self.sparse is not None
        if past or sq != sk or not self.sparse.kernel_applies(sq) or self.cfg.sliding_window_width is not None:
            return False
        if self.position_bias is not None or self.rpe is not None:
            return False
        if mask is None:
            return True
        q_pos, k_pos = self._positions(0, sq, sk, mask.device)
        return mask.shape[0] == 1 and torch.equal(mask[0, 0, :sq, :sk].bool(), k_pos[None, :] > q_pos[:, None])

    def _sparse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.sparse is not None
        if self.nkv != self.np:
            k = k.repeat_interleave(self.np // self.nkv, dim=1)
            v = v.repeat_interleave(self.np // self.nkv, dim=1)
        context = self.sparse(q, k, v, self.scale)
        dropout = self.cfg.attention_dropout if self.training else 0.0
        if dropout > 0.0:  # GPT-NeoX drops out the sparse layers' context, not their probabilities
            with model_parallel_rng_fork(dropout):
                context = F.dropout(context, p=dropout)
        return context

    @staticmethod
    def _positions(past: int, sq: int, sk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Query positions ``[past, past + sq)`` and key positions ``[0, sk)``."""
        return torch.arange(past, past + sq, device=device), torch.arange(sk, device=device)

    def _causal(self, past: int, sq: int, sk: int, device: torch.device) -> torch.Tensor:
        """The plain causal ``allowed`` mask ``[1, 1, sq, sk]``."""
        q_pos, k_pos = self._positions(past, sq, sk, device)
        return (k_pos[None, :] <= q_pos[:, None])[None, None]

    def _allowed(
        self, mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, past: int
    ) -> tuple[torch.Tensor | None, bool]:
        """Boolean ``True = may attend`` mask ``[b|1, 1, sq, sk]`` (None when it is exactly plain causal), and
        whether ``mask`` itself was plain causal (before a sliding window or local blocks are applied)."""
        sq, sk = q_pos.numel(), k_pos.numel()
        allowed = None
        if mask is not None:
            if mask.shape[-2] < past + sq or mask.shape[-1] < sk:
                raise ValueError(
                    f"attention_mask of shape {tuple(mask.shape)} is too small for {sq} queries after {past} cached"
                )
            m = mask[..., past : past + sq, :sk].bool()  # True = masked (GPT-NeoX convention)
            while m.dim() < 4:
                m = m.unsqueeze(0)
            causal_masked = k_pos[None, :] > q_pos[:, None]
            if not (m.shape[0] == 1 and torch.equal(m[0, 0], causal_masked)):
                allowed = ~m
        window = self.cfg.sliding_window_width
        extra = None  # [1, 1|heads, sq, sk]
        if window is not None:
            extra = ((q_pos[:, None] - k_pos[None, :]) <= window)[None, None]
        if self.sparse is not None:  # the layout at token level, per head
            blocks = self.sparse.allowed(q_pos, k_pos)[None]
            extra = blocks if extra is None else extra & blocks
        mask_is_causal = allowed is None
        if extra is not None:
            base = allowed if allowed is not None else (k_pos[None, :] <= q_pos[:, None])[None, None]
            allowed = base & extra
        return allowed, mask_is_causal

    def _use_flash(self, q: torch.Tensor, past: int, bias: torch.Tensor | None, mask_is_causal: bool) -> bool:
        """flash-attn 2 only for CUDA half precision with a plain causal (optionally windowed) mask."""
        return (
            flash_attn_func is not None
            and self.attention_type == "flash"
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and bias is None
            and past == 0
            and mask_is_causal
        )
