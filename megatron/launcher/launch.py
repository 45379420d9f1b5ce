"""Turning a resolved ``NeoXArgs`` into a DeepSpeed runner invocation, a run folder, and a launch."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError

logger = logging.getLogger(__name__)

CONFIG_NAME = "neox_config.json"


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

    def command_line(self) -> str:
        """The exact launch command, as a shell line (environment additions first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join([sys.executable, "-m", "deepspeed.launcher.runner", *self.runner_argv])
        return f"{env} {cmd}".strip()


def default_run_dir(args: NeoXArgs) -> str:
    """``<log_dir or runs>/deepy-<UTC time>-<pid>``: where deepy writes the resolved config."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return os.path.join(args.log_dir or "runs", f"deepy-{stamp}-{os.getpid()}")


def _is_cpu() -> bool:
    from megatron.distributed import on_cpu

    return on_cpu()


def plan_launch(args: NeoXArgs, run_dir: str, *, on_cpu: bool | None = None) -> LaunchPlan:
    """Build the DeepSpeed runner argv for ``args`` (GPT-NeoX's launcher keys) without side effects."""
    on_cpu = _is_cpu() if on_cpu is None else on_cpu
    explicit = args.explicit_keys
    argv: list[str] = []
    notes: list[str] = []
    env: dict[str, str] = {}
    hostfile = args.hostfile or os.environ.get("DLTS_HOSTFILE")
    has_hosts = bool(hostfile and os.path.isfile(hostfile))
    if hostfile:
        argv += ["--hostfile", hostfile]
    if args.include:
        argv += ["--include", args.include]
    if args.exclude:
        argv += ["--exclude", args.exclude]
    if args.num_nodes is not None and args.num_nodes != -1:
        argv += ["--num_nodes", str(args.num_nodes)]
    num_gpus = args.num_gpus
    if on_cpu and not has_hosts:
        # One node of CPU ranks: as many as the resolved world size.
        nodes = args.num_nodes if args.num_nodes and args.num_nodes > 0 else 1
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
    master_addr = args.master_addr or os.environ.get("MASTER_ADDR")
    if master_addr:
        argv += ["--master_addr", master_addr]
    if args.launcher != "pdsh":
        argv += ["--launcher", args.launcher]
    if args.force_multi or args.deepspeed_slurm or args.deepspeed_mpi:
        argv.append("--force_multi")
    if args.no_ssh_check:
        argv.append("--no_ssh_check")
    launcher_args = []
    if args.comment:
        launcher_args.append(f"--comment={args.comment}")
    if args.account:
        launcher_args.append(f"--account={args.account}")
    if launcher_args:
        argv += ["--launcher_args", " ".join(launcher_args)]
    config_path = os.path.abspath(os.path.join(run_dir, CONFIG_NAME))
    argv += [args.user_script, "--neox_config", config_path]
    if on_cpu:
        env["DS_ACCELERATOR"] = "cpu"
        # DeepSpeed's launcher leaves OMP_NUM_THREADS unset: every rank would use every core.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or "1"
    return LaunchPlan(argv, env, run_dir, config_path, notes)


def prepare_for_launch(args: NeoXArgs) -> None:
    """Launcher-side values fixed once for all ranks: the W&B group gets one random suffix per launch."""
    if args.use_wandb:
        import secrets

        suffix = secrets.token_hex(4)
        args.update_value("wandb_group", f"{args.wandb_group}_{suffix}" if args.wandb_group else suffix)


def write_run_dir(args: NeoXArgs, plan: LaunchPlan) -> None:
    """Write the resolved config, the DeepSpeed config, the raw config files and the launch command."""
    os.makedirs(os.path.join(plan.run_dir, "configs"), exist_ok=True)
    args.save_config(plan.config_path)
    with open(os.path.join(plan.run_dir, "ds_config.json"), "w", encoding="utf-8") as f:
        json.dump(args.deepspeed_config, f, indent=2, sort_keys=True)
    for name, text in (args.config_files or {}).items():
        with open(os.path.join(plan.run_dir, "configs", name), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(plan.run_dir, "launch.txt"), "w", encoding="utf-8") as f:
        f.write(plan.command_line() + "\n")


def launch(plan: LaunchPlan) -> int:
    """Run DeepSpeed's runner in this process; returns the ranks' exit status."""
    os.environ.update(plan.env)  # before DeepSpeed is imported: it picks its accelerator at import
    from deepspeed.launcher import runner

    # Multi-node backends forward only variables with these prefixes; W&B and neox-forge settings must reach ranks.
    for prefix in ("WANDB", "NEOX", "DS_ACCELERATOR", "OMP_NUM_THREADS", "HF_"):
        if prefix not in runner.EXPORT_ENVS:
            runner.EXPORT_ENVS.append(prefix)
    try:
        runner.main(plan.runner_argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 1
    except (ValueError, RuntimeError) as e:  # bad resources, missing pdsh/mpirun, unreachable hosts
        raise ConfigError(f"launcher: {e}") from None
    return 0


def multinode_command(plan: LaunchPlan) -> list[str]:
    """The command DeepSpeed's runner would run for a multi-node launch (pdsh/openmpi/mvapich/slurm).

    Mirrors the runner's resource resolution (hostfile, include/exclude, num_nodes/num_gpus) without ssh
    checks or starting anything. Raises ConfigError when the plan is not a multi-node launch.
    """
    from deepspeed.launcher import multinode_runner as mnr
    from deepspeed.launcher import runner

    args = runner.parse_args(plan.runner_argv)
    pool = runner.fetch_hostfile(args.hostfile)
    if not pool:
        raise ConfigError("not a multi-node launch: no hostfile with hosts")
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    if not (args.force_multi or len(active) > 1):
        raise ConfigError("not a multi-node launch: one host and force_multi is off")
    if not args.master_addr:
        args.master_addr = next(iter(active))
    info = runner.encode_world_info(active)
    classes: dict[str, Any] = {
        "pdsh": lambda: mnr.PDSHRunner(args, info),
        "openmpi": lambda: mnr.OpenMPIRunner(args, info, pool),
        "mvapich": lambda: mnr.MVAPICHRunner(args, info, pool),
        "slurm": lambda: mnr.SlurmRunner(args, info, pool),
    }
    try:
        backend = classes[args.launcher.lower()]()
        for key, value in plan.env.items():
            backend.add_export(key, value)
        result = backend.get_cmd(dict(os.environ), active)
    except ValueError as e:
        raise ConfigError(f"launcher {args.launcher}: {e}") from None
    return list(result[0] if isinstance(result, tuple) else result)
