"""gMLP and aMLP blocks (``attention_config`` types ``gmlp`` / ``amlp``; Liu et al. 2021, "Pay Attention to MLPs"),
as GPT-NeoX builds them: layer spec ``GMLPBlock``, parameters

``norm`` · ``input_linear`` (column parallel, h → 2·ff, ff = 4h) · ``sgu.norm`` · ``sgu.proj`` (``[seq_length,
seq_length]``) · aMLP only: ``sgu.attn.proj_qkv`` (2·ff/tp → 3·gmlp_attn_dim), ``sgu.attn.proj_ffn``
(gmlp_attn_dim → ff/tp) · ``output_linear`` (row parallel, ff → h).

``out = output_linear(sgu(act(input_linear(norm(x)))))``: GPT-NeoX's block has no residual connection and no
dropout, and adds neither linear's bias (both exist, start at zero and get no gradient). The spatial gating unit
splits this rank's ``[res | gate]`` halves, normalises ``gate`` over this rank's width, mixes it along the sequence
with the causal (lower-triangular) part of ``sgu.proj`` (``[:n, :n]`` for n tokens), adds aMLP's single-head tiny
attention of the whole ``[res | gate]``, and returns ``gate · res``.

Tensor parallelism as GPT-NeoX splits it: ``input_linear`` is split contiguously along its 2·ff outputs, so rank r
gates the second half of its own slice with the first; everything in ``sgu`` is this rank's own module (the gate
norm sees ff/tp features, and each rank has its own tiny attention and sequence projection). A gMLP model is
therefore a different function at each TP size, and its checkpoints cannot be resharded to another TP size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.activations import get_activation
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.model.seeding import seeded

GMLP_TYPES = ("gmlp", "amlp")
FF_MULT = 4  # GPT-NeoX's GMLPBlock default; intermediate_size / expansion_factor do not apply to it


def _distinct_per_tp_rank(module: nn.Module) -> None:
    """Mark parameters that each TP rank holds its own copy of (not replicas): the gradient and parameter norms then
    sum every rank's instead of counting TP rank 0's only."""
    if mpu.get_model_parallel_world_size() > 1:
        for param in module.parameters():
            param.model_parallel = True  # type: ignore[attr-defined]  # read by name, like DeepSpeed's attribute


class TinyAttention(nn.Module):
    """aMLP's single-head attention: ``[b, n, 2f]`` → ``[b, n, f]`` (f = this rank's ff width)."""

    def __init__(self, cfg: GPTModelConfig, d_attn: int, d_ff: int) -> None:
        super().__init__()
        self.proj_qkv = nn.Linear(d_ff * 2, 3 * d_attn, dtype=cfg.params_dtype)
        self.proj_ffn = nn.Linear(d_attn, d_ff, dtype=cfg.params_dtype)
        self.scale = d_attn**-0.5
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``attention_mask`` bool ``[b|1, 1, s, s]`` (True = masked; None = causal)."""
        n = x.shape[1]
        q, k, v = torch.chunk(self.proj_qkv(x), 3, dim=-1)  # [b, n, d_attn] each
        scores = torch.einsum("bnd,bmd->bnm", q, k) * self.scale  # [b, n, n]
        if attention_mask is None:
            masked = torch.ones(n, n, dtype=torch.bool, device=x.device).triu_(1)[None]
        else:
            masked = attention_mask[..., :n, :n].bool()[:, 0]  # [b|1, n, n]
        dtype = scores.dtype
        if self.softmax_in_fp32 and dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(dtype)
        return self.proj_ffn(torch.einsum("bnm,bmd->bnd", probs, v))


