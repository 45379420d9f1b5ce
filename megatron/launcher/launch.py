"""Turning a resolved ``NeoXArgs`` into a launch: DeepSpeed's runner on one node, srun/mpirun/pdsh across nodes."""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from megatron.cluster.env_values import master_addr as env_master_addr
from megatron.launcher.config import LauncherConfig, ranks_on_cpu
from megatron.launcher.ds_runner import NODE_LAUNCH
from megatron.launcher.exit_reports import ExitReports
from megatron.launcher.multinode import RELAY_SIGNAL, ClusterCommand
from megatron.launcher.secrets import redact, write_env_file
from megatron.launcher.supervise import SignalQueue, Supervisor, local_ranks
from megatron.launcher.threads import threads_per_rank
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError

logger = logging.getLogger(__name__)

CONFIG_NAME = "neox_config.json"
DS_CONFIG_NAME = "ds_config.json"


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchPlan:
    """Everything needed to start the ranks: DeepSpeed runner argv, environment additions, run folder."""

    runner_argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    config_path: str = ""
    notes: list[str] = field(default_factory=list)
    threads: str = ""  # CPU ranks: the threads per rank and why (printed by deepy.py)
    node_argv: list[str] | None = None
    """One node of CPU ranks with no host selection: the arguments of DeepSpeed's per-node launcher
    (``deepspeed.launcher.launch``), started directly. For this case the runner only computes them (its local
    branch), at the cost of a second DeepSpeed import (~3 s) before any rank starts."""

    def command_line(self) -> str:
        """The exact launch command, as a shell line (environment additions first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        if self.node_argv is not None:
            cmd = shlex.join([sys.executable, "-u", "-m", "deepspeed.launcher.launch", *self.node_argv])
        else:
            cmd = shlex.join([sys.executable, "-m", "deepspeed.launcher.runner", *self.runner_argv])
        return redact(f"{env} {cmd}".strip())


def default_run_dir(log_dir: str | None) -> str:
    """``<log_dir or runs>/deepy-<UTC time>-<pid>``: where deepy writes the resolved config."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return os.path.join(log_dir or "runs", f"deepy-{stamp}-{os.getpid()}")


def node_launch_argv(num_ranks: int, port: int, script_argv: list[str]) -> list[str]:
    """DeepSpeed's per-node launcher arguments for ``num_ranks`` ranks on this host, as DeepSpeed's runner builds
    them for a local launch (``world_info``: ``{"localhost": [0, ..., N-1]}``, base64 of its JSON)."""
    world = json.dumps({"localhost": list(range(num_ranks))}).encode()
    world_info = base64.urlsafe_b64encode(world).decode()
    return [
        f"--world_info={world_info}", "--master_addr=127.0.0.1", f"--master_port={port}",
        "--enable_each_rank_log=None", "--log_level=info",
        *script_argv,
    ]  # fmt: skip


