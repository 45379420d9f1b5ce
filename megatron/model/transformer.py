"""Transformer layer (sequential or GPT-J parallel residual), and the pipe-shaped final norm and output layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.attention import ParallelSelfAttention
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.kv_cache import KVCache
from megatron.model.mlp import ParallelMLP
from megatron.model.moe.layer import ParallelDroplessMoE
from megatron.model.norms import build_norm
from megatron.model.seeding import seeded
from megatron.model.word_embeddings import EmbeddingPipe


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` (GPT-NeoX's bias-dropout-add; residual may be None)."""
    if bias is not None:
        x = x + bias
    x = F.dropout(x, p=p, training=training) if p > 0.0 else x
    return x if residual is None else residual + x


class ParallelTransformerLayer(nn.Module):
    """One GPT-NeoX transformer layer: ``input_layernorm``, ``attention``, ``post_attention_layernorm``, ``mlp``.

    Sequential residual: ``x1 = x + drop(attn(ln1(x)))``; ``out = x1 + drop(mlp(ln2(x1)))``.
    ``gpt_j_residual``: ``out = x + reduce(drop(attn(ln1(x))) + drop(mlp(ln2(x))))`` with ONE TP reduction;
    each row-parallel bias enters the reduced sum exactly once (TP-invariant; GPT-NeoX adds it tp times).
    ``gpt_j_tied`` feeds ``ln1(x)`` to the MLP too (``ln2`` exists but is unused, as in GPT-NeoX).
    """

    def __init__(self, cfg: GPTModelConfig, layer_index: int, rpe: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        init_method, output_init = init_methods(cfg)
        self.input_layernorm = build_norm(cfg)
        self.attention = ParallelSelfAttention(cfg, layer_index, init_method, output_init, rpe=rpe)
        self.post_attention_layernorm = build_norm(cfg)
        self.is_moe = cfg.is_moe_layer(layer_index)
        if self.is_moe:
            self.mlp: nn.Module = ParallelDroplessMoE(cfg, layer_index, init_method, output_init)
        else:
            self.mlp = ParallelMLP(cfg, init_method, output_init)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``hidden`` [s(/tp with SP), b, h] → same shape."""
        p, training = self.cfg.hidden_dropout, self.training
        if not self.cfg.gpt_j_residual:
            attn, attn_bias = self.attention(self.input_layernorm(hidden), position_ids, attention_mask, kv_cache)
            hidden = bias_dropout_add(attn, attn_bias, hidden, p, training)
            mlp, mlp_bias = self.mlp(self.post_attention_layernorm(hidden))
            if self.is_moe:  # GPT-NeoX: no dropout on the MoE output
                return hidden + mlp
            return bias_dropout_add(mlp, mlp_bias, hidden, p, training)

        x1 = self.input_layernorm(hidden)
        x2 = x1 if self.cfg.gpt_j_tied else self.post_attention_layernorm(hidden)
        attn, attn_bias = self.attention(x1, position_ids, attention_mask, kv_cache)  # TP partial sums
        mlp, mlp_bias = self.mlp(x2)
        tp = mpu.get_model_parallel_world_size()
        if tp > 1:
            # Dropout masks come from the TP-replicated default stream, so dropout(partial + bias/tp) summed
            # over ranks == dropout(full + bias); copy_to makes each replica's bias gradient the full one.
            attn_bias = None if attn_bias is None else mpu.copy_to_model_parallel_region(attn_bias) / tp
            mlp_bias = None if mlp_bias is None else mpu.copy_to_model_parallel_region(mlp_bias) / tp
        out = bias_dropout_add(mlp, mlp_bias, bias_dropout_add(attn, attn_bias, None, p, training), p, training)
        if tp > 1:
            if self.cfg.sequence_parallel:
                out = mpu.reduce_scatter_to_sequence_parallel_region(out, 0)
            else:
                out = mpu.reduce_from_model_parallel_region(out)
        return hidden + out


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """Pipe form: ``(hidden [s,b,h], position_ids, mask)`` → same tuple; built under ``seed + spec_index``."""

    def __init__(self, cfg: GPTModelConfig, layer_index: int, spec_index: int, rpe: nn.Module | None = None) -> None:
        with seeded(cfg.seed + spec_index):
            super().__init__(cfg, layer_index, rpe=rpe)

    def forward(self, args: tuple, kv_cache: KVCache | None = None) -> tuple:  # type: ignore[override]
        """Run the layer on a pipe tuple."""
        hidden, position_ids, attention_mask = args
        return super().forward(hidden, position_ids, attention_mask, kv_cache), position_ids, attention_mask


class NormPipe(nn.Module):
    """Final norm (spec L+3, parameters under ``norm.``)."""

    def __init__(self, cfg: GPTModelConfig, spec_index: int) -> None:
        super().__init__()
        with seeded(cfg.seed + spec_index):
            self.norm = build_norm(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` → normalised."""
        return self.norm(hidden)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, cfg: GPTModelConfig) -> torch.Tensor:
    """Logits against the (vocab-parallel) embedding matrix: ``[b, s, h]`` → ``[b, s, V/tp]`` (or ``V``)."""
    if cfg.sequence_parallel and mpu.get_model_parallel_world_size() > 1:
        hidden = mpu.gather_from_sequence_parallel_region(hidden, 1)
    else:
        hidden = mpu.copy_to_model_parallel_region(hidden)
    logits = F.linear(hidden, weight)
    return logits if cfg.parallel_output else mpu.gather_from_model_parallel_region(logits)


def logits_helper(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """``forward_fn`` of the tied output spec: logits from the embedding module's word embeddings."""
    if embedding.mup_output_mult != 1.0:  # muP's readout multiplier (megatron/model/mup.py)
        hidden = hidden * embedding.mup_output_mult
    return parallel_lm_logits(hidden, embedding.word_embeddings_weight, embedding.cfg)


class ParallelLinearPipe(nn.Module):
    """Untied output layer (spec L+4): ``final_linear`` column-parallel ``h → V``, no bias, ``init_method``.

    ``mup_output_mult``: muP's readout multiplier of the input (set by ``megatron.model.mup.apply_mup``)."""

    mup_output_mult: float = 1.0

    def __init__(self, cfg: GPTModelConfig, spec_index: int) -> None:
        super().__init__()
        with seeded(cfg.seed + spec_index):
            init_method, _ = init_methods(cfg)
            self.final_linear = mpu.ColumnParallelLinear(
                cfg.hidden_size,
                cfg.padded_vocab_size,
                bias=False,
                gather_output=not cfg.parallel_output,
                init_method=init_method,
                params_dtype=cfg.params_dtype,
                sequence_parallel=cfg.sequence_parallel,
                seq_dim=1,
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` → logits ``[b, s, V/tp]`` (or ``V`` when not ``parallel_output``)."""
        if self.mup_output_mult != 1.0:
            hidden = hidden * self.mup_output_mult
        return self.final_linear(hidden)[0]
