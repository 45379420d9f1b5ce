"""A rank's stop signals from its first line on, before the preemption handlers exist (standard library only).

``train.py`` installs :class:`StartupSignals` before it imports anything heavy, so a SIGTERM or SIGUSR1 that reaches a
rank while it starts (importing torch, reading the config, building the model) no longer kills it with the default
action (a stray status: DeepSpeed's per-node launcher turned that into 241). What happens instead:

* before the rank joins the process group (:meth:`StartupSignals.hold` not called yet): :class:`StoppedBeforeTraining`
  is raised at once; the rank ends with :data:`STOPPED_EXIT_CODE` (no peer waits for it in a collective yet);
* afterwards the signal is only recorded; the preemption handlers take it over (``Preemption.install``), the ranks
  agree on it before the first step and all end with :data:`STOPPED_EXIT_CODE`, or, once a step ran, save and end
  with the requeue code 42 (``megatron/training/preemption.py``).

Nothing is saved in the first two cases: no training step ran, so the latest checkpoint (if any) is still the state.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

REQUEUE_EXIT_CODE = 42  # saved at a step boundary after a preemption signal: requeue the job, it resumes there
STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: stopped by a signal before the first training step, nothing to save
STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption_signals' default, before the config is read


class StoppedBeforeTraining(BaseException):
    """A stop signal reached the rank before it joined the process group (a BaseException, as KeyboardInterrupt:
    library code that catches ``Exception`` does not swallow it)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"{signal_name} before training started")
        self.signal_name = signal_name


class StartupSignals:
    """Handlers for :data:`STARTUP_SIGNALS`: raise :class:`StoppedBeforeTraining` until :meth:`hold`, then record."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.raising = True
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StartupSignals:
        """Install the handlers (main thread only); :meth:`uninstall` restores the previous ones."""
        for sig in STARTUP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def keep_only(self, names: list[str]) -> None:
        """Give the signals not in ``names`` (the run's ``preemption_signals``) their previous handlers back."""
        for sig in [s for s in self._previous if s.name not in names]:
            signal.signal(sig, self._previous.pop(sig))

    def hold(self) -> None:
        """From now on only record signals: the rank is about to join its peers in collectives."""
        self.raising = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        if self.raising:
            self.raising = False  # once: a second signal while the rank unwinds is only recorded
            raise StoppedBeforeTraining(self.received)


def stop_in_chain(error: BaseException) -> StoppedBeforeTraining | None:
    """The :class:`StoppedBeforeTraining` behind ``error``, if any: Python wraps an exception raised while it creates a
    class (a dataclass field's ``__set_name__`` during an import, on Python 3.11) in a ``RuntimeError``, so the stop
    reaches the rank's handler as that error's ``__cause__``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, StoppedBeforeTraining):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
