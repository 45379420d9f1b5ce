"""Reliability of real training runs: non-finite steps skipped in any precision, preemption by a signal to one
rank (same step saved everywhere, requeue exit code, exact continuation), kill -9 during a checkpoint write and a
truncated newest checkpoint (previous one loads)."""

from __future__ import annotations

import json
import math
import random
import re
import signal
import time
from pathlib import Path

import pytest

from megatron.training.preemption import REQUEUE_EXIT_CODE
from tests.distributed.fns_reliability import (
    kill_all,
    rank_log,
    run_with_nan_many,
    start_train_ranks,
    streamed_losses,
    write_neox_config,
)
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


def test_nonfinite_steps_and_loss_spikes_are_skipped_and_repeats_abort(data: dict[str, str]) -> None:
    common = dict(world=2, train_iters=6, eval_iters=0, log_interval=1)
    spikes = dict(loss_spike_skip_window=3, loss_spike_skip_zscore=4.0)
    jobs = [
        (tiny_config(data, **common), [3], 1),  # fp32, ZeRO-0: NaN on rank 1 only
        (tiny_config(data, **common, bf16={"enabled": True}, zero_optimization={"stage": 1}), [2, 5], 0),
        (tiny_config(data, **common, max_consecutive_nonfinite_steps=3), [2, 3, 4, 5, 6], 1),
        # loss x30 on rank 1 at iteration 5 (the world-mean loss jumps): a spike against the 3 steps before it
        (tiny_config(data, **common, **spikes), [5], 1, 30.0),
        # spikes in a row count toward the same limit (the window keeps the last applied steps' losses)
        (tiny_config(data, **common, **spikes, max_consecutive_nonfinite_steps=2), [4, 5, 6], 0, 30.0),
    ]
    results = run_distributed(run_with_nan_many, 2, jobs, timeout=600)
    for rank_results in results:
        fp32, bf16, aborted, spiked, spikes_abort = rank_results
        assert math.isnan(fp32["train_losses"][2]) and fp32["skipped_iters"] == 1
        # the NaN gradients were not applied: every later step trains on finite weights
        assert all(math.isfinite(x) for i, x in enumerate(fp32["train_losses"]) if i != 2)
        assert [i for i, x in enumerate(bf16["train_losses"]) if not math.isfinite(x)] == [1, 4]
        assert bf16["skipped_iters"] == 2 and bf16["zero_stage"] == 1 and bf16["params_dtype"] == "bfloat16"
        # the LR schedule moves after applied steps only (warm-up, then cosine: every applied step a new value)
        assert fp32["lrs"][2] == fp32["lrs"][3] and len(set(fp32["lrs"])) == 5, fp32["lrs"]
        assert bf16["lrs"][1] == bf16["lrs"][2] and bf16["lrs"][4] == bf16["lrs"][5] and len(set(bf16["lrs"])) == 4
        assert "NonFiniteAbort: 3 consecutive steps" in aborted["abort"] and "iteration 4" in aborted["abort"]
        assert spiked["skipped_iters"] == 1 and spiked["train_losses"][4] > 10 * spiked["train_losses"][3]
        assert spiked["train_losses"][5] < spiked["train_losses"][3] + 0.5  # the spike's gradients were not applied
        assert "NonFiniteAbort: 2 consecutive steps" in spikes_abort["abort"] and "iteration 5" in spikes_abort["abort"]
    rank0 = results[0]
    assert rank0[0]["warnings"] == ["iteration 3: non-finite loss or gradient, step skipped (1 in a row)"]
    assert len(rank0[1]["warnings"]) == 2 and "iteration 5" in rank0[1]["warnings"][1]
    assert len(rank0[3]["warnings"]) == 1 and rank0[3]["warnings"][0].startswith(
        "iteration 5: loss spike, step skipped"
    )
    assert not results[1][3]["warnings"]  # rank 0 logs


