"""bench_train.py --peer over the peer protocol, against the in-repo runner (transformers GPTNeoX + AdamW in our
.venv, a real training step): the peer starts from our exported initial model, steps on the same batches right after
each of our iterations (its losses track ours step by step), the first-loss gate passes and the ratio line and JSON
come out; a deliberately different initial model is refused. No peer virtualenv is needed; no timing is asserted."""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness import PYTHON, REPO_ROOT, run_command
from tests.shared_files import shared_file

BENCH = str(REPO_ROOT / "benchmarks" / "bench_train.py")
SMALL = ["--small", "--peer", "hf-loop", "--threads", "1", "--log-interval", "1"]


@pytest.fixture
def corpus() -> None:
    """bench_train.py trains on the shared tinyshakespeare with the 20B tokenizer."""
    shared_file("data", "corpora", "tinyshakespeare.txt")
    shared_file("data", "tokenizers", "20B_tokenizer.json")


def test_peer_interleaved_same_batches_gate_and_ratio(corpus: None):
    out = run_command([PYTHON, BENCH, *SMALL, "--rounds", "2", "--warmup", "1"], timeout=400)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "train_vs_hf-loop_small" and result["peer"] == "hf-loop"
    assert f"ratio={result['ratio']}" in out.stdout and result["ratio"] > 0 and "(equal)" in out.stdout
    assert result["peer_ready"]["peer"] == "hf-loop" and result["peer_ready"]["params"] > 0
    assert len(result["per_round_ratios"]) == 2 and result["median_peer_wall_s"] >= result["median_hf_s"] > 0
    # one peer step per iteration of ours, on the same batch: the same model and optimizer give the same losses
    ours, peer = result["losses_ours"], result["losses_peer"]
    assert len(ours) == len(peer) == 3
    for a, b in zip(ours, peer, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (ours, peer)
    assert len(set(peer)) == 3  # different batches (and updated weights) every step


def test_peer_with_a_different_initial_model_is_refused(corpus: None):
    cmd = [PYTHON, BENCH, *SMALL, "--rounds", "1", "--warmup", "0", "--peer-arg=--perturb-init"]
    out = run_command(cmd, timeout=400, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "GATE FAILED: first-step losses differ: ours" in out.stderr and "vs hf-loop" in out.stderr
    assert "ratio=" not in out.stdout


def test_peer_command_line_errors_are_one_line(tmp_path):
    out = run_command([PYTHON, BENCH, "--peer", "nope"], timeout=120, check=False)
    assert out.returncode == 2 and "unknown peer 'nope'; known:" in out.stderr and "litgpt" in out.stderr
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        from peers.driver import missing_venv
        from peers.protocol import PeerError, PeerProcess
        from peers.registry import Peer
    finally:
        sys.path.pop(0)
    hint = missing_venv(Peer("litgpt_runner.py", "not-made-yet"))
    assert hint is not None and "bash benchmarks/peers/setup.sh not-made-yet" in hint and "\n" not in hint
    runner = str(REPO_ROOT / "benchmarks" / "peers" / "loop_runner.py")
    args = ["--shape", "small", "--seq", "8", "--micro-batch", "1", "--threads", "1", "--init-hf", str(tmp_path)]
    with pytest.raises(PeerError, match=r"^peer runner failed: "):
        PeerProcess(sys.executable, runner, args)