class SpatialGatingUnit(nn.Module):
    """``[s, b, 2f]`` → ``[s, b, f]``: ``gate`` normalised, mixed causally along the sequence, times ``res``."""

    def __init__(self, cfg: GPTModelConfig, d_ff: int, d_attn: int | None) -> None:
        super().__init__()
        if cfg.gmlp_seq_length is None:
            raise ValueError("gmlp/amlp layers need seq_length (the span of sgu.proj)")
        self.seq_length = cfg.gmlp_seq_length
        self.norm = build_norm(cfg, d_ff)
        self.proj = nn.Linear(self.seq_length, self.seq_length, dtype=cfg.params_dtype)
        nn.init.zeros_(self.proj.weight)  # the block starts as res · 1: identity gating
        nn.init.constant_(self.proj.bias, 1.0)
        self.attn = TinyAttention(cfg, d_attn, d_ff) if d_attn is not None else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[0]
        if n > self.seq_length:
            raise ValueError(f"gMLP layers mix at most seq_length={self.seq_length} tokens; got a sequence of {n}")
        x = x.transpose(0, 1)  # [b, n, 2f]
        res, gate = x.chunk(2, dim=-1)
        gate = self.norm(gate)
        weight = self.proj.weight[:n, :n].tril()  # token i mixes tokens j <= i
        gate = F.linear(gate.transpose(2, 1), weight, self.proj.bias[:n]).transpose(2, 1)  # [b, n, f]
        if self.attn is not None:
            gate = gate + self.attn(x, attention_mask)
        return (gate * res).transpose(0, 1)  # [n, b, f]


class GMLPBlock(nn.Module):
    """Layer spec ``2 + layer_index`` of a ``gmlp``/``amlp`` layer: ``(hidden [s, b, h], position_ids, mask)`` → same
    tuple, built under ``seed + spec_index`` (GPT-NeoX's class name, which activation checkpointing looks for)."""

    def __init__(self, cfg: GPTModelConfig, layer_index: int, spec_index: int) -> None:
        super().__init__()
        with seeded(cfg.seed + spec_index):
            self._build(cfg, layer_index)

    def _build(self, cfg: GPTModelConfig, layer_index: int) -> None:
        init_method, output_init = init_methods(cfg)
        self.layer_index = layer_index
        ff_dim = cfg.hidden_size * FF_MULT
        self.norm = build_norm(cfg)
        self.input_linear = mpu.ColumnParallelLinear(
            cfg.hidden_size,
            ff_dim * 2,
            gather_output=False,
            init_method=init_method,
            skip_bias_add=True,
            params_dtype=cfg.params_dtype,
        )
        self.activation: Callable[[torch.Tensor], torch.Tensor] = get_activation(cfg)
        ff_local = mpu.divide(ff_dim, mpu.get_model_parallel_world_size())
        d_attn = cfg.gmlp_attn_dim if cfg.layer_types[layer_index] == "amlp" else None
        self.sgu = SpatialGatingUnit(cfg, ff_local, d_attn)
        _distinct_per_tp_rank(self.sgu)
        self.output_linear = mpu.RowParallelLinear(
            ff_dim,
            cfg.hidden_size,
            input_is_parallel=True,
            init_method=output_init,
            skip_bias_add=True,
            params_dtype=cfg.params_dtype,
        )

    def block(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``hidden`` [s, b, h] → [s, b, h] (the block's output replaces the hidden state: no residual)."""
        x = self.norm(hidden)
        # GPT-NeoX skips and drops both linears' biases: the weights alone, through mpu's TP regions
        x = F.linear(mpu.copy_to_model_parallel_region(x), self.input_linear.weight)  # [s, b, 2ff/tp]
        x = self.sgu(self.activation(x), attention_mask)  # [s, b, ff/tp]
        return mpu.reduce_from_model_parallel_region(F.linear(x, self.output_linear.weight))

    def forward(self, args: tuple, kv_cache: KVCache | None = None) -> tuple:
        """Run the block on a pipe tuple; incremental decoding is refused (gMLP mixes the whole sequence)."""
        if kv_cache is not None:
            raise ValueError(
                "incremental decoding (kv_cache) is not supported with gmlp/amlp layers: they mix the whole sequence"
            )
        hidden, position_ids, attention_mask = args
        return self.block(hidden, attention_mask), position_ids, attention_mask
