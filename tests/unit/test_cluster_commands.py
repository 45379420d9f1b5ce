"""Multi-node launch commands (srun, mpirun for OpenMPI/MVAPICH, pdsh) from hostfiles with include/exclude, compared
to exact argv lists; shell quoting of user values; secrets never on a command line or in a log line; worker-side
rank discovery from torchrun, SLURM and MPI variables."""

from __future__ import annotations

import logging
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from megatron.cluster.worker_env import discover_rank_env, expand_nodelist
from megatron.launcher.config import LauncherConfig
from megatron.launcher.launch import run_cluster
from megatron.launcher.multinode import cluster_command, is_multinode
from megatron.launcher.secrets import RedactingFilter, redact, write_env_file
from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs
from tests.unit.test_launcher import TINY  # the same tiny model the launcher tests use

PY = sys.executable
SECRETS = {"WANDB_API_KEY": "wandb-s3cr3t-value-0123", "HF_TOKEN": "hf_T0kenValue987", "MY_PASSWORD": "pa ss'wd"}
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", **SECRETS, "NCCL_DEBUG": "INFO"}


def make_args(tmp_path: Path, hostfile_text: str, **overrides) -> NeoXArgs:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    hosts = {ln.split()[0]: int(ln.split("=")[1]) for ln in hostfile_text.splitlines() if ln.strip()}
    return NeoXArgs({**TINY, "hostfile": str(hostfile), **overrides}, env=LaunchEnv(on_cpu=False, hosts=hosts))


THREE = "node-a slots=4\nnode-b slots=4\nnode-c slots=4\n"


def command(tmp_path: Path, hostfile_text: str = THREE, **overrides):
    args = make_args(tmp_path, hostfile_text, **overrides)
    return args, cluster_command(
        LauncherConfig.from_neox_args(args), "/runs/r1/neox_config.json", "/runs/r1", BASE_ENV, on_cpu=False
    )


@pytest.mark.parametrize(
    "filters,nodes,per_node",
    [
        ({}, ["node-a", "node-b", "node-c"], 4),
        ({"exclude": "node-b"}, ["node-a", "node-c"], 4),
        ({"include": "node-c@node-a"}, ["node-c", "node-a"], 4),
        ({"include": "node-a:0,1@node-b:0,1"}, ["node-a", "node-b"], 2),
        ({"num_nodes": 2, "num_gpus": 1}, ["node-a", "node-b"], 1),
    ],
)
def test_srun_task_layout_from_hostfile_filters(tmp_path, filters, nodes, per_node):
    args, cmd = command(tmp_path, launcher="slurm", comment="neox", account="proj1", **filters)
    total = len(nodes) * per_node
    assert args.global_num_gpus == total
    assert cmd.argv == [
        "srun", "-n", str(total), "--nodes", str(len(nodes)), "--ntasks-per-node", str(per_node),
        "--nodelist", ",".join(nodes), "--kill-on-bad-exit=1", "--comment", "neox", "--account", "proj1",
        "--export=ALL",
        PY, "-u", "train.py", "--neox_config", "/runs/r1/neox_config.json",
    ]  # fmt: skip
    assert cmd.env["MASTER_ADDR"] == nodes[0] and cmd.env["MASTER_PORT"] == "29500"


