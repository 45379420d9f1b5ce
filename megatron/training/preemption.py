"""Preemption: a signal (``preemption_signals``, default SIGTERM and SIGUSR1) or the wall-clock budget
(``exit_duration_in_mins``) makes every rank save at the next step boundary and exit with :data:`REQUEUE_EXIT_CODE`.
A signal before the first step (also one ``train.py``'s start-up handlers caught) stops every rank without a save,
with ``STOPPED_EXIT_CODE`` (``megatron/training/startup_signals.py``).

A signal may reach only one rank, so the flag is all-reduced (MAX) over the world once per step: every rank stops
after the same iteration and saves the same checkpoint. The budget is checked the same way (each rank's clock,
agreed by the all-reduce). A scheduler wrapper can requeue the job when the exit code is 42; restarting with the
same command resumes from that checkpoint (``load`` equal to ``save`` or ``load: auto``).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_overrides
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.training import PreemptionKeys
from megatron.neox_arguments.value_checks import check_preemption_keys
from megatron.training.startup_signals import REQUEUE_EXIT_CODE, STOPPED_EXIT_CODE, StartupSignals

logger = logging.getLogger("megatron.train")


@dataclass
class PreemptionConfig(PreemptionKeys):
    """Keys that end a run early to be requeued."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> PreemptionConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        cfg = cls(**neox_overrides(cls, args))
        cfg.preemption_signals = list(cfg.preemption_signals)
        problems = check_preemption_keys(cfg.preemption_signals, cfg.exit_duration_in_mins)
        if problems:
            raise ConfigError(problems)
        return cfg


class Preemption:
    """Signal handlers plus the per-step agreement on stopping."""

    def __init__(self, cfg: PreemptionConfig, start: float | None = None) -> None:
        self.cfg = cfg
        self.start = time.monotonic() if start is None else start
        self.received: str | None = None
        self.reason = ""
        self._previous: dict[signal.Signals, Any] = {}

    def install(self, startup: StartupSignals | None = None) -> Preemption:
        """Install the handlers (they only set a flag); :meth:`uninstall` restores the previous ones.

        A signal the start-up handlers (``startup``) recorded counts as received here; those of its signals that are
        not preemption signals get their previous (default) action back."""
        if startup is not None:
            startup.keep_only(self.cfg.preemption_signals)
        for name in self.cfg.preemption_signals:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)
        if startup is not None and startup.received and self.received is None:
            self.received = startup.received
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def local_flag(self) -> float:
        """This rank's reason to stop: 2.0 a signal, 1.0 out of time, 0.0 none (the training step reduces it with
        its own values, so that stopping costs no extra all-reduce)."""
        out_of_time = (
            self.cfg.exit_duration_in_mins is not None
            and time.monotonic() - self.start >= 60.0 * self.cfg.exit_duration_in_mins
        )
        return 2.0 if self.received else 1.0 if out_of_time else 0.0

    def should_stop(self, iteration: int) -> bool:
        """True on every rank when any rank got a signal or ran out of time (one all-reduce per call)."""
        flag = torch.tensor([self.local_flag()], dtype=torch.float32)
        if mpu.world_size() > 1:
            mpu.all_reduce_max(flag)
        return self.stop_from(float(flag[0]), iteration)

    def stop_before_training(self, iteration: int) -> bool:
        """True on every rank when any rank got a signal before the first step (one all-reduce): nothing was trained,
        so nothing is saved; the rank ends with :data:`STOPPED_EXIT_CODE`. Logged on rank 0."""
        flag = torch.tensor([1.0 if self.received else 0.0], dtype=torch.float32)
        if mpu.world_size() > 1:
            mpu.all_reduce_max(flag)
        if float(flag[0]) == 0.0:
            return False
        if mpu.world_rank() == 0:
            logger.warning(
                "a preemption signal before the first training step: nothing to save (iteration %d is unchanged), "
                "exiting with status %d",
                iteration,
                STOPPED_EXIT_CODE,
            )
        return True

    def stop_from(self, value: float, iteration: int) -> bool:
        """True when ``value`` (the max of every rank's :meth:`local_flag`) asks to stop; logs why on rank 0."""
        if value == 0.0:
            return False
        self.reason = (
            "a preemption signal" if value == 2.0 else f"exit_duration_in_mins={self.cfg.exit_duration_in_mins}"
        )
        rank = mpu.world_rank()
        if rank == 0:
            logger.warning(
                "%s: saving at iteration %d and exiting with requeue exit code %d",
                self.reason,
                iteration,
                REQUEUE_EXIT_CODE,
            )
        return True