def plan_launch(args: LauncherConfig, run_dir: str, *, on_cpu: bool | None = None) -> LaunchPlan:
    """Build the DeepSpeed runner argv for ``args`` (GPT-NeoX's launcher keys) without side effects."""
    on_cpu = ranks_on_cpu() if on_cpu is None else on_cpu
    explicit = args.explicit_keys
    argv: list[str] = []
    notes: list[str] = []
    env: dict[str, str] = {}
    hostfile = args.hostfile or os.environ.get("DLTS_HOSTFILE")
    has_hosts = args.hostfile_path is not None
    if hostfile:
        argv += ["--hostfile", hostfile]
    if args.include:
        argv += ["--include", args.include]
    if args.exclude:
        argv += ["--exclude", args.exclude]
    if args.num_nodes is not None and args.num_nodes != -1:
        argv += ["--num_nodes", str(args.num_nodes)]
    num_gpus = args.num_gpus
    nodes = args.num_nodes if args.num_nodes and args.num_nodes > 0 else 1
    if on_cpu and not has_hosts:  # one node of CPU ranks: as many as the resolved world size
        num_gpus = args.global_num_gpus // nodes
    if num_gpus is not None:
        if args.include or args.exclude:
            notes.append("num_gpus is ignored because include/exclude select the devices")
        else:
            argv += ["--num_gpus", str(num_gpus)]
    port = args.master_port
    if on_cpu and not has_hosts and "master_port" not in explicit:
        port = free_port()  # local CPU ranks: never collide with another run on the default port
    argv += ["--master_port", str(port)]
    master_addr = args.master_addr or env_master_addr(os.environ)
    if master_addr:
        argv += ["--master_addr", master_addr]
    # launcher, force_multi, comment and account only matter across nodes: see multinode.cluster_command.
    if not has_hosts and (args.launcher != "pdsh" or args.force_multi or args.deepspeed_slurm or args.deepspeed_mpi):
        notes.append(
            f"no hostfile: launcher {args.launcher} is not used, the ranks start on this node only "
            "(pass --hostfile, or use tools/slurm/train.sbatch, which writes one)"
        )
    config_path = os.path.abspath(os.path.join(run_dir, CONFIG_NAME))
    if args.user_script is None:
        raise ConfigError("user_script is not set: the script deepy.py launches on every rank (train.py, ...)")
    if args.autotuning_run is not None:  # DeepSpeed's autotuner runs the experiments (neox_arguments/autotuning.py)
        argv += ["--autotuning", args.autotuning_run]
        # it starts each experiment with the `deepspeed` command: this environment's
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        if on_cpu:  # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE says how many
            env["LOCAL_SIZE"] = str(num_gpus or 1)
    script = [args.user_script, "--neox_config", config_path]
    if args.autotuning_run is not None:  # the autotuner reads the DeepSpeed config from this file
        script += ["--deepspeed_config", os.path.join(os.path.dirname(config_path), DS_CONFIG_NAME)]
    argv += script
    node_argv = None
    one_node = on_cpu and not hostfile and not args.include and not args.exclude and nodes == 1
    if one_node and args.autotuning_run is None:  # the autotuner is the runner's: it keeps the runner
        assert num_gpus is not None  # set from the world size above
        node_argv = node_launch_argv(int(num_gpus), port, script)
    threads = ""
    if on_cpu:
        env["DS_ACCELERATOR"] = "cpu"
        # DeepSpeed's launcher leaves OMP_NUM_THREADS unset: every rank would use every core.
        count, why = threads_per_rank(int(num_gpus or 1), os.environ)
        env["OMP_NUM_THREADS"] = str(count)
        threads = f"CPU threads per rank: {count} ({why}; set OMP_NUM_THREADS to choose)"
    return LaunchPlan(argv, env, run_dir, config_path, notes, threads, node_argv)


def launch_wandb_group(use_wandb: bool | None, wandb_group: str | None) -> str | None:
    """The W&B group of this launch, fixed once for all ranks: ``wandb_group`` with one random suffix per launch
    (deepy writes it into the resolved config the ranks read); ``wandb_group`` itself without W&B."""
    if not use_wandb:
        return wandb_group
    import secrets

    suffix = secrets.token_hex(4)
    return f"{wandb_group}_{suffix}" if wandb_group else suffix


