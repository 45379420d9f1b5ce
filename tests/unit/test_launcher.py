"""deepy's launcher pieces: hostfiles and filters, the CLI, the DeepSpeed runner argv, multi-node commands."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron.cluster.hostfile import count_ranks, filter_resources, parse_hostfile
from megatron.launcher.config import LauncherConfig
from megatron.launcher.launch import CONFIG_NAME, plan_launch
from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "train_micro_batch_size_per_gpu": 2,
    "user_script": "train.py",
}


def args_for(env: LaunchEnv | None = None, **overrides) -> NeoXArgs:
    return NeoXArgs({**TINY, **overrides}, env=env or LaunchEnv(on_cpu=True))


def test_parse_hostfile():
    text = "# cluster\nworker-0 slots=4\nworker-1   slots = 2  # comment\n\nworker-2\n"
    assert parse_hostfile(text) == {"worker-0": 4, "worker-1": 2, "worker-2": 1}
    with pytest.raises(ValueError, match="hosts: line 2: expected 'hostname slots=N'"):
        parse_hostfile("a slots=1\nb slots=x\n", "hosts")
    with pytest.raises(ValueError, match="line 2: host 'a' is listed twice"):
        parse_hostfile("a slots=1\na slots=2\n")


def test_filters_and_rank_count():
    hosts = {"w0": 4, "w1": 4, "w2": 2}
    assert filter_resources(hosts, include="w0@w1:0,2") == {"w0": [0, 1, 2, 3], "w1": [0, 2]}
    assert filter_resources(hosts, exclude="w1@w0:3") == {"w0": [0, 1, 2], "w2": [0, 1]}
    assert count_ranks(hosts) == 10 and count_ranks(hosts, num_nodes=1) == 4 and count_ranks(hosts, num_gpus=1) == 3
    with pytest.raises(ValueError, match="host 'w9' is not in the hostfile"):
        filter_resources(hosts, include="w9")


def test_deepy_cli(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    cli = parse_deepy_args(
        [str(script), "-d", "configs", "125M", "local_setup.yml", "--train_iters", "5", "--lr-decay-style=cosine",
         "--optimizer", '{"type": "Adam", "params": {"lr": 1e-4}}', "--use_wandb", "-i", "p.txt", "--dry-run"]
    )  # fmt: skip
    assert cli.config_files == ["configs/125M.yml", "configs/local_setup.yml"] and cli.dry_run
    assert cli.overrides["train_iters"] == 5 and cli.overrides["lr_decay_style"] == "cosine"
    assert cli.overrides["optimizer"]["params"]["lr"] == 1e-4 and cli.overrides["use_wandb"] is True
    assert cli.overrides["sample_input_file"] == "p.txt" and cli.overrides["user_script"] == str(script)
    with pytest.raises(
        ConfigError, match="unknown key '--trian_iters' in the command line; did you mean '--train_iters'"
    ):
        parse_deepy_args([str(script), "a.yml", "--trian_iters", "5"])
    with pytest.raises(ConfigError, match=r"script not found: nope\.py"):
        parse_deepy_args(["nope.py", "a.yml"])


def test_plan_local_cpu(tmp_path):
    plan = plan_launch(LauncherConfig.from_neox_args(args_for(num_gpus=2)), str(tmp_path), on_cpu=True)
    argv = plan.runner_argv
    assert argv[argv.index("--num_gpus") + 1] == "2"
    port = int(argv[argv.index("--master_port") + 1])
    assert port != 29500 and 0 < port < 65536
    assert argv[-3:] == ["train.py", "--neox_config", str(tmp_path / CONFIG_NAME)]
    assert plan.env["DS_ACCELERATOR"] == "cpu" and plan.env["OMP_NUM_THREADS"]
    assert plan.command_line().startswith("DS_ACCELERATOR=cpu OMP_NUM_THREADS=")
    # one CPU node, no host selection: deepy starts DeepSpeed's per-node launcher itself (what the runner would run)
    assert f"{sys.executable} -u -m deepspeed.launcher.launch --world_info=" in plan.command_line()
    assert plan.node_argv is not None and plan.node_argv[-3:] == argv[-3:]
    assert f"--master_port={port}" in plan.node_argv
    selected = plan_launch(
        LauncherConfig.from_neox_args(args_for(num_gpus=2, include="localhost:0,1")), str(tmp_path), on_cpu=True
    )
    assert selected.node_argv is None and "-m deepspeed.launcher.runner --include" in selected.command_line()
    fixed = plan_launch(
        LauncherConfig.from_neox_args(args_for(num_gpus=2, master_port=29611)), str(tmp_path), on_cpu=True
    ).runner_argv
    assert fixed[fixed.index("--master_port") + 1] == "29611"
    assert plan.notes == []
    slurm = plan_launch(
        LauncherConfig.from_neox_args(args_for(num_gpus=2, launcher="slurm", deepspeed_slurm=True)),
        str(tmp_path),
        on_cpu=True,
    )
    assert slurm.notes == [
        "no hostfile: launcher slurm is not used, the ranks start on this node only "
        "(pass --hostfile, or use tools/slurm/train.sbatch, which writes one)"
    ]


def test_wandb_group_gets_one_suffix():
    from megatron.launcher.launch import launch_wandb_group

    group = launch_wandb_group(True, "exp")
    assert group is not None and group.startswith("exp_") and len(group) == len("exp_") + 8
    assert launch_wandb_group(True, "exp") != group  # one suffix per launch
    assert launch_wandb_group(None, None) is None and launch_wandb_group(False, "exp") == "exp"


def test_plan_gpu_keys(tmp_path):
    gpu = LaunchEnv(on_cpu=False, gpu_count=8)
    argv = plan_launch(LauncherConfig.from_neox_args(args_for(gpu)), str(tmp_path), on_cpu=False).runner_argv
    assert "--num_gpus" not in argv and argv[argv.index("--master_port") + 1] == "29500"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("w0 slots=8\nw1 slots=8\n")
    env = LaunchEnv(on_cpu=False, hosts={"w0": 8, "w1": 8})
    a = args_for(env, hostfile=str(hostfile), include="w0:0,1@w1", num_gpus=4, launcher="slurm", comment="c1")
    plan = plan_launch(LauncherConfig.from_neox_args(a), str(tmp_path), on_cpu=False)
    argv = plan.runner_argv
    assert argv[:4] == ["--hostfile", str(hostfile), "--include", "w0:0,1@w1"]
    assert "--num_gpus" not in argv and plan.notes
    # across nodes deepy runs srun/mpirun/pdsh itself (tests/unit/test_cluster_commands.py): the runner stays local
    assert not {"--launcher", "--launcher_args", "--force_multi"} & set(argv)


@pytest.mark.launches
def test_the_per_node_launch_is_the_one_deepspeeds_runner_builds(tmp_path):
    """DeepSpeed's runner, run for real on a one-node CPU launch, starts ``deepspeed.launcher.launch`` with exactly
    the arguments deepy passes it directly (the runner logs its command before it starts it)."""
    import os
    import subprocess

    script = tmp_path / "script.py"
    script.write_text("pass\n")
    plan = plan_launch(
        LauncherConfig.from_neox_args(args_for(num_gpus=2, master_port=29613, user_script=str(script))),
        str(tmp_path),
        on_cpu=True,
    )
    env = {**os.environ, **plan.env}
    run = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", *plan.runner_argv],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    logged = next(ln for ln in (run.stdout + run.stderr).splitlines() if "cmd = " in ln).split("cmd = ", 1)[1]
    assert logged.split() == [sys.executable, "-u", "-m", "deepspeed.launcher.launch", *plan.node_argv]
