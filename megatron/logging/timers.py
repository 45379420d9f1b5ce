"""Named wall-clock timers, as GPT-NeoX's ``Timers``: ``timers/<name>`` in seconds per iteration to TensorBoard/W&B
every iteration; the console's ``time (ms)`` line with ``wall_clock_breakdown``."""

from __future__ import annotations

import time


class Timer:
    """Accumulates elapsed seconds between ``start`` and ``stop``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.elapsed_ = 0.0
        self.started = False
        self._start = 0.0

    def start(self) -> None:
        """Start (error if already running)."""
        if self.started:
            raise RuntimeError(f"timer {self.name} already started")
        self._start = time.perf_counter()
        self.started = True

    def stop(self) -> None:
        """Stop and add the interval (error if not running)."""
        if not self.started:
            raise RuntimeError(f"timer {self.name} is not started")
        self.elapsed_ += time.perf_counter() - self._start
        self.started = False

    def reset(self) -> None:
        """Forget the accumulated time."""
        self.elapsed_ = 0.0
        self.started = False

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (including a running interval); resets by default."""
        running = self.started
        if running:
            self.stop()
        value = self.elapsed_
        if reset:
            self.reset()
        if running:
            self.start()
        return value


class Timers:
    """A dict of timers created on first use."""

    def __init__(self) -> None:
        self.timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = Timer(name)
        return self.timers[name]

    def breakdown(
        self, names: list[str] | None = None, normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """``{"timers/<name>": seconds / normalizer}`` for the given (default: all) timers (GPT-NeoX's units)."""
        chosen = names if names is not None else list(self.timers)
        return {f"timers/{n}": self.timers[n].elapsed(reset=reset) / normalizer for n in chosen if n in self.timers}

    def reset(self, names: list[str] | None = None) -> None:
        """Forget the accumulated time of the given (default: all) timers."""
        for name in names if names is not None else list(self.timers):
            if name in self.timers:
                self.timers[name].reset()

    def format(self, values: dict[str, float]) -> str:
        """``time (ms) | forward: 1.23 | backward: 4.56`` from :meth:`breakdown`'s seconds."""
        return "time (ms) | " + " | ".join(f"{k.removeprefix('timers/')}: {v * 1000.0:.2f}" for k, v in values.items())