def test_openmpi_and_mvapich_commands(tmp_path):
    _, ompi = command(tmp_path, launcher="openmpi", exclude="node-c", master_addr="10.0.0.1")
    assert ompi.hostfile == ("/runs/r1/hostfile.openmpi", "node-a slots=4\nnode-b slots=4\n")
    names = ["HF_TOKEN", "MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "PYTHONPATH", "WANDB_API_KEY"]
    assert ompi.forwarded == names and ompi.env["MASTER_ADDR"] == "10.0.0.1"
    assert ompi.argv == [
        "mpirun", "-n", "8", "-hostfile", "/runs/r1/hostfile.openmpi", "--mca", "btl", "^openib",
        *[x for name in names for x in ("-x", name)],
        PY, "-u", "train.py", "--neox_config", "/runs/r1/neox_config.json",
    ]  # fmt: skip
    _, mv = command(tmp_path, "n1 slots=2\nn2 slots=2\n", launcher="mvapich")
    mv_names = sorted([*names, "MV2_ENABLE_AFFINITY", "MV2_SMP_USE_CMA", "MV2_SUPPORT_DL"])
    assert mv.hostfile == ("/runs/r1/hostfile.mvapich", "n1\nn2\n")
    assert mv.argv == [
        "mpirun", "-np", "4", "-ppn", "2", "--hostfile", "/runs/r1/hostfile.mvapich", "-genvlist", ",".join(mv_names),
        PY, "-u", "train.py", "--neox_config", "/runs/r1/neox_config.json",
    ]  # fmt: skip
    assert mv.notes == [] and command(tmp_path, launcher="openmpi", comment="x")[1].notes == [
        "comment is used by launcher slurm only"
    ]


def test_pdsh_command_and_world_info(tmp_path):
    import base64
    import json

    _, cmd = command(tmp_path, launcher="pdsh", include="node-a:1,3@node-c")
    assert cmd.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-c"] and len(cmd.argv) == 7
    remote = shlex.split(cmd.argv[6])
    info = next(t for t in remote if t.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(info)) == {"node-a": [1, 3], "node-c": [0, 1, 2, 3]}
    assert remote[:2] == ["cd", os.getcwd()] and "--node_rank=%n" in remote and "--master_addr=node-a" in remote
    assert remote[-3:] == ["train.py", "--neox_config", "/runs/r1/neox_config.json"]
    assert cmd.env_file == "/runs/r1/launch.env" and cmd.env["PDSH_RCMD_TYPE"] == "ssh"
    assert cmd.env["PDSH_SSH_ARGS_APPEND"] == "-o ServerAliveInterval=15 -o ServerAliveCountMax=4"


def test_deepspeed_env_file_is_forwarded_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / ".deepspeed_env").write_text("# cluster settings\nFI_PROVIDER=efa\nMY_API_KEY=k3y-value\n")
    _, cmd = command(tmp_path, launcher="openmpi")
    assert cmd.env["FI_PROVIDER"] == "efa" and {"FI_PROVIDER", "MY_API_KEY"} <= set(cmd.forwarded)
    assert "k3y-value" not in " ".join(cmd.argv)
    (tmp_path / ".deepspeed_env").write_text("no equals sign\n")
    with pytest.raises(ConfigError, match="deepspeed_env: line 1: expected KEY=VALUE"):
        command(tmp_path, launcher="openmpi")


def test_launchers_that_place_by_count_refuse_slot_pinning(tmp_path):
    for launcher in ("slurm", "openmpi", "mvapich"):
        with pytest.raises(ConfigError, match=f"launcher {launcher}: cannot pin ranks to slots \\[1, 3\\] on node-a"):
            command(tmp_path, launcher=launcher, include="node-a:1,3@node-b")
    with pytest.raises(ConfigError, match="launcher slurm: needs the same slot count on every host"):
        command(tmp_path, "a slots=4\nb slots=2\n", launcher="slurm")
    one = make_args(tmp_path, "solo slots=2\n", launcher="slurm")
    assert not is_multinode(LauncherConfig.from_neox_args(one))
    assert is_multinode(
        LauncherConfig.from_neox_args(make_args(tmp_path, "solo slots=2\n", launcher="slurm", deepspeed_slurm=True))
    )
    with pytest.raises(ConfigError, match="not a multi-node launch"):
        cluster_command(LauncherConfig.from_neox_args(one), "/c.json", "/r", BASE_ENV)


def test_user_values_are_quoted(tmp_path):
    """Spaces and quotes in comment, account, paths and tags survive as single arguments / shell words."""
    odd = 'it\'s a "quoted" value; rm -rf /tmp/x $(id) %n'
    run_dir = str(tmp_path / "run dir's")
    config = os.path.join(run_dir, "neox config.json")
    tag = "group 'with' \"tags\" $HOME"
    args = make_args(tmp_path, THREE, launcher="slurm", comment=odd, account="acct 'x'", wandb_group=tag)
    srun = cluster_command(LauncherConfig.from_neox_args(args), config, run_dir, BASE_ENV, on_cpu=False)
    assert not any(tag in a for a in srun.argv)  # config values travel in the config file, never on a command line
    assert srun.argv[srun.argv.index("--comment") + 1] == odd
    assert srun.argv[srun.argv.index("--account") + 1] == "acct 'x'" and srun.argv[-1] == config
    args = make_args(tmp_path, THREE, launcher="pdsh", user_script=f"{run_dir}/my train.py")
    pdsh = cluster_command(LauncherConfig.from_neox_args(args), config, run_dir, BASE_ENV, on_cpu=False)
    # pdsh turns %% into % before the remote shell splits the line
    remote = shlex.split(pdsh.argv[-1].replace("%%", "\0").replace("%n", "7").replace("\0", "%"))
    assert remote[-3:] == [f"{run_dir}/my train.py", "--neox_config", config]
    assert f"{run_dir}/launch.env" in remote and "--node_rank=7" in remote


