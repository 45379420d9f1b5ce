"""``torch_compile: true``: the transformer layers compiled with ``torch.compile``, and the compile time logged.

Each ``ParallelTransformerLayerPipe`` is compiled in place (``nn.Module.compile``: parameter names, and so
checkpoints, stay the same). The layers share one forward, so dynamo traces it once and every layer reuses the
graph; inductor builds the forward and backward kernels during the first training step. That step therefore
includes the compilation: :class:`CompileTimer` logs once, after a few steps, the first step's time next to
the later steps' median and their difference as the compile time. The layouts it cannot run in are refused
when the configuration is validated (:mod:`megatron.neox_arguments.compile_checks`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from megatron import mpu
from megatron.model.transformer import ParallelTransformerLayerPipe

logger = logging.getLogger("megatron.train")

STEPS_TIMED = 3  # the first step and up to two more before the log line


def compile_transformer_layers(model: nn.Module) -> int:
    """Compile every transformer layer of ``model`` in place; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, ParallelTransformerLayerPipe)]
    for layer in layers:
        layer.compile()
    if mpu.world_rank() == 0:
        logger.info("torch_compile: %d transformer layers compiled with torch.compile (inductor)", len(layers))
    return len(layers)


class CompileTimer:
    """Times the first ``STEPS_TIMED`` calls of a step's ``train`` to report what compiling cost."""

    def __init__(self, train: Callable[[Any], Any], steps_in_run: int) -> None:
        self._train = train
        self.times: list[float] = []
        self.report_after = max(1, min(STEPS_TIMED, steps_in_run))
        self.compile_seconds: float | None = None

    def train(self, data_iter: Any) -> Any:
        """One training step (the wrapped ``train``)."""
        if len(self.times) >= self.report_after:
            return self._train(data_iter)
        start = time.perf_counter()
        result = self._train(data_iter)
        self.times.append(time.perf_counter() - start)
        if len(self.times) == self.report_after:
            self._report()
        return result

    def _report(self) -> None:
        first, later = self.times[0], self.times[1:]
        if not later:
            self.compile_seconds = first
            message = f"torch_compile: first step {first:.2f} s (includes compiling; no later step to compare)"
        else:
            typical = statistics.median(later)
            self.compile_seconds = max(0.0, first - typical)
            message = (
                f"torch_compile: compile time ≈ {self.compile_seconds:.2f} s (first step {first:.2f} s, "
                f"then {typical:.3f} s per step)"
            )
        if mpu.world_rank() == 0:
            logger.info(message)


def time_compiled_steps(step: Any, steps_in_run: int) -> CompileTimer:
    """Route ``step.train`` through a :class:`CompileTimer` (this step object only); returns the timer."""
    timer = CompileTimer(step.train, steps_in_run)
    setattr(step, "train", timer.train)  # noqa: B010  (an instance attribute shadowing the method)
    return timer
