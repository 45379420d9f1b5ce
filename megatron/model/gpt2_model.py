"""The GPT model as GPT-NeoX layer specs, run sequentially (``pipe_parallel_size: 0``) or as a DeepSpeed
``PipelineModule``.

Spec indices (= on-disk layer numbers and ``sequential.{idx}.`` prefixes):
0 embedding · 1 ``_pre_transformer_block`` · 2..L+1 transformer layers · L+2 ``_post_transformer_block`` ·
L+3 final norm · L+4 output layer (tied: the embedding's ``word_embeddings_weight`` via ``TiedLayerSpec("embed")``).
Activations between specs are tuples ``(hidden, position_ids, attention_mask)`` up to L+2 and a tensor after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint as deepspeed_checkpoint
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.fused_loss import fused_lm_cross_entropy
from megatron.model.fused_softmax import gpt2_attention_mask_func  # noqa: F401 - GPT-NeoX's name lives here
from megatron.model.gmlp import GMLP_TYPES, GMLPBlock
from megatron.model.init_functions import init_methods
from megatron.model.kv_cache import KVCache
from megatron.model.layer_sharing import CacheAt, is_shared, transformer_layer_spec
from megatron.model.mamba import ParallelMambaResidualLayerPipe
from megatron.model.moe import with_aux_loss
from megatron.model.pipe_partition import resolve_partition_method
from megatron.model.positional_embeddings import POSITION_EMBEDDINGS
from megatron.model.rwkv import RWKVResidualLayerPipe
from megatron.model.seeding import seeded
from megatron.model.soft_prompt import (
    PromptOutputDrop,
    SoftPromptPipe,
    prepare_soft_prompt,
    prepare_stage_soft_prompt,
    soft_prompt_tokens,
)
from megatron.model.transformer import (
    NormPipe,
    ParallelLinearPipe,
    ParallelTransformerLayerPipe,
    logits_helper,
)
from megatron.model.word_embeddings import EmbeddingPipe

logger = logging.getLogger(__name__)

CHECKPOINTABLE_LAYERS = ["ParallelTransformerLayerPipe", "ParallelMambaResidualLayerPipe", "GMLPBlock"]
# what specs 2..L+1 can be: activation-checkpointed, take kv_cache
LAYER_CLASSES = (ParallelTransformerLayerPipe, ParallelMambaResidualLayerPipe, GMLPBlock)


def _pre_transformer_block(args: tuple) -> tuple:
    """``[b, s, h]`` → ``[s, b, h]`` (layers work sequence-first)."""
    hidden, position_ids, attention_mask = args
    return hidden.transpose(0, 1).contiguous(), position_ids, attention_mask


def _post_transformer_block(args: tuple) -> torch.Tensor:
    """Drop positions/mask and go back to ``[b, s, h]``."""
    return args[0].transpose(0, 1).contiguous()


def build_layer_specs(cfg: GPTModelConfig, pipeline: bool = False) -> list:
    """GPT-NeoX's spec list (see module docstring) of DeepSpeed ``LayerSpec``/``TiedLayerSpec`` and functions.

    ``pipeline``: for the ``PipelineModule``, whose ``_post_transformer_block`` also drops a soft prompt's outputs
    (the sequential model drops them itself, except in incremental decoding after the first step)."""
    rpe = None  # one attention bias module shared by every layer (T5's relative position bias)
    build_shared_bias = POSITION_EMBEDDINGS.get(cfg.pos_emb).shared_attention_bias
    if build_shared_bias is not None:
        with seeded(cfg.seed + 1):
            init_method, _ = init_methods(cfg)
            rpe = build_shared_bias(cfg, init_method)
    specs: list[Any] = []
    if cfg.tied_embeddings:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, cfg, 0, tied_weight_attr="word_embeddings_weight"))
    else:
        specs.append(LayerSpec(EmbeddingPipe, cfg, 0))
    specs.append(LayerSpec(SoftPromptPipe, cfg, 1) if soft_prompt_tokens(cfg) else _pre_transformer_block)
    for i, kind in enumerate(cfg.layer_types):  # shared layers: layer_sharing (transformer layers only)
        if kind == "mamba":
            specs.append(LayerSpec(ParallelMambaResidualLayerPipe, cfg, i, i + 2))
        elif kind in GMLP_TYPES:
            specs.append(LayerSpec(GMLPBlock, cfg, i, i + 2))
        elif kind == "rwkv":
            specs.append(LayerSpec(RWKVResidualLayerPipe, cfg, i, i + 2))
        else:
            specs.append(transformer_layer_spec(cfg, i, ParallelTransformerLayerPipe, rpe=rpe))
    n_prompt = soft_prompt_tokens(cfg)
    specs.append(
        PromptOutputDrop(_post_transformer_block, n_prompt) if pipeline and n_prompt else _post_transformer_block
    )
    specs.append(LayerSpec(NormPipe, cfg, cfg.num_layers + 3))
    if cfg.tied_embeddings:
        specs.append(
            TiedLayerSpec(
                "embed", EmbeddingPipe, cfg, 0, forward_fn=logits_helper, tied_weight_attr="word_embeddings_weight"
            )
        )
    else:
        specs.append(LayerSpec(ParallelLinearPipe, cfg, cfg.num_layers + 4))
    return specs


class _Lambda(nn.Module):
    """A parameter-free spec (function, or the tied output layer calling into its owner)."""

    def __init__(self, fn: Any, owner: nn.Module | None = None) -> None:
        super().__init__()
        self.fn = fn
        self._owner = [owner] if owner is not None else []  # a list, so the owner is not registered twice

    def forward(self, x: Any) -> Any:
        """Apply the function."""
        return self.fn(self._owner[0], x) if self._owner else self.fn(x)


class GPTSequential(nn.Module):
    """The spec list run in order (``pipe_parallel_size: 0``); parameters under ``sequential.{idx}.``.

    ``forward(input_ids, position_ids=None, attention_mask=None, kv_cache=None)`` → logits ``[b, s, V/tp]``
    (``[b, s, V]`` if not ``parallel_output``). Also accepts GPT-NeoX's ``model((tokens, position_ids, mask))``.
    ``position_ids`` default to ``kv_cache.seq_len + arange(s)``; ``attention_mask`` None = causal.
    """

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        modules: list[nn.Module] = []
        owners: dict[str, nn.Module] = {}
        for spec in build_layer_specs(cfg):
            if isinstance(spec, TiedLayerSpec):
                if spec.key in owners:  # a tied head calls into its owner; a shared layer runs again
                    tied = owners[spec.key]
                    modules.append(tied if spec.forward_fn is None else _Lambda(spec.forward_fn, tied))
                    continue
                module = spec.build()
                owners[spec.key] = module
                modules.append(module)
            elif isinstance(spec, LayerSpec):
                modules.append(spec.build())
            else:
                modules.append(_Lambda(spec))
        self.sequential = nn.Sequential(*modules)
        embedding = modules[0]
        assert isinstance(embedding, EmbeddingPipe)
        # soft prompt tuning: the prefix's init (init_string's word embeddings), every other parameter frozen
        prepare_soft_prompt(self, embedding.word_embeddings, cfg.soft_prompt_init_ids)
        self._shared = is_shared(cfg)
        if cfg.sequence_parallel:  # norms see only this rank's tokens: their gradients are summed over TP
            mpu.mark_norms_for_sequence_parallel_grad_sync(self)
        self.checkpoint_activations = cfg.checkpoint_activations
        self.checkpoint_num_layers = cfg.checkpoint_num_layers

    def forward(
        self,
        input_ids: torch.Tensor | tuple,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids`` [b, s]; with ``loss_targets`` ``(labels, loss_mask)`` the LM loss instead, with
        the output projection fused into the loss (:mod:`megatron.model.fused_loss`; see :meth:`fused_loss_weight`).
        """
        if isinstance(input_ids, (tuple, list)):
            input_ids, position_ids, attention_mask = input_ids
        assert isinstance(input_ids, torch.Tensor)
        b, s = input_ids.shape
        if kv_cache is not None and self.cfg.sequence_parallel and mpu.get_model_parallel_world_size() > 1:
            raise ValueError("incremental decoding (kv_cache) is not supported with sequence_parallel; disable it")
        if position_ids is None:  # token positions (a soft prompt shifts them itself)
            start = kv_cache.seq_len if kv_cache is not None else 0
            position_ids = torch.arange(start, start + s, device=input_ids.device).unsqueeze(0).expand(b, s)
        use_ckpt = self.checkpoint_activations and self.training and torch.is_grad_enabled() and kv_cache is None
        # None = causal: the layers skip their mask check (one here instead of one per layer). Not under DeepSpeed's
        # reentrant checkpoint, whose recomputation does not take a None among the arguments.
        if not use_ckpt and kv_cache is None and attention_mask is not None and is_plain_causal(attention_mask, s):
            attention_mask = None
        x: Any = (input_ids, position_ids, attention_mask)
        layers = list(self.sequential)
        weight = self.fused_loss_weight() if loss_targets is not None else None
        if loss_targets is not None:
            if weight is None:
                raise ValueError("loss_targets: this model cannot fuse its output layer into the loss")
            layers = layers[:-1]
        i, prefix = 0, 0
        while i < len(layers):
            layer = layers[i]
            if isinstance(layer, SoftPromptPipe):
                prefix = layer.n_tokens if layer.prepends(kv_cache) else 0
                x = layer(x, kv_cache=kv_cache)
            elif isinstance(layer, LAYER_CLASSES):
                if use_ckpt:
                    j = i
                    while (
                        j < len(layers) and j - i < self.checkpoint_num_layers and isinstance(layers[j], LAYER_CLASSES)
                    ):
                        j += 1
                    x = _checkpoint(_run_chunk(layers[i:j]), *x)
                    i = j
                    continue
                x = layer(x, kv_cache=CacheAt(kv_cache, i) if self._shared and kv_cache is not None else kv_cache)
            elif isinstance(layer, RWKVResidualLayerPipe):
                x = layer(x, kv_cache=kv_cache)
            else:
                x = layer(x)
                if prefix and i == self.cfg.num_layers + 2:  # after _post_transformer_block: drop the prefix's outputs
                    x = x[:, prefix:]
            i += 1
        if kv_cache is not None:
            kv_cache.advance(s)
        if loss_targets is not None and weight is not None:  # weight is None only without loss_targets (see above)
            return fused_lm_cross_entropy(x, weight, loss_targets[0], loss_targets[1])
        return x

    def fused_loss_weight(self) -> torch.Tensor | None:
        """The output weight ``[V, h]`` when the fused output+loss path applies (tensor parallel size 1, no sequence
        parallelism, fp32 loss, weight not partitioned by ZeRO-3), else None."""
        cfg = self.cfg
        if mpu.get_model_parallel_world_size() != 1 or cfg.sequence_parallel or cfg.fp16_lm_cross_entropy:
            return None
        last = self.sequential[-1]
        owner = last._owner[0] if isinstance(last, _Lambda) and last.fn is logits_helper else None
        weight: torch.Tensor
        if getattr(owner or last, "mup_output_mult", 1.0) != 1.0:
            return None  # muP's readout multiplier is applied by the output layer itself
        if isinstance(last, ParallelLinearPipe):
            weight = last.final_linear.weight
        elif isinstance(owner, EmbeddingPipe):
            weight = owner.word_embeddings_weight
        else:
            return None
        return None if hasattr(weight, "ds_tensor") else weight