def test_no_secret_in_any_command_or_log_line(tmp_path, caplog):
    hostfile = "node-a slots=2\nnode-b slots=2\n"
    for launcher in ("slurm", "openmpi", "mvapich", "pdsh"):
        _, cmd = command(tmp_path, hostfile, launcher=launcher, comment="c")
        text = " ".join(cmd.argv) + (cmd.hostfile[1] if cmd.hostfile else "")
        for value in SECRETS.values():
            assert value not in text, (launcher, text)
        # the ranks still get them, through the launcher's environment (srun --export=ALL / mpirun -x NAME)
        assert {"WANDB_API_KEY", "HF_TOKEN"} <= set(cmd.forwarded) or launcher == "slurm"
        assert all(cmd.env[k] == v for k, v in SECRETS.items())
    env_file = tmp_path / "launch.env"
    write_env_file(str(env_file), cmd.forwarded_env())
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert "WANDB_API_KEY=wandb-s3cr3t-value-0123\n" in env_file.read_text()
    assert redact(f"key={SECRETS['HF_TOKEN']} pw={SECRETS['MY_PASSWORD']}", SECRETS) == "key=*** pw=***"
    logger = logging.getLogger("neox.test.secrets")
    logger.addFilter(RedactingFilter())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_API_KEY", SECRETS["WANDB_API_KEY"])
        with caplog.at_level(logging.INFO, logger="neox.test.secrets"):
            logger.info("cmd = export WANDB_API_KEY=%s; python train.py", SECRETS["WANDB_API_KEY"])
    assert caplog.records[-1].getMessage() == "cmd = export WANDB_API_KEY=***; python train.py"


def test_log_redaction_covers_loggers_that_do_not_propagate(monkeypatch):
    """deepy.py and train.py install a record factory: DeepSpeed's own logger (own handler, no propagation) too."""
    import io

    from megatron.launcher.secrets import install_log_redaction

    stream = io.StringIO()
    logger = logging.getLogger("neox.test.isolated")
    logger.propagate, handler = False, logging.StreamHandler(stream)
    logger.addHandler(handler)
    factory = logging.getLogRecordFactory()
    try:
        install_log_redaction()
        install_log_redaction()  # idempotent
        monkeypatch.setenv("HF_TOKEN", SECRETS["HF_TOKEN"])
        logger.warning("export HF_TOKEN=%s", SECRETS["HF_TOKEN"])
        logger.warning("100%% of %s", "ranks")  # ordinary records are untouched
    finally:
        logging.setLogRecordFactory(factory)
        logger.removeHandler(handler)
    assert stream.getvalue() == "export HF_TOKEN=***\n100% of ranks\n"


def test_run_cluster_writes_private_env_file_and_removes_it(tmp_path):
    """A real launch through run_cluster with `sh` as the 'launcher': the env file is 0600 while it runs."""
    env_file = tmp_path / "launch.env"
    probe = f'stat -c %a {env_file} > {tmp_path}/mode; . {env_file}; printf %s "$HF_TOKEN" > {tmp_path}/seen'
    from megatron.launcher.multinode import ClusterCommand

    cmd = ClusterCommand("pdsh", ["sh", "-c", probe], {"PATH": os.environ["PATH"]}, [], env_file=str(env_file))
    cmd.env["HF_TOKEN"] = SECRETS["HF_TOKEN"]
    cmd.forwarded.append("HF_TOKEN")
    assert run_cluster(cmd) == 0
    assert (tmp_path / "mode").read_text().strip() == "600" and (tmp_path / "seen").read_text() == SECRETS["HF_TOKEN"]
    assert not env_file.exists()
    with pytest.raises(ConfigError, match="launcher slurm: no-such-srun is not installed"):
        run_cluster(ClusterCommand("slurm", ["no-such-srun"], {"PATH": "/nonexistent"}, []))


def test_expand_slurm_nodelist():
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("vm") == ["vm"] and expand_nodelist("a[9-11]") == ["a9", "a10", "a11"]


@pytest.mark.parametrize(
    "env,prefer_slurm,expected",
    [
        # torchrun / DeepSpeed's launcher: their variables win, even inside a SLURM step
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1", "SLURM_PROCID": "0"},
         True, ("launcher", "3", "1", "4", "h", "1")),
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
          "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "8"}, True, ("slurm", "5", "1", "8", "gpu07", "6001")),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
         False, ("openmpi", "1", "1", "2", "127.0.0.1", "6001")),
        ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "m0"},
         False, ("pmi", "2", "0", "4", "m0", "6001")),
        # an sbatch script itself (no srun step): one process, not rank 0 of SLURM_NTASKS
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "vm"},
         True, ("single process", "0", "0", "1", "127.0.0.1", "6001")),
    ],
)  # fmt: skip
def test_worker_rank_discovery(env, prefer_slurm, expected):
    source = discover_rank_env(env, prefer_slurm=prefer_slurm, master_port=6001)
    got = (source, env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"])
    assert got == expected
    assert env["LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"]


def test_reading_the_config_leaves_a_plain_environment_alone():
    env = {"PATH": "/bin"}
    assert discover_rank_env(env, fill_defaults=False) == "single process" and env == {"PATH": "/bin"}
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    assert discover_rank_env(env, fill_defaults=False) == "launcher" and env == {"RANK": "1", "WORLD_SIZE": "2"}


def test_mpi_across_nodes_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="span several nodes but MASTER_ADDR is not set"):
        discover_rank_env(env)
