"""Batches and the two step variants (chosen once): sequential (``pp=0``) and DeepSpeed pipeline (``pp>=1``).

A batch from the loader is ``{"text": LongTensor[b, s+1]}``; the model sees ``tokens = text[:, :-1]`` and is
scored on ``labels = text[:, 1:]`` under ``loss_mask`` (GPT-NeoX's ``_get_batch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from megatron import mpu
from megatron.config_utils import NeoXValues, from_schema, schema_defaults
from megatron.logging.timers import Timers
from megatron.model import get_ltor_masks_and_position_ids
from megatron.model.gpt2_model import cross_entropy
from megatron.training.nonfinite import note_loss

Batch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
@schema_defaults
class BatchConfig:
    """How token batches become model inputs."""

    eod_token: int
    eod_mask_loss: bool = from_schema()
    reset_position_ids: bool = from_schema()
    reset_attention_mask: bool = from_schema()
    with_labels: bool = False  # label datasets (SFT): a "label" stream, negative ids excluded from the loss

    # not config keys: the tokenizer's end-of-document id, and whether train_label_data_paths is set
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("eod_token", "with_labels")

    @classmethod
    def from_neox_args(cls, args: NeoXValues, eod_token: int) -> BatchConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        return cls(
            eod_token=eod_token,
            eod_mask_loss=args.eod_mask_loss,
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask,
            with_labels=bool(args.train_label_data_paths),
        )


def get_batch(data: dict[str, torch.Tensor] | None, cfg: BatchConfig) -> Batch:
    """``((tokens, position_ids, attention_mask), (labels, loss_mask))`` on every TP rank (TP rank 0 reads)."""
    keys = ["text", "label"] if cfg.with_labels else ["text"]  # known on every TP rank, as broadcast needs
    # broadcast_data leaves tp=1 batches where the loader put them (CPU): move them to the rank's device.
    device = get_accelerator().current_device_name()
    data_b = {k: v.to(device, non_blocking=True) for k, v in mpu.broadcast_data(keys, data, torch.int64).items()}
    text = data_b["text"]
    tokens = text[:, :-1].contiguous()  # [b, s]
    labels = text[:, 1:].contiguous()  # [b, s]
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        cfg.eod_token,
        eod_mask_loss=cfg.eod_mask_loss,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
    )
    if "label" in data_b:
        label = data_b["label"][:, 1:].contiguous()
        loss_mask = loss_mask * (label >= 0).to(loss_mask.dtype)
        labels = label.clamp(min=0)
    return (tokens, position_ids, attention_mask), (labels, loss_mask)


def reduce_losses(loss: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar loss over the whole world (GPT-NeoX's ``reduce_losses``)."""
    reduced = loss.detach().clone().float().reshape(1)
    if mpu.world_size() > 1:
        mpu.all_reduce_sum(reduced)
        reduced /= mpu.world_size()
    return reduced[0]


def needs_manual_loss_scaling(engine: Any) -> bool:
    """True for fp16 without ZeRO, where DeepSpeed's engine does not apply the dynamic loss scale itself."""
    fp16 = getattr(engine, "fp16_enabled", lambda: False)()
    opt = engine.optimizer
    return bool(fp16) and not isinstance(opt, ZeROOptimizer) and hasattr(opt, "loss_scale_config")


def uses_fused_loss(engine: Any, loss_fn: Any) -> bool:
    """True when the step may ask the model for its loss directly (GPT-NeoX's LM loss, a model that can fuse)."""
    weight_of = getattr(engine.module, "fused_loss_weight", None)
    return loss_fn is cross_entropy and callable(weight_of) and weight_of() is not None


@dataclass
class StepResult:
    """What one training iteration produced."""

    lm_loss: float
    skipped: bool
    extra: dict[str, float] = field(default_factory=dict)  # objective metrics (post-training), logged as given


class SequentialStep:
    """``gas`` × (forward, ``engine.backward``, ``engine.step``); DeepSpeed applies the optimizer at the boundary."""

    def __init__(
        self,
        engine: Any,
        loss_fn: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor],
        batch_cfg: BatchConfig,
        gas: int,
        timers: Timers,
    ) -> None:
        self.engine, self.loss_fn, self.batch_cfg, self.gas, self.timers = engine, loss_fn, batch_cfg, gas, timers
        self.manual_loss_scale = needs_manual_loss_scaling(engine)
        self.fused_loss = uses_fused_loss(engine, loss_fn)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.manual_loss_scale:
            # DeepSpeed 0.19.8 scales the loss only for ZeRO optimizers; its fp16 optimizer for ZeRO-0 unscales
            # the gradients at step() all the same, so the scaling is applied here.
            loss = loss * self.engine.optimizer.loss_scale_config.cur_scale
        self.engine.backward(loss)

    def forward(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> torch.Tensor:
        """Forward one micro-batch; returns the loss."""
        self.timers("batch generator").start()
        inputs, targets = get_batch(next(data_iter) if data_iter is not None else None, self.batch_cfg)
        self.timers("batch generator").stop()
        if self.fused_loss:  # output layer + loss in one chunked pass (same loss, no [b, s, V] logits)
            return self.engine(inputs, loss_targets=targets)
        logits = self.engine(inputs)
        return self.loss_fn(logits, targets)

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration over ``gas`` micro-batches."""
        skipped_before = self.engine.skipped_steps
        losses = []
        for _ in range(self.gas):
            self.timers("forward").start()
            loss = self.forward(data_iter)
            self.timers("forward").stop()
            self.timers("backward").start()
            self._backward(loss)
            self.timers("backward").stop()
            losses.append(reduce_losses(loss))
            note_loss(self.engine, losses[-1])  # a non-finite loss on any rank skips the optimizer step
            self.timers("optimizer").start()
            self.engine.step()
            self.timers("optimizer").stop()
        mean = torch.stack(losses).mean().item()
        return StepResult(mean, self.engine.skipped_steps > skipped_before)

    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> float:
        """Mean loss of ``gas`` forward passes (one evaluation iteration)."""
        return torch.stack([reduce_losses(self.forward(data_iter)) for _ in range(self.gas)]).mean().item()


class PipeStep:
    """``engine.train_batch`` / ``engine.eval_batch`` over DeepSpeed's 1F1B schedule."""

    def __init__(self, engine: Any, batch_cfg: BatchConfig, timers: Timers) -> None:
        self.engine, self.batch_cfg, self.timers = engine, batch_cfg, timers

    def _batches(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> Iterator[Batch]:
        while True:
            yield get_batch(next(data_iter) if data_iter is not None else None, self.batch_cfg)

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration (``gas`` micro-batches inside the engine)."""
        skipped_before = self.engine.skipped_steps
        loss = self.engine.train_batch(data_iter=self._batches(data_iter))
        return StepResult(float(loss), self.engine.skipped_steps > skipped_before)

    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> float:
        """Mean loss of one ``eval_batch``."""
        loss = self.engine.eval_batch(data_iter=self._batches(data_iter))
        return float(loss)


def is_nan(value: float) -> bool:
    """True for NaN or ±inf losses (GPT-NeoX counts them as NaN iterations)."""
    return math.isnan(value) or math.isinf(value)
