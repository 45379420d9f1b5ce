"""``deepy.py --autotune``: the planner's best layouts each trained for real on 2 CPU ranks, the fastest measured
written out as a config that loads and trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megatron.neox_arguments import NeoXArgs
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import PYTHON, run_command

pytestmark = pytest.mark.distributed


def test_autotune_measures_two_layouts_and_writes_a_config_that_trains(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    cfg = tiny_config(data, world=2, train_iters=20)
    cfg.pop("global_num_gpus", None)
    cfg["num_gpus"] = 2
    config = tmp_path / "tiny.yml"
    config.write_text(yaml.safe_dump(cfg))
    out_dir = tmp_path / "autotune"
    argv = [PYTHON, "deepy.py", "--autotune", "train.py", str(config), "--candidates", "2", "--steps", "2"]
    out = run_command([*argv, "--warmup-steps", "1", "--out", str(out_dir)], timeout=600).stdout

    rows = [ln.split() for ln in out.splitlines() if re.match(r"^[12]\s+\d+\s+\d+\s+\d+\s+[0-3]\s", ln)]
    assert len(rows) == 2, out
    measured = [float(r[9]) for r in rows]  # seconds per step, both layouts ran
    predicted = [float(r[8]) for r in rows]
    assert all(m > 0 for m in measured) and all(p > 0 for p in predicted)
    assert [float(r[10]) for r in rows] == pytest.approx([m / p for m, p in zip(measured, predicted)], rel=0.02)
    best = rows[measured.index(min(measured))]
    path = re.search(r"config written to (\S+)", out).group(1)
    assert Path(path) == out_dir / "autotuned.yml"
    for trial in ("trial-1", "trial-2"):  # each layout was its own deepy launch, its step log kept
        log = (out_dir / trial / "deepy.log").read_text()
        assert "training finished at iteration 3" in log

    args = NeoXArgs.from_ymls([path])  # the written config loads on its own, with the fastest layout
    tp, pp, _dp, zero, micro, gas = (int(x) for x in best[1:7])
    assert (args.model_parallel_size, args.pipe_parallel_size, args.zero_stage) == (tp, pp, zero)
    assert (args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == (micro, gas)
    assert (
        args.checkpoint_activations == (best[7] == "yes") and args.train_batch_size == 8
    )  # 4 per rank x 2 ranks, kept
    assert args.data_path == data["data_path"] and args.train_iters == 20  # the user's keys kept

    trained = run_command([PYTHON, "deepy.py", "train.py", path, "--train_iters", "2"], timeout=600).stdout
    assert "training finished at iteration 2" in trained
