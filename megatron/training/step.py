"""Batches and the two step variants (chosen once): sequential (``pp=0``) and DeepSpeed pipeline (``pp>=1``).

``SequentialStep.train`` is the whole training step, top to bottom: ``gas`` × (forward, ``engine.backward``), the
gradient norm and clipping, the skip decision (one all-reduce, one host read), then ``engine.step()`` (the optimizer
step) and the LR step, or the skip. ``PipeStep.train`` is ``engine.train_batch()``, whose schedule runs the same
:class:`OptimizerStep`. The LR schedule is the step's, not DeepSpeed's (``deepspeed.initialize`` gets none). What
DeepSpeed's public API lacks is in ``deepspeed_adapter.py`` (docs/training.md).

A batch from the loader is ``{"text": LongTensor[b, s+1]}``; the model sees ``tokens = text[:, :-1]`` and is
scored on ``labels = text[:, 1:]`` under ``loss_mask`` (GPT-NeoX's ``_get_batch``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_values
from megatron.engine_protocol import Engine, PipelineEngine
from megatron.logging.timers import Timers
from megatron.model import get_ltor_masks_and_position_ids
from megatron.model.gpt2_model import cross_entropy
from megatron.neox_arguments.sections.other import LossMaskKeys
from megatron.neox_arguments.sections.training import BatchMaskKeys
from megatron.training.curriculum import SeqlenCurriculum, truncate
from megatron.training.deepspeed_adapter import (
    manual_loss_scale,
    pipeline_loss_sum,
    reduced_gradients,
    run_optimizer_step_through,
    skip_optimizer_step,
)
from megatron.training.grad_clipping import fp32_clipping_for
from megatron.training.learning_rates import AnnealingLR
from megatron.training.nonfinite import StepGuard, Verdict

Batch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(kw_only=True)  # eod_token (not a key) has no default
class BatchConfig(LossMaskKeys, BatchMaskKeys):
    """How token batches become model inputs."""

    eod_token: int
    with_labels: bool = False  # label datasets (SFT): a "label" stream, negative ids excluded from the loss

    # not config keys: the tokenizer's end-of-document id, and whether train_label_data_paths is set
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("eod_token", "with_labels")

    @classmethod
    def from_neox_args(cls, args: NeoXValues, eod_token: int) -> BatchConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        return cls(**neox_values(cls, args), eod_token=eod_token, with_labels=bool(args.train_label_data_paths))


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
    """Mean of a scalar loss over the whole world (GPT-NeoX's ``reduce_losses``; evaluation)."""
    reduced = loss.detach().clone().float().reshape(1)
    if mpu.world_size() > 1:
        mpu.all_reduce_sum(reduced)
        reduced /= mpu.world_size()
    return reduced[0]


def uses_fused_loss(engine: Engine, loss_fn: Any) -> bool:
    """True when the step may ask the model for its loss directly (GPT-NeoX's LM loss, a model that can fuse)."""
    weight_of = getattr(engine.module, "fused_loss_weight", None)
    return loss_fn is cross_entropy and callable(weight_of) and weight_of() is not None


@dataclass
class StepResult:
    """What one training iteration produced."""

    lm_loss: float
    skipped: bool
    extra: dict[str, float] = field(default_factory=dict)  # objective metrics (post-training), logged as given
    stop: float = 0.0  # preemption, reduced over ranks with the step (2 a signal, 1 out of time, 0 go on)
    seq_length: int | None = None  # curriculum learning: the length this iteration's batches were cut to


class OptimizerStep:
    """What follows the last backward of an iteration: the gradient norm and clipping, the non-finite / loss-spike
    decision, then the optimizer step and the LR step, or the skip. ``AccumulatingStep.train`` calls the pieces in
    that order itself; under the pipeline engine DeepSpeed's schedule calls :meth:`PipelineOptimizerStep.__call__`
    at its ``OptimizerStep`` instruction (``deepspeed_adapter.run_optimizer_step_through``), which runs the same
    pieces."""

    def __init__(self, engine: Engine, guard: StepGuard, lr_scheduler: AnnealingLR | None) -> None:
        if lr_scheduler is not None and getattr(engine, "lr_scheduler", None) is not None:
            raise ValueError("the engine has an LR schedule of its own: the step would move the learning rate twice")
        self.engine, self.guard, self.lr_scheduler = engine, guard, lr_scheduler
        self.clip = fp32_clipping_for(engine)  # None: DeepSpeed's wrapper optimizer clips inside engine.step()
        self.grad_norm: torch.Tensor | None = None  # the last step's norm before clipping (plain fp32 optimizer)
        self.stop_flag: Callable[[], float] | None = None  # this rank's preemption flag (training/preemption.py)
        self.last: Verdict | None = None
        self.grad_probe: Callable[[], None] | None = None  # reads the reduced gradients before clipping (logging)

    def clip_gradients(self) -> None:
        """Gradient norm and clipping of a plain fp32 optimizer (device tensors, no host read); a wrapper optimizer
        (ZeRO, fp16, bf16) clips inside ``engine.step()``."""
        if self.clip is not None:
            self.grad_norm = self.clip()

    def decide(
        self,
        losses: torch.Tensor | None,
        metrics: dict[str, torch.Tensor] | None = None,
        loss_ranks: int | None = None,
    ) -> Verdict:
        """Apply or skip: the step's one all-reduce and one host read (losses, metrics, non-finite and stop flags);
        ``loss_ranks``: how many ranks contribute losses (None: all)."""
        stop = self.stop_flag() if self.stop_flag is not None else 0.0
        iteration = int(self.engine.global_steps) + 1
        gradients = reduced_gradients(self.engine)
        self.last = self.guard.decide(losses, gradients, iteration, metrics, stop, loss_ranks)
        return self.last

    def step_lr(self) -> None:
        """The LR step, after an applied optimizer step (``engine.was_step_applied()`` is False after an fp16
        overflow, whose step DeepSpeed skipped); None: the engine's LR is constant."""
        if self.lr_scheduler is not None and self.engine.was_step_applied():
            self.lr_scheduler.step()

    def global_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (host read: logging only)."""
        if self.grad_norm is not None:
            return float(self.grad_norm)
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)


class PipelineOptimizerStep(OptimizerStep):
    """:class:`OptimizerStep` as the pipeline schedule's optimizer step (DeepSpeed's ``PipelineEngine``)."""

    def __init__(self, engine: PipelineEngine, guard: StepGuard, lr_scheduler: AnnealingLR | None) -> None:
        super().__init__(engine, guard, lr_scheduler)
        self.pipe = engine

    def pipeline_loss(self) -> tuple[torch.Tensor, int]:
        """This rank's share of the pipeline's loss and how many ranks have one: the last stage's micro-batch losses
        of the iteration, averaged over ``gas`` as DeepSpeed's ``_aggregate_total_loss`` does, on tensor-parallel
        rank 0 of the last stage (one value per data-parallel rank, as DeepSpeed reduces); zero on every other rank.
        The step's reduction then averages it over the data-parallel ranks: train_batch's value, on every rank."""
        total = pipeline_loss_sum(self.pipe)
        if total is None or mpu.get_model_parallel_rank() != 0:
            device = total.device if total is not None else get_accelerator().current_device_name()
            return torch.zeros(1, device=device), mpu.get_data_parallel_world_size()
        # the very operation of DeepSpeed's ``_scale_loss_by_gas`` (a tensor / a Python int): the same bits
        return (total / self.pipe.gradient_accumulation_steps()).float(), mpu.get_data_parallel_world_size()

    def __call__(self, apply: Callable[[], None]) -> Verdict:
        """The pipeline schedule's optimizer step; ``apply`` is DeepSpeed's (``optimizer.step()``, ``zero_grad``, the
        counters; fp16 overflows are skipped there), followed by the LR step. The last stage's losses of
        the iteration are complete here (``deepspeed_adapter.pipeline_loss_sum``), so the decision sees the loss as
        the sequential step's does: non-finite and loss-spike skips, and the iteration's loss in its one host read."""
        if self.grad_probe is not None:
            self.grad_probe()
        self.clip_gradients()
        loss, loss_ranks = self.pipeline_loss()
        verdict = self.decide(loss, loss_ranks=loss_ranks)
        if verdict.apply:
            apply()
            self.step_lr()
        else:
            skip_optimizer_step(self.engine, count_micro_step=False)  # train_batch counts no micro-steps
        return verdict


class AccumulatingStep(ABC):
    """``gas`` × (forward, ``engine.backward``), then :class:`OptimizerStep`; one host read per iteration. What one
    forward is (batch and loss) is the subclass's: language modelling (:class:`SequentialStep`) or a post-training
    objective (``post_training_step.PostTrainStep``)."""

    def __init__(
        self, engine: Engine, gas: int, timers: Timers, lr_scheduler: AnnealingLR | None, guard: StepGuard
    ) -> None:
        self.engine, self.gas, self.timers = engine, gas, timers
        self.optimizer_step = OptimizerStep(engine, guard, lr_scheduler)

    @abstractmethod
    def forward(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> torch.Tensor:
        """Forward one micro-batch; returns the loss."""

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward`` (with the fp16 loss scale DeepSpeed leaves to the caller without ZeRO)."""
        scale = manual_loss_scale(self.engine)
        self.engine.backward(loss * scale if scale is not None else loss)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """This rank's metrics of the iteration, averaged over ranks with the loss (none for language modelling)."""
        return {}

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration over ``gas`` micro-batches."""
        skipped_before = self.engine.skipped_steps
        losses = []
        for micro in range(self.gas):
            self.timers("forward").start()
            loss = self.forward(data_iter)
            self.timers("forward").stop()
            self.timers("backward").start()
            self.backward(loss)  # the boundary backward also reduces the gradients over data-parallel ranks
            self.timers("backward").stop()
            losses.append(loss.detach().float().reshape(1))  # kept on the device
            if micro < self.gas - 1:
                self.timers("optimizer").start()
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-batch
                self.timers("optimizer").stop()
        assert self.engine.is_gradient_accumulation_boundary()
        if self.optimizer_step.grad_probe is not None:
            self.optimizer_step.grad_probe()
        self.timers("optimizer").start()
        self.optimizer_step.clip_gradients()  # norm + clipping (plain fp32; wrapped optimizers clip in engine.step())
        verdict = self.optimizer_step.decide(torch.cat(losses), self.step_metrics())  # one all-reduce, one host read
        if verdict.apply:
            self.engine.step()  # optimizer.step(), zero_grad, the counters (an fp16 overflow: skipped)
            self.optimizer_step.step_lr()  # unless DeepSpeed skipped the step
        else:
            skip_optimizer_step(self.engine, count_micro_step=True)  # drop the gradients; weights and LR unchanged
        self.timers("optimizer").stop()
        assert verdict.lm_loss is not None
        skipped = not verdict.apply or self.engine.skipped_steps > skipped_before  # ours, or an fp16 overflow
        return StepResult(verdict.lm_loss, skipped, verdict.metrics, verdict.stop)

    def global_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (logging)."""
        return self.optimizer_step.global_grad_norm()

    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> float:
        """Mean loss of ``gas`` forward passes (one evaluation iteration)."""
        return torch.stack([reduce_losses(self.forward(data_iter)) for _ in range(self.gas)]).mean().item()