def _wait(procs: list, timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        kill_all(procs)


def _records(log_dir: Path, world: int) -> list[dict]:
    return [json.loads((log_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _logs(log_dir: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}\n{rank_log(log_dir, r)[-4000:]}" for r in range(world))


COMMON = dict(world=2, train_iters=16, eval_iters=0, log_interval=1, zero_optimization={"stage": 1})


@pytest.fixture(scope="module")
def uninterrupted(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The loss trace of the 2-rank fp32 ZeRO-1 run the interrupted runs below must reproduce."""
    tmp_path = tmp_path_factory.mktemp("reference")
    reference = write_neox_config(tiny_config(data, **COMMON), tmp_path / "reference.json")
    assert _wait(start_train_ranks(reference, 2, tmp_path / "ref")) == [0, 0], _logs(tmp_path / "ref", 2)
    return _records(tmp_path / "ref", 2)[0]["losses"]


def test_sigterm_to_one_rank_saves_everywhere_and_resumes_exactly(
    data: dict[str, str], uninterrupted: list[float], tmp_path: Path
) -> None:
    """SIGTERM reaches rank 1 only: both ranks stop after the same step, save it, exit 42; the same command then
    resumes there and the stitched losses equal an uninterrupted run bit for bit (fp32, 2 ranks, ZeRO-1)."""
    ck = str(tmp_path / "ck")
    common, full = COMMON, uninterrupted

    config = write_neox_config(
        tiny_config(data, **common, save=ck, load=ck, checkpoint_factor=1000), tmp_path / "c.json"
    )
    procs = start_train_ranks(config, 2, tmp_path / "run1")
    deadline = time.monotonic() + 300
    while not re.search(r"iteration\s+[3-9]/", rank_log(tmp_path / "run1", 0)):
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(tmp_path / "run1", 2)
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)
    assert _wait(procs) == [REQUEUE_EXIT_CODE] * 2, _logs(tmp_path / "run1", 2)
    first = _records(tmp_path / "run1", 2)
    stop = len(first[0]["losses"])
    assert first[0]["preempted"] and first[1]["preempted"] and len(first[1]["losses"]) == stop < 16
    assert (Path(ck) / "latest").read_text() == f"global_step{stop}"
    step_dir = Path(ck) / f"global_step{stop}"
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= {
        p.name for p in step_dir.iterdir()
    }
    assert "requeue exit code 42" in rank_log(tmp_path / "run1", 0)

    assert _wait(start_train_ranks(config, 2, tmp_path / "run2")) == [0, 0], _logs(tmp_path / "run2", 2)
    second = _records(tmp_path / "run2", 2)[0]
    assert second["start"] == stop and not second["preempted"]
    assert first[0]["losses"] + second["losses"] == full  # bit-exact stitched trace


def test_kill9_of_all_ranks_at_a_random_step_resumes_bit_exactly(
    data: dict[str, str], uninterrupted: list[float], tmp_path: Path
) -> None:
    """kill -9 of both ranks after a random step (checkpoints every 3 steps), then the same command: it resumes from
    the newest checkpoint and the stitched trace (steps before it from the killed run, the rest from the restart)
    equals an uninterrupted run bit for bit (fp32, 2 ranks, ZeRO-1)."""
    kill_after = random.Random().randint(4, 12)
    ck = str(tmp_path / "ck")
    cfg = tiny_config(data, **COMMON, save=ck, load=ck, checkpoint_factor=3)
    config = write_neox_config(cfg, tmp_path / "c.json")
    procs = start_train_ranks(config, 2, tmp_path / "run1")
    deadline = time.monotonic() + 300
    while len(streamed_losses(tmp_path / "run1", 0)) < kill_after:
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(tmp_path / "run1", 2)
        time.sleep(0.005)
    kill_all(procs)  # SIGKILL to every rank, wherever each one is
    killed = streamed_losses(tmp_path / "run1", 0)
    assert kill_after <= len(killed) < 16, f"kill after step {kill_after}: {killed}"

    assert _wait(start_train_ranks(config, 2, tmp_path / "run2")) == [0, 0], _logs(tmp_path / "run2", 2)
    resumed = _records(tmp_path / "run2", 2)
    start = resumed[0]["start"]
    assert start == resumed[1]["start"] and start % 3 == 0 and len(killed) - 3 <= start <= len(killed), (
        f"kill after step {kill_after}: resumed at {start}"
    )
    assert killed[:start] + resumed[0]["losses"] == uninterrupted, f"kill after step {kill_after}"
    assert resumed[1]["losses"] == resumed[0]["losses"]


def test_kill9_during_a_save_and_a_truncated_newest_checkpoint(data: dict[str, str], tmp_path: Path) -> None:
    """kill -9 while global_step4 is being written: global_step2 loads, the partial folder is ignored and removed,
    and the resumed losses equal an uninterrupted run's bit for bit.
    Then a truncated file in the newest checkpoint: the previous one loads with a warning naming the file."""
    ck = tmp_path / "ck"
    cfg = tiny_config(data, train_iters=6, eval_iters=0, save=str(ck), load=str(ck), checkpoint_factor=2)
    config = write_neox_config(cfg, tmp_path / "c.json")
    procs = start_train_ranks(config, 1, tmp_path / "run1", slow_save_tag="global_step4")
    deadline = time.monotonic() + 300
    while not (tmp_path / "run1" / "saving").exists():
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(tmp_path / "run1", 1)
        time.sleep(0.05)
    kill_all(procs)  # SIGKILL in the middle of writing global_step4
    partial = list(ck.glob(".partial-global_step4-*"))  # named with the run's id (the save folder's lock)
    assert len(partial) == 1 and partial[0].is_dir() and not (ck / "global_step4").exists()
    assert (ck / "latest").read_text() == "global_step2"

    assert _wait(start_train_ranks(config, 1, tmp_path / "run2")) == [0], _logs(tmp_path / "run2", 1)
    resumed = _records(tmp_path / "run2", 1)[0]
    assert resumed["start"] == 2
    reference = write_neox_config({**cfg, "save": None, "load": None}, tmp_path / "ref.json")
    assert _wait(start_train_ranks(reference, 1, tmp_path / "ref")) == [0], _logs(tmp_path / "ref", 1)
    assert resumed["losses"] == _records(tmp_path / "ref", 1)[0]["losses"][2:]  # the kill cost nothing but time
    assert not list(ck.glob(".partial-*"))
    assert sorted(p.name for p in ck.glob("global_step*")) == ["global_step2", "global_step4", "global_step6"]

    newest = ck / "global_step6" / "mp_rank_00_model_states.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    assert _wait(start_train_ranks(config, 1, tmp_path / "run3")) == [0], _logs(tmp_path / "run3", 1)
    assert _records(tmp_path / "run3", 1)[0]["start"] == 4
    log = rank_log(tmp_path / "run3", 0)
    assert f"skipping checkpoint {ck / 'global_step6'}: {newest}" in log and "truncated" in log