def is_plain_causal(mask: torch.Tensor, s: int) -> bool:
    """True when ``mask`` (bool, True = masked) is exactly the causal mask ``[1, 1, s, s]`` of ``s`` tokens (what
    the training batches carry without ``reset_attention_mask`` or a sliding window), which attention treats as
    no mask at all."""
    if mask.dim() != 4 or tuple(mask.shape) != (1, 1, s, s):
        return False
    idx = torch.arange(s, device=mask.device)
    return torch.equal(mask[0, 0].bool(), idx[None, :] > idx[:, None])


def _checkpoint(function: Any, *args: Any) -> Any:
    """DeepSpeed activation checkpointing of a chunk of transformer layers.

    The reentrant form (GPT-NeoX's ``deepspeed.checkpointing.checkpoint``) re-gathers ZeRO-3 parameters when it
    recomputes; the non-reentrant one would recompute with already released (size-0) ZeRO-3 weights. The
    reentrant form needs an input that requires grad, so without one (e.g. frozen embeddings) the
    non-reentrant form is used.
    """
    if any(torch.is_tensor(a) and a.requires_grad for a in args):
        return deepspeed_checkpoint(function, *args)
    return non_reentrant_checkpoint(function, *args)


def _run_chunk(layers: list[nn.Module]) -> Any:
    def run(*args: Any) -> tuple:
        for layer in layers:
            args = layer(args)
        return args

    return run


