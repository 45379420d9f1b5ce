"""This rank's part of the model for inference under the training layout (TP shards of one pipeline stage).

The stage builds only its own GPT-NeoX specs (the same layer classes as training, so tensor-parallel layers hold
this TP rank's shards): the first stage the embedding, every stage its share of the transformer layers (split
evenly, as ``partition_method: uniform`` over the layers), the last stage the final norm and the output layer (a tied
output layer builds the embedding too, for its weight). ``forward(tokens, cache)`` receives the previous stage's
activations, runs the local layers with the KV cache, and sends the result on; the last stage returns the logits
of the full vocabulary (gathered over TP), the others return None. Parameter names are the sequential model's
(``sequential.<spec idx>.``), so the state dict of a checkpoint loads into it after TP sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.utils import partition_uniform
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.gpt2_model import LAYER_CLASSES, _Lambda, build_layer_specs
from megatron.model.kv_cache import KVCache
from megatron.model.layer_sharing import CacheAt, is_shared
from megatron.model.soft_prompt import soft_prompt_tokens


def stage_spec_indices(num_layers: int, stage: int, num_stages: int) -> list[int]:
    """Spec indices (= ``sequential.<idx>`` names) that pipeline ``stage`` of ``num_stages`` runs, in order."""
    if num_stages > num_layers:
        raise ValueError(f"pipe_parallel_size {num_stages} is larger than num_layers {num_layers}")
    parts = partition_uniform(num_items=num_layers, num_parts=num_stages)
    layers = [2 + i for i in range(parts[stage], parts[stage + 1])]
    first = [0, 1] if stage == 0 else []
    last = [num_layers + 2, num_layers + 3, num_layers + 4] if stage == num_stages - 1 else []
    return first + layers + last


class InferenceStage(nn.Module):
    """The specs of this rank's pipeline stage, as TP shards; see the module docstring."""

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        # no sequence parallelism or activation checkpointing at inference (same results, simpler layout)
        self.cfg = cfg = dataclasses.replace(cfg, sequence_parallel=False, checkpoint_activations=False)
        if soft_prompt_tokens(cfg):
            raise ValueError(
                "not supported yet: generation from a soft-prompt-tuned model with model_parallel_size or "
                "pipe_parallel_size > 1; generate with both at 1 (the checkpoint is merged on read)"
            )
        self._shared = is_shared(cfg)
        self.stage, self.num_stages = mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size()
        self.indices = stage_spec_indices(cfg.num_layers, self.stage, self.num_stages)
        specs = build_layer_specs(cfg)
        self.sequential = nn.Module()
        self.run_order: list[nn.Module] = []
        owners: dict[str, nn.Module] = {}
        for idx in self.indices:
            spec = specs[idx]
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in owners:  # off the first stage the tied output layer holds its own copy
                    owner_idx = next(
                        i for i, t in enumerate(specs) if isinstance(t, TiedLayerSpec) and t.key == spec.key
                    )
                    owners[spec.key] = specs[owner_idx].build()
                    self.sequential.add_module(str(owner_idx), owners[spec.key])
                owner = owners[spec.key]
                module = owner if spec.forward_fn is None else _Lambda(spec.forward_fn, owner)
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.sequential.add_module(str(idx), module)
            else:
                module = _Lambda(spec)
            self.run_order.append(module)

    @property
    def is_last(self) -> bool:
        """This stage returns logits."""
        return self.stage == self.num_stages - 1

    def forward(self, tokens: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor | None:
        """Logits ``[b, s, V]`` of ``tokens`` ``[b, s]`` on the last stage, None on the others."""
        b, s = tokens.shape
        start = kv_cache.seq_len if kv_cache is not None else 0
        positions = torch.arange(start, start + s, device=tokens.device).unsqueeze(0).expand(b, s)
        run = iter(self.run_order)
        if self.stage == 0:
            x: Any = next(run)((tokens, positions, None))  # embedding
            x = next(run)(x)  # [b, s, h] -> [s, b, h]
        else:
            shape = (s, b, self.cfg.hidden_size)
            x = (mpu.recv_from_prev_stage(shape, self.cfg.params_dtype, tokens.device), positions, None)
        first = 2 if self.stage == 0 else 0  # the embedding and the transposition ran above
        for idx, module in list(zip(self.indices, self.run_order))[first:]:
            if isinstance(module, LAYER_CLASSES):  # a shared layer keeps a cache entry per position
                x = module(x, kv_cache=CacheAt(kv_cache, idx) if self._shared and kv_cache is not None else kv_cache)
            else:
                x = module(x)
        if kv_cache is not None:
            kv_cache.advance(s)
        if not self.is_last:
            mpu.send_to_next_stage(x[0].to(self.cfg.params_dtype))
            return None
        if x.shape[-1] != self.cfg.padded_vocab_size:  # vocab-parallel logits
            x = mpu.gather_from_model_parallel_region(x.contiguous())
        return x
