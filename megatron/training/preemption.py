"""Preemption: a signal (``preemption_signals``, default SIGTERM and SIGUSR1) or the wall-clock budget
(``exit_duration_in_mins``) makes every rank save at the next step boundary and exit with :data:`REQUEUE_EXIT_CODE`.

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
from megatron.config_utils import NeoXValues, from_schema, neox_overrides, schema_defaults
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.value_checks import check_preemption_keys

logger = logging.getLogger("megatron.train")

REQUEUE_EXIT_CODE = 42


@dataclass
@schema_defaults
class PreemptionConfig:
    """Keys that end a run early to be requeued."""

    preemption_signals: list = from_schema()
    exit_duration_in_mins: float | None = from_schema()

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

    def install(self) -> Preemption:
        """Install the handlers (they only set a flag); :meth:`uninstall` restores the previous ones."""
        for name in self.cfg.preemption_signals:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)
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
