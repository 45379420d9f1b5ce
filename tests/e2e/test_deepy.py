"""deepy.py end to end: the bad-config corpus (exit 2, one readable error, no traceback), --dry-run, and a real
2-rank CPU launch in which every rank rebuilds the identical resolved NeoXArgs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import deepy
from megatron.neox_arguments import NeoXArgs
from tests.harness import PYTHON, REPO_ROOT, run_command

FIX = REPO_ROOT / "tests" / "fixtures" / "configs"
TINY = str(REPO_ROOT / "configs" / "cpu" / "tiny.yml")
SCRIPT = str(REPO_ROOT / "train.py")  # any existing script: these runs never launch

# bad file (merged after base.yml) -> fragments the error must contain
CORPUS = {
    "unknown_key.yml": ["unknown key 'frobnicate_layers'", "unknown_key.yml"],
    "typo_key.yml": ["unknown key 'lr_decay_stlye'", "typo_key.yml", "did you mean 'lr_decay_style'"],
    "dup_dash.yml": [
        "'train_iters' is set in two files",
        "base.yml (as 'train_iters')",
        "dup_dash.yml (as 'train-iters')",
    ],
    "wrong_type.yml": ["log_interval='often'", "wrong_type.yml", "expected int"],
    "batch_inconsistent.yml": ["inconsistent batch sizes", "train_batch_size=7", "batch_inconsistent.yml", "base.yml"],
    "tp_heads.yml": ["num_attention_heads=4", "not divisible by model_parallel_size=3", "tp_heads.yml"],
    "zero3_pipe.yml": ["zero_optimization.stage=3", "pipe_parallel_size=1", "zero3_pipe.yml", "ZeRO stages 0 and 1"],
    "missing_required.yml": ["missing required key 'num_attention_heads': not set in", "missing_required.yml"],
    "bad_syntax.yml": ["bad_syntax.yml: line 3", "invalid YAML"],
}


@pytest.mark.parametrize("bad", sorted(CORPUS))
def test_bad_config_corpus(bad, capsys):
    files = [str(FIX / bad)] if bad == "missing_required.yml" else [str(FIX / "base.yml"), str(FIX / bad)]
    assert deepy.main([SCRIPT, *files, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("deepy.py: error: ") and "Traceback" not in err + out
    for fragment in CORPUS[bad]:
        assert fragment in err, err


def test_bad_config_exit_code_in_a_real_process():
    res = run_command([PYTHON, "deepy.py", SCRIPT, str(FIX / "base.yml"), str(FIX / "typo_key.yml")], check=False)
    assert res.returncode == 2, res.describe()
    assert "did you mean 'lr_decay_style'" in res.stderr and "Traceback" not in res.stderr


def test_dry_run_prints_config_and_command_without_launching(tmp_path):
    res = run_command(
        [PYTHON, "deepy.py", SCRIPT, TINY, "--num_gpus", "2", "--dry-run", "--run_dir", str(tmp_path / "run")],
        timeout=120,
    )
    assert "hidden_size" in res.stdout and "train_batch_size" in res.stdout
    assert "-u -m deepspeed.launcher.launch --world_info=" in res.stdout
    assert f"--neox_config {tmp_path / 'run' / 'neox_config.json'}" in res.stdout
    assert not (tmp_path / "run").exists()


PROBE = """
import json, os, sys
import torch
from megatron.distributed import init_distributed, shutdown_and_exit
from megatron.neox_arguments import NeoXArgs

args = NeoXArgs.consume_neox_args()
init_distributed()
total = torch.tensor([float(args.rank + 1)])
torch.distributed.all_reduce(total)
out = {"argv": sys.argv[1:], "rank": args.rank, "local_rank": args.local_rank, "world_size": args.world_size,
       "sum": total.item(), "omp": os.environ.get("OMP_NUM_THREADS"), "accel": os.environ.get("DS_ACCELERATOR"),
       "config": args.to_dict()}
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{args.rank}.json"), "w") as f:
    json.dump(out, f)
shutdown_and_exit(0)
"""


@pytest.mark.distributed
def test_launch_two_cpu_ranks_rebuild_identical_config(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run_dir = tmp_path / "run"
    run_command(
        [PYTHON, "deepy.py", str(probe), TINY, "--num_gpus", "2", "--train_iters", "7", "--run_dir", str(run_dir)],
        env={"PROBE_OUT": str(tmp_path), "OMP_NUM_THREADS": "", "DS_ACCELERATOR": ""},  # deepy must set both
        timeout=240,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["local_rank"] for r in ranks] == [0, 1]
    assert all(
        r["world_size"] == 2
        and r["sum"] == 3.0
        and r["omp"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
        and r["accel"] == "cpu"
        for r in ranks
    )
    assert any(a.startswith("--local_rank=") for a in ranks[0]["argv"])
    configs = [{k: v for k, v in r["config"].items() if k not in ("rank", "local_rank", "world_size")} for r in ranks]
    assert configs[0] == configs[1]
    # ... and identical to what the launcher resolved and wrote into the run folder
    written = json.loads((run_dir / "neox_config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("rank", "local_rank", "world_size")} == configs[0]
    assert configs[0]["global_num_gpus"] == 2 and configs[0]["train_iters"] == 7 and configs[0]["train_batch_size"] == 4
    assert (run_dir / "configs" / "tiny.yml").read_text() == Path(TINY).read_text()
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 4
    assert "--neox_config" in (run_dir / "launch.txt").read_text()
    expected = NeoXArgs.from_ymls([TINY], {"num_gpus": 2, "train_iters": 7, "user_script": str(probe)}).to_dict()
    runtime = ("rank", "local_rank", "world_size", "git_hash")  # the repo may get new commits meanwhile
    assert {k: v for k, v in expected.items() if k not in runtime} == {
        k: v for k, v in configs[0].items() if k not in runtime
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_deepy_trains_with_train_py_on_two_cpu_ranks(tmp_path):
    from tests.distributed.fns_train import make_tiny_data

    data = make_tiny_data(tmp_path / "data")
    setup = tmp_path / "setup.yml"
    setup.write_text(
        json.dumps({**data, "tokenizer_type": "HFTokenizer", "data_impl": "mmap", "split": "90,5,5", "num_gpus": 2})
    )
    res = run_command(
        [PYTHON, "deepy.py", "train.py", TINY, str(setup), "--train_iters", "2", "--eval_iters", "1",
         "--run_dir", str(tmp_path / "run")],
        timeout=300,
    )  # fmt: skip
    assert "training finished at iteration 2" in res.stdout, res.describe()
    assert "world 2 = pipe 1 x data 2 x model 1" in res.stdout + res.stderr, res.describe()