class SequentialStep(AccumulatingStep):
    """Language modelling: the token batch (``get_batch``) and ``loss_fn`` on the model's logits (or the model's
    fused loss)."""

    def __init__(
        self,
        engine: Engine,
        loss_fn: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], torch.Tensor],
        batch_cfg: BatchConfig,
        gas: int,
        timers: Timers,
        lr_scheduler: AnnealingLR | None,
        guard: StepGuard,
    ) -> None:
        super().__init__(engine, gas, timers, lr_scheduler, guard)
        self.loss_fn, self.batch_cfg = loss_fn, batch_cfg
        self.fused_loss = uses_fused_loss(engine, loss_fn)
        self.curriculum: SeqlenCurriculum | None = None  # curriculum_learning (build_step sets it)
        self._seqlen: int | None = None  # the training iteration's curriculum length (None: the batch's own)

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration; with ``curriculum_learning`` its batches are cut to the schedule's length."""
        if self.curriculum is None:
            return super().train(data_iter)
        self._seqlen = self.curriculum.advance()
        try:
            result = super().train(data_iter)
        finally:
            self._seqlen = None
        result.seq_length = self.curriculum.seqlen
        return result

    def forward(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> torch.Tensor:
        """Forward one micro-batch; returns the loss."""
        self.timers("batch generator").start()
        batch = get_batch(next(data_iter) if data_iter is not None else None, self.batch_cfg)
        inputs, targets = truncate(batch, self._seqlen) if self._seqlen is not None else batch
        self.timers("batch generator").stop()
        if self.fused_loss:  # output layer + loss in one chunked pass (same loss, no [b, s, V] logits)
            return self.engine(inputs, loss_targets=targets)
        logits = self.engine(inputs)
        return self.loss_fn(logits, targets)


class PipeStep:
    """``engine.train_batch`` / ``engine.eval_batch`` over DeepSpeed's 1F1B schedule.

    The pipeline engine runs forward, backward and the optimizer step inside ``train_batch``; its ``OptimizerStep``
    instruction calls the same :class:`OptimizerStep` pieces as the sequential step (:class:`PipelineOptimizerStep`) (clipping, decision, step or skip).
    There the last stage has the iteration's micro-batch losses already, so the decision's one reduction carries
    the loss (non-finite and loss-spike skips as in the sequential step) and its one host read yields the value
    ``train_batch`` returns, on every rank; that tensor (DeepSpeed's own aggregate) is not read."""

    def __init__(
        self,
        engine: PipelineEngine,
        batch_cfg: BatchConfig,
        timers: Timers,
        lr_scheduler: AnnealingLR | None,
        guard: StepGuard,
    ) -> None:
        self.engine, self.batch_cfg, self.timers = engine, batch_cfg, timers
        self.optimizer_step = PipelineOptimizerStep(engine, guard, lr_scheduler)
        run_optimizer_step_through(engine, self.optimizer_step)  # its schedule calls OptimizerStep.__call__
        self.curriculum: SeqlenCurriculum | None = None  # curriculum_learning (build_step sets it)
        self._sent_len: int | None = None  # the length the stages' activation buffers hold (None: the full one)

    def _batches(self, data_iter: Iterator[dict[str, torch.Tensor]] | None, seqlen: int | None) -> Iterator[Batch]:
        """The micro-batches of one ``train_batch``/``eval_batch`` (cut to ``seqlen``); on every stage, before it
        runs (only the first and last stages read batches), a new length resizes DeepSpeed's activation buffers."""
        if self.curriculum is not None and seqlen != self._sent_len:
            self.engine.reset_activation_shape()
            self._sent_len = seqlen
        return self._read(data_iter, seqlen)

    def _read(self, data_iter: Iterator[dict[str, torch.Tensor]] | None, seqlen: int | None) -> Iterator[Batch]:
        while True:
            batch = get_batch(next(data_iter) if data_iter is not None else None, self.batch_cfg)
            yield truncate(batch, seqlen) if seqlen is not None else batch

    def train(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> StepResult:
        """One iteration (``gas`` micro-batches, then the optimizer step, inside the engine); with
        ``curriculum_learning`` its batches are cut to the schedule's length."""
        seqlen = self.curriculum.advance() if self.curriculum is not None else None
        skipped_before = self.engine.skipped_steps
        self.optimizer_step.last = None
        batches = self._batches(data_iter, seqlen)
        self.engine.train_batch(data_iter=batches)  # its return value: the loss decided on already
        verdict = self.optimizer_step.last
        assert verdict is not None and verdict.lm_loss is not None, "train_batch ran no optimizer step"
        skipped = not verdict.apply or self.engine.skipped_steps > skipped_before  # ours, or an fp16 overflow
        return StepResult(verdict.lm_loss, skipped, stop=verdict.stop, seq_length=seqlen)

    def global_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (logging)."""
        return self.optimizer_step.global_grad_norm()

    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[dict[str, torch.Tensor]] | None) -> float:
        """Mean loss of one ``eval_batch``."""
        loss = self.engine.eval_batch(data_iter=self._batches(data_iter, None))
        return float(loss)


def is_nan(value: float) -> bool:
    """True for NaN or ±inf losses (GPT-NeoX counts them as NaN iterations)."""
    return math.isnan(value) or math.isinf(value)
