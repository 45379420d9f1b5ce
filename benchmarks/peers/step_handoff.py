"""Hand-off between the protocol thread and a framework's own training loop (``Trainer.train()``) in the main thread.

A runner that drives a framework's real loop cannot call "one step" itself: the loop pulls its next batch. The
protocol thread (``serve``) hands each request's rows over and waits; the loop's dataloader takes them
(:meth:`Handoff.next_rows`) and the loop's end-of-step hook answers (:meth:`Handoff.step_done`).

Profiling: torch's profiler records only the thread that started it, so ``"profile": true`` in a request (``serve``
profiles in its own thread) gives an empty table for these runners, and a second profiler started in the loop's
thread at the same time crashed the process (SIGSEGV, torch 2.13). The runners' ``--profile-step N`` instead has
the loop's thread profile its N-th step alone (batch taken to the next batch asked for); the table goes to stderr.
"""

from __future__ import annotations

import queue
import sys
from typing import Any

_DONE = object()  # the protocol loop ended: the dataloader stops (and stays stopped for the next epoch's iterator)


class Handoff:
    def __init__(self, label: str, profile_step: int = 0) -> None:
        self.label, self.profile_step = label, profile_step
        self.requests: queue.Queue[Any] = queue.Queue()
        self.losses: queue.Queue[Any] = queue.Queue()
        self.steps = 0
        self._prof: Any = None

    # --- the protocol thread
    def step(self, rows: list[list[int]]) -> float:
        import torch

        if torch.autograd.profiler._is_profiler_enabled:
            print(f"note: {self.label}'s step runs in its training loop's thread, which this profile does not see; "
                  "use the runner's --profile-step N (bench_train.py --peer-arg=--profile-step=N)", file=sys.stderr)  # fmt: skip
        self.requests.put(rows)
        got = self.losses.get()
        if isinstance(got, BaseException):
            raise got
        return float(got)

    def stop(self) -> None:
        self.requests.put(_DONE)

    # --- the training loop's thread
    def next_rows(self) -> list[list[int]] | None:
        """The next request's rows (blocks until the driver sends one); None once the protocol has ended."""
        rows = self.requests.get()
        self._report_profile()
        if rows is _DONE:
            self.requests.put(_DONE)
            return None
        self.steps += 1
        if self.steps == self.profile_step:
            import torch

            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        rows_: list[list[int]] = rows
        return rows_

    def step_done(self, loss: float) -> None:
        self.losses.put(loss)

    def fail(self, exc: BaseException) -> None:
        self._report_profile()
        self.losses.put(exc)

    def _report_profile(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            print(f"---- profile: peer {self.label}, step {self.profile_step} ----", file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr, flush=True)
