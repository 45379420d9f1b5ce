"""benchmarks/peers/hf_runner.py over the peer protocol, with our .venv's transformers (no peer venv needed).

The runner drives the real ``transformers.Trainer`` one driver batch at a time; this runs it on a tiny GPTNeoX
export for two steps and checks the ready line (Trainer's defaults), that the first loss is the model's own
causal-LM loss over ``row[1:]`` (all S targets, the last position included: what our side computes), that the
losses are finite, and that bad input (an unknown shape, a malformed batch) gets one line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness import BASE_ENV, PYTHON, REPO_ROOT

RUNNER = REPO_ROOT / "benchmarks" / "peers" / "hf_runner.py"
VOCAB, SEQ, BATCH = 512, 16, 2


def _export(folder: Path) -> None:
    """A GPTNeoX export with the runner's ``small`` dims (2 layers, d=64, 4 heads), Pythia's layout, tiny vocab."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, hidden_dropout=0.0,
        attention_dropout=0.0, max_position_embeddings=64,
    )  # fmt: skip
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(folder)


def _reference_loss(folder: Path, rows: list[list[int]]) -> float:
    """Mean cross-entropy of the export's logits on ``row[:-1]`` against ``row[1:]`` (forward only)."""
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
    tokens = torch.tensor(rows)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, str(RUNNER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **BASE_ENV},
    )  # fmt: skip


def _ask(proc: subprocess.Popen[str], request: dict[str, Any] | None) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    if request is not None:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"runner exited early ({proc.wait()}): {proc.stderr.read() if proc.stderr else ''}"
    reply: dict[str, Any] = json.loads(line)
    return reply


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_export")
    _export(folder)
    return folder


def test_two_trainer_steps_over_the_protocol(export: Path) -> None:
    """Two steps, then a malformed request: its one-line error ends the runner with exit code 1."""
    args = ["--shape", "small", "--seq", str(SEQ), "--micro-batch", str(BATCH), "--threads", "1"]
    proc = _start([*args, "--init-hf", str(export)])
    try:
        ready = _ask(proc, None)
        assert ready["ready"] is True and ready["peer"] == "hf-fused"
        assert ready["optim"] == "adamw_torch_fused" and ready["lr_scheduler"] == "linear"
        assert ready["weight_decay"] == 0.0 and ready["max_grad_norm"] == 1.0
        assert ready["params"] == 2 * VOCAB * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
        batches = [[[(7 * r + 3 * i + s) % VOCAB for i in range(SEQ + 1)] for r in range(BATCH)] for s in range(2)]
        replies = [_ask(proc, {"tokens": rows}) for rows in batches]
        bad = _ask(proc, {"tokens": [[1, 2, 3]]})
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    losses = [r["loss"] for r in replies]
    assert all(math.isfinite(x) for x in losses) and all(r["seconds"] > 0 for r in replies), replies
    expected = _reference_loss(export, batches[0])
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    assert set(bad) == {"error"} and f"{BATCH} rows of {SEQ + 1} token ids" in bad["error"], bad


def test_unknown_shape_is_one_line() -> None:
    proc = _start(["--shape", "pythia-7b", "--seq", "8", "--micro-batch", "1", "--threads", "1", "--init-hf", "x"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--shape" in lines[0] and "pythia-14m" in lines[0], err