def build_sequential_model(cfg: GPTModelConfig) -> GPTSequential:
    """The sequential (``pipe_parallel_size: 0``) model."""
    return GPTSequential(cfg)


class GPT2ModelPipe(PipelineModule):
    """The spec list as a DeepSpeed ``PipelineModule`` (``pipe_parallel_size >= 1``), GPT-NeoX style.

    Loss: :func:`cross_entropy` on ``(labels, loss_mask)``. Activation checkpointing every
    ``checkpoint_num_layers`` transformer layers with DeepSpeed's non-reentrant checkpoint (safe for the
    embedding stage, replays the TP RNG tracker). Weights are seeded per spec (``seed + idx``), so they do not
    depend on the partition.
    """

    def __init__(
        self,
        cfg: GPTModelConfig,
        topology: Any = None,
        *,
        num_stages: int | None = None,
        loss_fn: Any = None,
        partition_method: str | None = None,
        checkpoint_activations: bool | None = None,
        checkpoint_num_layers: int | None = None,
    ) -> None:
        self.cfg = cfg
        ckpt = cfg.checkpoint_activations if checkpoint_activations is None else checkpoint_activations
        every = cfg.checkpoint_num_layers if checkpoint_num_layers is None else checkpoint_num_layers
        topology = topology if topology is not None else mpu.get_topology()
        stages = topology.get_dim("pipe") if topology is not None else (num_stages or 1)
        super().__init__(
            layers=build_layer_specs(cfg, pipeline=True),
            num_stages=None if topology is not None else (num_stages or 1),
            topology=topology,
            loss_fn=loss_fn if loss_fn is not None else partial(cross_entropy, _fp16=cfg.fp16_lm_cross_entropy),
            partition_method=resolve_partition_method(cfg, stages, partition_method),
            activation_checkpoint_interval=every if ckpt else 0,
            activation_checkpoint_func=non_reentrant_checkpoint,
            checkpointable_layers=CHECKPOINTABLE_LAYERS,
        )
        if cfg.sequence_parallel:  # norms see only this rank's tokens: their gradients are summed over TP
            mpu.mark_norms_for_sequence_parallel_grad_sync(self)
        if soft_prompt_tokens(cfg):  # the prefix's init and every other parameter frozen, on this stage's layers
            prepare_stage_soft_prompt(self, cfg.soft_prompt_init_ids)
        if cfg.is_moe:
            if self.num_stages > 1:
                raise ValueError("not supported yet: MoE layers with more than one pipeline stage")

            self.loss_fn: Callable[..., torch.Tensor] = with_aux_loss(self.loss_fn, self)

    def allreduce_tied_weight_gradients(self) -> None:
        """DeepSpeed's sum of tied weights' gradients over their stages, skipping frozen ones (soft prompt tuning
        freezes the tied embedding: it has no gradient)."""
        for key, comm in self.tied_comms.items():
            for attr_name in comm["weight_attr"]:
                weight = self._recursive_getattr(self.tied_modules[key], attr_name)
                if weight.requires_grad:
                    mpu.all_reduce_sum(weight.grad, group=comm["group"])


def build_pipeline_model(cfg: GPTModelConfig, topology: Any = None, **kwargs: Any) -> GPT2ModelPipe:
    """``GPT2ModelPipe(cfg, topology, **kwargs)``."""
    return GPT2ModelPipe(cfg, topology, **kwargs)


def cross_entropy(output: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor], _fp16: bool = False) -> torch.Tensor:
    """GPT-NeoX's LM loss: vocab-parallel CE per token, masked mean ``Σ(loss·mask)/Σmask``.

    ``output`` [b, s, V/tp] logits (vocab-parallel); ``labels`` = ``(labels [b, s], loss_mask [b, s])``.
    Computed in fp32 unless ``_fp16`` (``fp16_lm_cross_entropy``).
    """
    target, loss_mask = labels
    logits = output if _fp16 else output.float()
    losses = mpu.vocab_parallel_cross_entropy(logits.contiguous(), target)
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1).float() * mask) / mask.sum()
