"""Stand-in for peerlit's ``benchmarks/peers/protocol.py`` until the branches merge (same two functions, same
behaviour): the runners here import ``protocol`` first and fall back to this file. Delete it at the merge.

Stdlib only (runners import it from their own virtualenv). One JSON object per line: the runner prints
``{"ready": true, ...}``, then for each ``{"tokens": [[...]]}`` line does one training step and prints
``{"loss": float, "seconds": float}`` (``"profile": true`` in a request: that step under torch.profiler, the table
to stderr); ``{"quit": true}`` or end of input ends it (exit 0); a failure prints
``{"error": "..."}`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

SHAPES = ("pythia-14m", "pythia-160m", "small")
StepFn = Callable[[list[list[int]]], float]


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
    os.dup2(2, 1)  # what the framework prints (Python or C) goes to stderr, never into the protocol
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
            if req.get("profile"):  # that step under torch.profiler, its table to stderr
                import torch

                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    start = time.perf_counter()
                    loss = float(step(req["tokens"]))
                    seconds = time.perf_counter() - start
                print("---- profile: peer ----", file=sys.stderr)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
            else:
                start = time.perf_counter()
                loss = float(step(req["tokens"]))
                seconds = time.perf_counter() - start
            send({"loss": loss, "seconds": seconds})
    except Exception as exc:  # the driver shows this one line; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0