def write_run_dir(args: NeoXArgs, plan: LaunchPlan, command: str | None = None) -> None:
    """Write the resolved config, the DeepSpeed config, the raw config files and the launch command (``command``,
    default the DeepSpeed runner's); a previous launch's exit reports (a reused ``--run_dir``) are removed."""
    ExitReports(plan.run_dir, 0).clear()
    os.makedirs(os.path.join(plan.run_dir, "configs"), exist_ok=True)
    args.save_config(plan.config_path)
    ds_config = args.deepspeed_config
    if args.autotuning_run is not None:  # the autotuner's base config: each experiment sets its own batch split
        ds_config = {k: v for k, v in ds_config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    with open(os.path.join(plan.run_dir, DS_CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(ds_config, f, indent=2, sort_keys=True)
    for name, text in (args.config_files or {}).items():
        with open(os.path.join(plan.run_dir, "configs", name), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(plan.run_dir, "launch.txt"), "w", encoding="utf-8") as f:
        f.write(redact(command or plan.command_line()) + "\n")


def launch(plan: LaunchPlan, signals: SignalQueue | None = None, reports: ExitReports | None = None) -> int:
    """Run DeepSpeed's runner (``plan.command_line()``) under deepy's supervision; returns the ranks' exit status.

    Signals to deepy reach every rank and deepy waits for them (``megatron.launcher.supervise``): 42 after a
    preemption save. ``signals``: deepy's signal queue, installed before the configs were read; ``reports``: the
    ranks' own exit statuses (see ``Supervisor``).
    """
    check_master_port(plan)
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_runner.py")
    env = {**os.environ, **plan.env}
    if plan.node_argv is not None:  # the ranks are children of the per-node launcher deepy starts
        argv = [sys.executable, "-u", runner, NODE_LAUNCH, *plan.node_argv]
        return Supervisor(argv, env, ranks=lambda pid: local_ranks(pid, 1), signals=signals, reports=reports).run()
    argv = [sys.executable, "-u", runner, *plan.runner_argv]  # runner -> per-node launcher -> ranks
    return Supervisor(argv, env, ranks=lambda pid: local_ranks(pid, 2), signals=signals, reports=reports).run()


def check_master_port(plan: LaunchPlan) -> None:
    """ConfigError when the local ranks' rendezvous port is taken on this machine (instead of a rank's traceback)."""
    argv = plan.runner_argv
    if "--hostfile" in argv or "--master_port" not in argv:
        return  # the master may be another host
    port = int(argv[argv.index("--master_port") + 1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store does
        try:
            s.bind(("", port))
        except OSError as e:
            raise ConfigError(
                f"master_port {port} is already in use on this machine ({e.strerror}): another run or service holds "
                "it; set master_port to a free port (on CPU, leave it unset and deepy picks one)"
            ) from None


def run_cluster(cmd: ClusterCommand, signals: SignalQueue | None = None, reports: ExitReports | None = None) -> int:
    """Start a multi-node launch (srun/mpirun/pdsh) and wait; signals are relayed as ``Supervisor`` describes
    (srun and Open MPI's mpirun get the stop signal they forward, pdsh launches are signalled through ``cmd.relay``).

    The hostfile for mpirun and pdsh's 0600 environment file are written first; the environment file is removed
    when the launch ends.
    """
    if cmd.hostfile:
        with open(cmd.hostfile[0], "w", encoding="utf-8") as f:
            f.write(cmd.hostfile[1])
    if cmd.env_file:
        write_env_file(cmd.env_file, cmd.forwarded_env())
    try:
        relay = (lambda sig: _run_relay(cmd, sig)) if cmd.relay else None
        supervisor = Supervisor(
            cmd.argv, cmd.env, signals=signals, relay=relay, signal_map=cmd.signal_map, reports=reports
        )
        return supervisor.run()
    except FileNotFoundError:
        raise ConfigError(f"launcher {cmd.backend}: {cmd.argv[0]} is not installed (not on PATH)") from None
    finally:
        if cmd.env_file and os.path.exists(cmd.env_file):
            os.unlink(cmd.env_file)


def _run_relay(cmd: ClusterCommand, sig: signal.Signals) -> int:
    """Run ``cmd.relay`` for ``sig`` (every host's ranks of the run get it once they catch it); its exit status."""
    argv = [a.replace(RELAY_SIGNAL, sig.name) for a in cmd.relay]
    try:
        return subprocess.run(
            argv, env=cmd.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=60, check=False,
        ).returncode  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return 1
