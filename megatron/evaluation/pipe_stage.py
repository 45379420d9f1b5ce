"""Inference over the pipeline model being trained (``pipe_parallel_size >= 2``), outside DeepSpeed's schedule.

:class:`TrainingPipeStage` gives this rank's part of a ``PipelineModule`` (the layers DeepSpeed's partition put on
this stage, as this TP rank's shards, with the weights of the current step) the interface of
:class:`~megatron.model.inference_stage.InferenceStage`, so that
:class:`~megatron.generation.parallel.StageForward` scores and generates with it: stage 0 embeds the tokens, every
stage runs its local layers (``PipelineModule.forward``) and sends the result to the next stage, the last stage
returns the logits of the full vocabulary (gathered over TP), the others None. The activations go point-to-point
after a small header (shape, dtype, whether positions follow), since the partition (``pipe_partition_method``)
decides where a stage boundary lies. No KV cache: generation recomputes the whole context at every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HEADER = 6  # ndim, three sizes, dtype index, 1 when the activations travel with positions (a layer's tuple)


class TrainingPipeStage:
    """``stage(tokens, kv_cache=None) -> logits | None`` over the training ``PipelineModule`` of this rank."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        cfg = getattr(module, "cfg", None)
        if not isinstance(cfg, GPTModelConfig):
            raise TypeError(f"TrainingPipeStage needs a GPT2ModelPipe (with a .cfg), got {type(module).__name__}")
        self.cfg = cfg  # GPT2ModelPipe's model config (StageForward reads padded_vocab_size)
        self.vocab = self.cfg.vocab_rows
        self.stage, self.num_stages = mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size()

    @property
    def is_last(self) -> bool:
        """This stage returns logits."""
        return self.stage == self.num_stages - 1

    def __call__(self, tokens: torch.Tensor, kv_cache: Any = None) -> torch.Tensor | None:
        """Logits ``[b, s, V]`` of ``tokens`` ``[b, s]`` on the last stage, None on the others."""
        if kv_cache is not None:
            raise ValueError("the training pipeline model has no KV cache: generate with recompute")
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        x: Any = (tokens, positions, None) if self.stage == 0 else self._receive(positions, tokens.device)
        out = self.module(x)
        if not self.is_last:
            self._send(out)
            return None
        if out.shape[-1] != self.vocab:  # vocab-parallel logits
            out = mpu.gather_from_model_parallel_region(out.contiguous())
        return out

    def _send(self, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.dim() > 3 or hidden.dtype not in _DTYPES:
            raise ValueError(f"pipeline stage output of shape {tuple(hidden.shape)} / {hidden.dtype} cannot be sent")
        sizes = list(hidden.shape) + [1] * (3 - hidden.dim())
        header = [hidden.dim(), *sizes, _DTYPES.index(hidden.dtype), int(isinstance(out, tuple))]
        mpu.send_to_next_stage(torch.tensor(header, dtype=torch.long))
        mpu.send_to_next_stage(hidden)

    def _receive(self, positions: torch.Tensor, device: torch.device) -> Any:
        header = mpu.recv_from_prev_stage((_HEADER,), torch.long, "cpu").tolist()
        ndim, dtype, with_positions = header[0], _DTYPES[header[4]], bool(header[5])
        hidden = mpu.recv_from_prev_stage(tuple(header[1 : 1 + ndim]), dtype, device)
        return (hidden, positions, None) if with_positions else hidden
