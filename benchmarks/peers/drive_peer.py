"""Stand-alone driver for one peer runner: random token batches over the protocol, medians of the step times.

    python benchmarks/peers/drive_peer.py --python .venv-hf/bin/python --runner hf_runner.py \
        --shape pythia-14m --seq 256 --micro-batch 8 --threads 2 --init-hf DIR [--compile] [--steps 6]

Stdlib only. Prints one JSON line: the ready facts, the losses, the runner's per-step seconds and their median
over the steps after the first (warm-up; compile time when ``--compile``), tokens/s, and the load average.
``--init-hf`` without a folder: ``--make-init`` writes a GPTNeoX export of the shape with random weights first
(needs transformers in the interpreter running this script).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from protocol import SHAPE_DIMS  # noqa: E402

VOCAB = 50304


def make_init(shape: str, out: str, seed: int = 1234) -> None:
    """A GPTNeoX export with the shape's dims (Pythia's: rotary 0.25, parallel residual, untied, no dropout)."""
    import torch
    import transformers

    layers, hidden, heads = SHAPE_DIMS[shape]
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
        hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=2048,
    )  # fmt: skip
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [args.python, os.path.join(HERE, args.runner), "--shape", args.shape, "--seq", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--threads", str(args.threads), "--init-hf", args.init_hf]  # fmt: skip
    cmd += ["--compile"] if args.compile else []
    cmd += ["--profile-step", str(args.profile_step)] if args.profile_step else []
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(obj: dict[str, Any] | None) -> dict[str, Any]:
        if obj is not None:
            proc.stdin.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"runner exited with code {proc.wait()}")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise SystemExit(f"runner failed: {msg['error']}")
        return msg

    ready = ask(None)
    rng = random.Random(args.seed)
    losses, seconds = [], []
    for _ in range(args.steps):
        rows = [[rng.randrange(VOCAB) for _ in range(args.seq + 1)] for _ in range(args.micro_batch)]
        reply = ask({"tokens": rows})
        losses.append(reply["loss"])
        seconds.append(reply["seconds"])
    proc.stdin.write(json.dumps({"quit": True}) + "\n")
    proc.stdin.flush()
    code = proc.wait(timeout=120)
    timed = seconds[1:] or seconds
    tokens = args.seq * args.micro_batch
    return {
        "ready": ready, "exit_code": code, "losses": losses, "seconds": [round(s, 4) for s in seconds],
        "median_s": round(statistics.median(timed), 4), "tokens_per_s": round(tokens / statistics.median(timed), 1),
        "first_step_s": round(seconds[0], 3), "loadavg": os.getloadavg(),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--runner", default="hf_runner.py")
    p.add_argument("--shape", default="pythia-14m", choices=sorted(SHAPE_DIMS))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init-hf", required=True)
    p.add_argument("--make-init", action="store_true", help="write a random-weight export of --shape to --init-hf")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-step", type=int, default=0, help="the runner's --profile-step N: its table on stderr")
    args = p.parse_args()
    if args.make_init:
        make_init(args.shape, args.init_hf)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
