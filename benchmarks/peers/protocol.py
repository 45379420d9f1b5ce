"""The peer protocol: bench_train.py drives another framework's training step in that framework's own venv.

Stdlib only: runners import it from their own virtualenv (``sys.path`` gets ``benchmarks/peers``), the driver from
ours. One JSON object per line, both ways:

- the runner starts as ``python <runner> --shape S --seq N --micro-batch B --threads T --init-hf DIR [--compile]``,
  builds its model from the Hugging Face GPTNeoX export in DIR, and prints
  ``{"ready": true, "peer": name, "version": v, "params": n, ...}``;
- the driver writes ``{"tokens": [[...], ...]}`` (B rows of N+1 ids: inputs are ``row[:-1]``, labels
  ``row[1:]``); the runner does one full training step its default way and prints
  ``{"loss": float, "seconds": float}`` (``seconds`` timed inside the runner, loss read back, so synchronised);
- ``"profile": true`` in a request: that step runs under torch.profiler, its table printed to stderr;
- ``{"quit": true}`` or end of input ends the runner (exit 0); a failure prints ``{"error": "..."}`` and exits 1.

The runner's stdout carries only these lines: :func:`serve` moves file descriptor 1 to stderr so that what the
framework prints (Python or C) cannot interleave with the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

# (layers, hidden, heads) of each benchmark shape: a runner checks the export in --init-hf against it
SHAPE_DIMS = {"pythia-14m": (6, 128, 4), "pythia-160m": (12, 768, 12), "small": (2, 64, 4)}
SHAPES = tuple(SHAPE_DIMS)
StepFn = Callable[[list[list[int]]], float]


class PeerError(RuntimeError):
    """The peer runner failed, exited, or answered something that is not the protocol."""


def runner_arguments(description: str) -> argparse.ArgumentParser:
    """The flags every runner takes (a runner adds its own before ``parse_args``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--seq", type=int, required=True, help="sequence length (rows carry seq + 1 tokens)")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--threads", type=int, required=True, help="torch intra-op threads")
    p.add_argument("--init-hf", required=True, help="folder with config.json + model.safetensors (GPTNeoX)")
    p.add_argument("--compile", action="store_true", help="the peer's own default torch.compile")
    return p


def serve(build: Callable[[], tuple[StepFn, dict[str, Any]]]) -> int:
    """Runner side: ``build()`` returns (step, ready facts); then answer step requests until quit/EOF."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        step, facts = build()
        send({"ready": True, **facts})
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            if req.get("quit"):
                break
            if req.get("profile"):
                loss, seconds = _profiled(step, req["tokens"])
            else:
                start = time.perf_counter()
                loss = float(step(req["tokens"]))
                seconds = time.perf_counter() - start
            send({"loss": loss, "seconds": seconds})
    except Exception as exc:  # the driver shows this one line; the traceback went to stderr
        import traceback

        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


def _profiled(step: StepFn, tokens: list[list[int]]) -> tuple[float, float]:
    """One step under torch.profiler (the runner's venv has torch); the table goes to stderr."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        loss = float(step(tokens))
        seconds = time.perf_counter() - start
    print("---- profile: peer ----", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr, flush=True)
    return loss, seconds


class PeerProcess:
    """Driver side: one runner process; :meth:`step` sends a batch and returns (loss, runner seconds)."""

    def __init__(self, python: str, runner: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.cmd = [python, runner, *args]
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env, bufsize=1
        )
        self.ready = self._read()
        if not self.ready.get("ready"):
            raise PeerError(f"peer {runner} did not report ready: {self.ready}")

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line:
            code = self.proc.wait()
            raise PeerError(f"peer runner exited with code {code} (its stderr is above): {' '.join(self.cmd)}")
        try:
            msg: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"peer runner wrote a line that is not JSON: {line[:200]!r}") from None
        if "error" in msg:
            raise PeerError(f"peer runner failed: {msg['error']}")
        return msg

    def _write(self, obj: dict[str, Any]) -> None:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(obj) + "\n")
        stdin.flush()

    def step(self, tokens: list[list[int]], profile: bool = False) -> tuple[float, float]:
        self._write({"tokens": tokens, "profile": True} if profile else {"tokens": tokens})
        msg = self._read()
        return float(msg["loss"]), float(msg["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._write({"quit": True})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
