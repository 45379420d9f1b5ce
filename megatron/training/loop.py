"""The training loop, top to bottom: ``train()`` calls a step variant, logs, evaluates, saves, exits."""

from __future__ import annotations

import logging
import math
import os
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_overrides, require_keys
from megatron.engine_protocol import Engine
from megatron.errors import UserError
from megatron.logging.flops import FlopsConfig, flops_formula, throughput_metrics
from megatron.logging.metrics import LoggingConfig, Metrics, format_console_line
from megatron.logging.progress import progress
from megatron.logging.run_observer import RunObserver
from megatron.logging.timers import Timers
from megatron.model.moe import moe_metrics
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.logging import ProfilingKeys
from megatron.neox_arguments.sections.training import IterationKeys
from megatron.training.memory_usage import log_param_optimizer_bytes
from megatron.training.param_metrics import ParamMetrics
from megatron.training.step import AccumulatingStep, PipeStep, StepResult, is_nan

logger = logging.getLogger("megatron.train")

TIMER_NAMES = ["forward", "backward", "optimizer", "batch generator"]
MAX_CONSECUTIVE_OVERFLOWS = 50  # GPT-NeoX's OverflowMonitor limit


@dataclass
class LoopConfig(IterationKeys, BatchSizeKeys, ProfilingKeys):
    """Loop keys of a GPT-NeoX config."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> LoopConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        if args.train_iters is None:
            raise ConfigError("train_iters must be set (train_epochs is converted to train_iters by the config)")
        values = neox_overrides(cls, args)
        return cls(**values)

    def __post_init__(self) -> None:
        require_keys(self, ("train_iters", "train_batch_size"))

    @property
    def iterations(self) -> int:
        """``train_iters``, typed without None: a loop config requires it (``__post_init__``)."""
        return typing.cast(int, self.train_iters)


@dataclass
class LoopState:
    """Counters that survive across iterations."""

    iteration: int
    skipped_iters: int = 0
    nan_iters: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    history: list[float] = field(default_factory=list)  # lm loss of every iteration (rank-reduced)
    exited_early: bool = False
    preempted: bool = False  # stopped by a signal or exit_duration_in_mins (see training/preemption.py)
    consecutive_skips: int = 0


class Profiler:
    """torch.profiler between ``profile_step_start`` and ``profile_step_stop`` (chrome trace per rank)."""

    def __init__(self, cfg: LoopConfig, out_dir: str) -> None:
        self.cfg, self.out_dir = cfg, out_dir
        self.prof: torch.profiler.profile | None = None

    def before(self, iteration: int) -> None:
        """Start at ``profile_step_start``."""
        if self.cfg.profile and iteration == self.cfg.profile_step_start and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
        if self.cfg.memory_profiling and iteration == self.cfg.profile_step_start:
            if torch.cuda.is_available():
                torch.cuda.memory._record_memory_history(max_entries=100000)
            else:
                logger.warning("memory_profiling needs CUDA memory snapshots; ignored on CPU")

    def after(self, iteration: int) -> None:
        """Stop at ``profile_step_stop`` and write the trace."""
        if self.prof is not None and iteration >= self.cfg.profile_step_stop:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.out_dir, exist_ok=True)
            rank = mpu.world_rank()
            path = os.path.join(self.out_dir, f"profile_rank{rank}.json")
            self.prof.export_chrome_trace(path)
            logger.info("profiler trace written to %s", path)
            self.prof = None
        if self.cfg.memory_profiling and torch.cuda.is_available() and iteration == self.cfg.profile_step_stop:
            path = self.cfg.memory_profiling_path or os.path.join(self.out_dir, "memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)


def _loss_scale(engine: Engine) -> float | None:
    opt = getattr(engine, "optimizer", None)
    for name in ("cur_scale", "loss_scale"):
        value = getattr(opt, name, None)
        if isinstance(value, int | float) or torch.is_tensor(value):
            return float(value)
    return None


def param_norm(engine: Engine) -> float:
    """Global L2 norm of the parameters (TP shards and ZeRO-3 partitions summed once)."""
    total = torch.zeros(1, dtype=torch.float64)
    tp_total = torch.zeros(1, dtype=torch.float64)
    zero3 = False
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            zero3 = True
            total += p.ds_tensor.detach().double().pow(2).sum().cpu()
        elif getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False):
            tp_total += p.detach().double().pow(2).sum().cpu()
        elif mpu.get_model_parallel_rank() == 0:
            total += p.detach().double().pow(2).sum().cpu()
    if zero3:
        mpu.all_reduce_sum(total, group="data")
    if mpu.get_model_parallel_world_size() > 1:
        mpu.all_reduce_sum(tp_total, group="model")
        mpu.all_reduce_sum(total, group="model")
    return math.sqrt(float(total + tp_total))


class Trainer:
    """Runs ``train()`` and ``evaluate()`` with one step variant and one metrics fan-out."""

    def __init__(
        self,
        *,
        engine: Engine,
        step: AccumulatingStep | PipeStep,
        loop_cfg: LoopConfig,
        log_cfg: LoggingConfig,
        flops_cfg: FlopsConfig,
        metrics: Metrics,
        timers: Timers,
        save_fn: Callable[[int], None] | None = None,
        is_save_iter: Callable[[int], bool] | None = None,
        profile_dir: str = ".",
        task_eval: Callable[[], dict[str, float]] | None = None,
        char_counter: Callable[[Iterator[Any] | None], Any] | None = None,
        observer: RunObserver | None = None,
        on_step: Callable[[int, StepResult], None] | None = None,
    ) -> None:
        self.engine, self.step, self.loop_cfg, self.log_cfg = engine, step, loop_cfg, log_cfg
        self.flops_cfg, self.metrics, self.timers = flops_cfg, metrics, timers
        self.save_fn, self.is_save_iter = save_fn, is_save_iter
        self.profiler = Profiler(loop_cfg, profile_dir)
        self.task_eval, self.char_counter = task_eval, char_counter  # eval_tasks / char_level_ppl (evaluation/)
        self.rank = mpu.world_rank()
        self.world = mpu.world_size()
        self.consumed_valid = 0  # validation samples read so far (all DP ranks), saved with checkpoints
        # preemption: (iteration, the step's reduced stop flag) -> True on every rank to stop now
        self.stop_check: Callable[[int, float], bool] | None = None
        self.observer = observer or RunObserver(loop_cfg.iterations, loop_cfg.train_batch_size, flops_cfg.seq_length)
        self.on_step = on_step  # called with (iteration, result) after every training step, on every rank
        # GPT-NeoX's per-parameter metrics and gradient noise scale (every iteration); gradients are read in the step, before clipping
        self.param_metrics = ParamMetrics(engine, log_cfg, loop_cfg.train_batch_size)
        if self.param_metrics.wants_gradients:
            step.optimizer_step.grad_probe = self.param_metrics.capture_gradients

    def _lr(self) -> float:
        """The learning rate of the first param group; a pipeline stage with nothing to train (soft prompt tuning
        freezes every stage but the prefix's) has no group, so its schedule says."""
        optimizer, schedule = self.engine.optimizer, self.step.optimizer_step.lr_scheduler
        if optimizer is not None and optimizer.param_groups:
            return float(optimizer.param_groups[0]["lr"])
        return float(schedule.get_lr()) if schedule is not None else 0.0

    def train(self, state: LoopState, train_iter: Iterator[Any] | None, valid_iter: Iterator[Any] | None) -> LoopState:
        """Iterate until ``train_iters``; log every ``log_interval``, evaluate every ``eval_interval``."""
        self.engine.train()
        cfg = self.loop_cfg
        interval_time = 0.0  # seconds spent in training steps since the last log line (not eval/saves)
        interval_iters = 0
        interval_lengths: list[int] = []  # curriculum learning: each iteration's sequence length since the last log
        while state.iteration < cfg.iterations:
            self.profiler.before(state.iteration + 1)
            start = _now()
            result = self.step.train(train_iter)
            interval_time += _now() - start
            state.iteration += 1
            interval_iters += 1
            self.profiler.after(state.iteration)
            state.history.append(result.lm_loss)
            if self.on_step is not None:
                self.on_step(state.iteration, result)
            self._count(state, result)
            scalars = {"train/lm_loss": result.lm_loss, "train/learning_rate": self._lr()}
            scalars.update(result.extra)
            scalars.update(moe_metrics(self.engine.module))  # router statistics (empty for dense models)
            if result.seq_length is not None:  # GPT-NeoX's curriculum_seqlen metric
                scalars["train/curriculum_seqlen"] = float(result.seq_length)
                interval_lengths.append(result.seq_length)
            scale = _loss_scale(self.engine)
            if scale is not None and getattr(self.engine, "fp16_enabled", lambda: False)():
                scalars["train/loss_scale"] = scale
            if self.log_cfg.log_grad_norm:
                grad_norm = self.step.global_grad_norm()
                if grad_norm is not None:
                    scalars["train/grad_norm"] = float(grad_norm)
            if self.log_cfg.log_param_norm:
                scalars["train/param_norm"] = param_norm(self.engine)
            # GPT-NeoX writes timers/<name> every iteration: seconds per iteration since the last log line
            scalars.update(self.timers.breakdown(TIMER_NAMES, normalizer=interval_iters, reset=False))
            scalars.update(self.param_metrics.collect())
            if len(state.history) == 1:  # once, after this run's first step (optimizer state exists by then)
                scalars.update(log_param_optimizer_bytes(self.engine))
            if state.iteration % self.log_cfg.log_interval == 0:
                lengths = interval_lengths or None
                scalars.update(throughput_metrics(self.flops_cfg, interval_time / interval_iters, self.world, lengths))
                scalars.update(self.observer.interval(state.iteration, interval_time, interval_iters))  # ETA, memory
                self.observer.observe(scalars)
                self._console(state, scalars)
                interval_time, interval_iters, interval_lengths = 0.0, 0, []
            self.metrics.log(scalars, state.iteration)
            if cfg.eval_interval and cfg.eval_iters > 0 and state.iteration % cfg.eval_interval == 0 and valid_iter:
                self.evaluate("validation", valid_iter, state.iteration)
            # After the evaluation, so that the saved validation position includes it (exact resume).
            if self.save_fn is not None and self.is_save_iter is not None and self.is_save_iter(state.iteration):
                self.save_fn(state.iteration)
            if cfg.exit_interval and state.iteration % cfg.exit_interval == 0:
                mpu.barrier()
                if self.rank == 0:
                    logger.info("exit_interval: exiting at iteration %d", state.iteration)
                state.exited_early = True
                break
            if self.stop_check is not None and self.stop_check(state.iteration, result.stop):
                state.exited_early = state.preempted = True
                break
        return state

    @staticmethod
    def _count(state: LoopState, result: StepResult) -> None:
        """Skipped (fp16 overflow) and NaN iterations are counted and left out of the interval's mean loss."""
        if not result.skipped:
            state.consecutive_skips = 0
            if is_nan(result.lm_loss):
                state.nan_iters += 1
            else:
                state.loss_sum += result.lm_loss
                state.loss_count += 1
            return
        state.skipped_iters += 1
        state.consecutive_skips += 1
        if state.consecutive_skips >= MAX_CONSECUTIVE_OVERFLOWS:
            raise UserError(
                f"{state.consecutive_skips} consecutive fp16 overflows (iteration {state.iteration}): the loss "
                "scale cannot recover; lower the learning rate, check the data, or use bf16"
            )

    def _console(self, state: LoopState, scalars: dict[str, float]) -> None:
        mean = state.loss_sum / state.loss_count if state.loss_count else float("nan")
        counts = {"number of skipped iterations": state.skipped_iters, "number of nan iterations": state.nan_iters}
        line = format_console_line(state.iteration, self.loop_cfg.iterations, scalars, {"lm_loss": mean}, counts)
        state.loss_sum, state.loss_count = 0.0, 0
        state.skipped_iters = state.nan_iters = 0
        if self.log_cfg.wall_clock_breakdown:
            line += "\n" + self.timers.format({k: v for k, v in scalars.items() if k.startswith("timers/")})
        self.timers.reset(TIMER_NAMES)
        if self.rank == 0:
            logger.info(line)
            if self.flops_cfg and state.iteration == self.log_cfg.log_interval:
                logger.info("FLOPs per iteration formula: %s", flops_formula(self.flops_cfg))

    def evaluate(self, prefix: str, data_iter: Iterator[Any] | None, iteration: int) -> dict[str, float]:
        """``eval_iters`` evaluation iterations; logs ``<prefix>/lm_loss`` and ``<prefix>/lm_loss_ppl``."""
        self.engine.eval()
        counter = self.char_counter(data_iter) if self.char_counter is not None else None
        feed = counter if counter is not None and data_iter is not None else data_iter
        batches = progress(range(self.loop_cfg.eval_iters), desc=f"{prefix} at iteration {iteration}", unit="batch")
        losses = [self.step.evaluate(feed) for _ in batches]  # the bar: rank 0 on a terminal only
        self.engine.train()
        loss = sum(losses) / max(len(losses), 1)
        if prefix == "validation":
            self.consumed_valid += self.loop_cfg.eval_iters * self.loop_cfg.train_batch_size
        results = {f"{prefix}/lm_loss": loss, f"{prefix}/lm_loss_ppl": math.exp(min(loss, 80.0))}
        if counter is not None:  # every rank joins the count's all-reduce
            results[f"{prefix}/lm_loss_char_lvl_ppl"] = math.exp(min(loss * counter.tokens_per_char(), 80.0))
        if self.task_eval is not None and prefix == "validation":
            results.update({f"{prefix}/{k}": v for k, v in self.task_eval().items()})
        self.metrics.log(results, iteration)
        self.observer.evaluated(prefix, loss)
        if self.rank == 0:
            logger.info(
                "%s results at iteration %d | lm_loss value: %.6E | lm_loss_ppl value: %.6E",
                prefix,
                iteration,
                loss,
                results[f"{prefix}/lm_loss_ppl"],
            )
        return results


def _now() -> float:
    return time.perf_counter()
