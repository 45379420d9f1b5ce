"""Multi-node launch commands (pdsh, OpenMPI, MVAPICH, SLURM) built from the hostfile and include/exclude.

The commands follow DeepSpeed's runner backends, with two differences: environment values never appear on the
command line (``srun --export=ALL`` and ``mpirun -x NAME`` forward names; pdsh's remote shell sources a 0600
environment file), and every user value that reaches a shell string is quoted.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron.cluster.env_values import master_addr
from megatron.cluster.hostfile import active_resources, read_hostfile
from megatron.launcher.config import LauncherConfig, ranks_on_cpu
from megatron.neox_arguments.errors import ConfigError

# Variables the ranks need from the launching shell (DeepSpeed's runner forwards a similar prefix list).
FORWARD_PREFIXES = (
    "WANDB", "NEOX", "HF_", "HUGGING", "COMET", "DS_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS",
    "PYTHON", "UCX", "MV2", "NCCL", "GLOO", "TORCH", "CUDA_", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
PDSH_FAN_OUT = 1024
# ssh gives up on a host that stopped answering (link down, kernel panic) after 15 s x 4, instead of waiting for TCP's
# own timeout (hours): pdsh, and deepy with it, then end. Options the user set in PDSH_SSH_ARGS_APPEND come first
# and win (ssh keeps the first value of an option).
SSH_KEEPALIVE = "-o ServerAliveInterval=15 -o ServerAliveCountMax=4"
ENV_FILE = "launch.env"
RELAY_SIGNAL = "{signal}"  # replaced in ClusterCommand.relay by the signal's name
# srun and Open MPI's mpirun end their tasks on SIGTERM (SIGKILL within a second or two, no save) and pass on only
# some signals, SIGUSR1 and SIGUSR2 among them: deepy gives them the first of those that is a preemption signal
FORWARDED_BY_LAUNCHER = {"slurm": ("SIGUSR1", "SIGUSR2"), "openmpi": ("SIGUSR1", "SIGUSR2")}
LAUNCHER_PROGRAM = {"slurm": "srun", "openmpi": "Open MPI's mpirun"}


@dataclass
class ClusterCommand:
    """A multi-node launch: argv (no secrets), the launcher's environment, and files to write first."""

    backend: str
    argv: list[str]
    env: dict[str, str]
    forwarded: list[str]
    hostfile: tuple[str, str] | None = None  # (path, text) for mpirun
    env_file: str | None = None  # pdsh: path of the 0600 file holding the forwarded variables
    notes: list[str] = field(default_factory=list)
    signal_map: dict[str, str] = field(default_factory=dict)  # the signal the launcher gets for one deepy relays
    relay: list[str] = field(default_factory=list)  # pdsh: argv signalling every host's ranks (RELAY_SIGNAL: which)

    def forwarded_env(self) -> dict[str, str]:
        return {k: self.env[k] for k in self.forwarded}


def _pdsh_quote(value: str) -> str:
    """Shell-quoted, with pdsh's ``%`` substitutions (``%h``, ``%n``) escaped."""
    return shlex.quote(value.replace("%", "%%"))


def _uniform_slots(backend: str, active: dict[str, list[int]], same_count: bool) -> int:
    """Slots per host for schedulers that place ranks by count; ConfigError when a filter asks for more."""
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise ConfigError(
                f"launcher {backend}: cannot pin ranks to slots {slots} on {host}; include/exclude whole hosts "
                "or the first N slots of a host (launcher pdsh can pin slots)"
            )
    counts = {h: len(s) for h, s in active.items()}
    if same_count and len(set(counts.values())) > 1:
        raise ConfigError(f"launcher {backend}: needs the same slot count on every host, got {counts}")
    return next(iter(counts.values()))


def is_multinode(cfg: LauncherConfig) -> bool:
    """True when deepy must use the multi-node backend: a hostfile with >1 active host, or force_multi."""
    try:
        return _active(cfg) is not None
    except ConfigError:
        return True  # let cluster_command report the problem


def deepspeed_env_file(environ: Mapping[str, str]) -> dict[str, str]:
    """``KEY=VALUE`` lines of DeepSpeed's ``.deepspeed_env`` (name from $DS_ENV_FILE) in ~ then the working dir."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    values: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), os.getcwd()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, eq, value = line.partition("=")
                if not eq or not key.strip():
                    raise ConfigError(f"{path}: line {lineno}: expected KEY=VALUE, got {line!r}")
                values[key.strip()] = value
    return values


def _active(cfg: LauncherConfig) -> dict[str, list[int]] | None:
    path = cfg.hostfile_path
    if path is None:
        return None
    try:
        active = active_resources(read_hostfile(path), cfg.include, cfg.exclude, cfg.num_nodes, cfg.num_gpus)
    except ValueError as e:
        raise ConfigError(f"hostfile {path}: {e}") from None
    force = cfg.force_multi or cfg.deepspeed_slurm or cfg.deepspeed_mpi
    return active if active and (len(active) > 1 or force) else None


@dataclass(frozen=True)
class _Launch:
    """What every backend needs: the resolved hosts and the launcher's environment."""

    args: LauncherConfig
    active: dict[str, list[int]]
    env: dict[str, str]
    forwarded: list[str]
    script: list[str]
    run_dir: str
    config_path: str

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.active.values())

    def notes(self) -> list[str]:
        return [f"{k} is used by launcher slurm only" for k in ("comment", "account") if getattr(self.args, k)]

    def signal_map(self, backend: str) -> tuple[dict[str, str], list[str]]:
        """(deepy's stop signals -> the one the launcher forwards, notes) for srun and mpirun."""
        wanted = list(self.args.preemption_signals)
        usable = [s for s in wanted if s in FORWARDED_BY_LAUNCHER[backend]]
        if usable:
            return {"SIGTERM": usable[0], "SIGUSR1": usable[0], "SIGUSR2": usable[0]}, []
        if not wanted:
            return {}, []  # preemption is off: a signal ends the ranks the launcher's way
        return {}, [
            f"launcher {backend}: {LAUNCHER_PROGRAM[backend]} does not pass SIGTERM on to the ranks (it kills them, no "
            f"save); a signal to deepy.py saves only when preemption_signals includes SIGUSR1 or SIGUSR2 (it has "
            f"{', '.join(wanted)})"
        ]


def _slurm(x: _Launch) -> ClusterCommand:
    per_node = _uniform_slots("slurm", x.active, same_count=True)
    argv = ["srun", "-n", str(x.total), "--nodes", str(len(x.active)), "--ntasks-per-node", str(per_node)]
    argv += ["--nodelist", ",".join(x.active)]
    # a rank that fails (a peer node died) ends the whole step at once, instead of srun waiting for the dead node's
    # tasks until slurmctld declares it down (SlurmdTimeout, 300 s by default)
    argv += ["--kill-on-bad-exit=1"]
    argv += ["--comment", x.args.comment] if x.args.comment else []
    argv += ["--account", x.args.account] if x.args.account else []
    signals, notes = x.signal_map("slurm")
    argv = [*argv, "--export=ALL", *x.script]  # srun passes the environment
    return ClusterCommand("slurm", argv, x.env, x.forwarded, notes=notes, signal_map=signals)


def _openmpi(x: _Launch) -> ClusterCommand:
    _uniform_slots("openmpi", x.active, same_count=False)
    path = os.path.join(x.run_dir, "hostfile.openmpi")
    text = "".join(f"{h} slots={len(s)}\n" for h, s in x.active.items())
    argv = ["mpirun", "-n", str(x.total), "-hostfile", path, "--mca", "btl", "^openib"]
    for name in x.forwarded:
        argv += ["-x", name]  # the value comes from mpirun's own environment
    signals, notes = x.signal_map("openmpi")
    return ClusterCommand(
        "openmpi", [*argv, *x.script], x.env, x.forwarded, (path, text), notes=x.notes() + notes, signal_map=signals
    )


def _mvapich(x: _Launch) -> ClusterCommand:
    per_node = _uniform_slots("mvapich", x.active, same_count=True)
    env = {"MV2_SMP_USE_CMA": "0", "MV2_SUPPORT_DL": "1", "MV2_ENABLE_AFFINITY": "0", **x.env}
    forwarded = sorted({*x.forwarded, *(k for k in env if k.startswith("MV2"))})
    path = os.path.join(x.run_dir, "hostfile.mvapich")
    text = "".join(f"{h}\n" for h in x.active)
    argv = ["mpirun", "-np", str(x.total), "-ppn", str(per_node), "--hostfile", path]
    argv += ["-genvlist", ",".join(forwarded)]
    return ClusterCommand("mvapich", [*argv, *x.script], env, forwarded, (path, text), notes=x.notes())


def _pdsh(x: _Launch) -> ClusterCommand:
    """ssh to every host; DeepSpeed's per-node launcher starts that node's ranks after sourcing the env file."""
    env_file = os.path.abspath(os.path.join(x.run_dir, ENV_FILE))
    info = base64.urlsafe_b64encode(json.dumps(x.active).encode("utf-8")).decode("ascii")
    remote = [
        f"cd {_pdsh_quote(os.getcwd())} && set -a && . {_pdsh_quote(env_file)} && set +a &&",
        f"exec {_pdsh_quote(sys.executable)} -u -m deepspeed.launcher.launch --world_info={info} --node_rank=%n",
        f"--master_addr={_pdsh_quote(x.env['MASTER_ADDR'])} --master_port={x.env['MASTER_PORT']}",
        " ".join(_pdsh_quote(a) for a in x.script[2:]),  # the user script, --neox_config PATH
    ]
    env = {**x.env, "PDSH_RCMD_TYPE": "ssh"}
    env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} {SSH_KEEPALIVE}".strip()
    pdsh = ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(x.active)]
    # pdsh's ssh passes no signal on: deepy signals each host's ranks of this run itself (signal_ranks.py)
    relay_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "signal_ranks.py")
    relay = (
        f"exec {_pdsh_quote(sys.executable)} {_pdsh_quote(relay_script)} {RELAY_SIGNAL} {_pdsh_quote(x.config_path)}"
    )
    argv = [*pdsh, " ".join(remote)]
    return ClusterCommand("pdsh", argv, env, x.forwarded, env_file=env_file, notes=x.notes(), relay=[*pdsh, relay])


BACKENDS = {"slurm": _slurm, "openmpi": _openmpi, "mvapich": _mvapich, "pdsh": _pdsh}


def cluster_command(
    args: LauncherConfig,
    config_path: str,
    run_dir: str,
    base_env: Mapping[str, str] | None = None,
    *,
    on_cpu: bool | None = None,
) -> ClusterCommand:
    """The command that starts every rank of ``args`` (the launcher keys) across the hostfile's nodes with
    ``args.launcher``.

    ``base_env`` (default: this process's environment) is what the launcher process inherits.
    """
    active = _active(args)
    if active is None:
        raise ConfigError("not a multi-node launch: no hostfile with hosts, or one host and force_multi off")
    environ = dict(os.environ if base_env is None else base_env)
    env = dict(environ)
    if ranks_on_cpu() if on_cpu is None else on_cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    cwd = os.getcwd()
    env["PYTHONPATH"] = f"{cwd}:{environ['PYTHONPATH']}" if environ.get("PYTHONPATH") else cwd
    env["MASTER_ADDR"] = args.master_addr or master_addr(environ) or next(iter(active))
    env["MASTER_PORT"] = str(args.master_port)
    extra = deepspeed_env_file(environ)  # forwarded whatever their names, as DeepSpeed's runner does
    env.update(extra)
    forwarded = sorted(k for k in env if k.startswith(FORWARD_PREFIXES) or k in extra)
    if args.user_script is None:
        raise ConfigError("user_script is not set: the script deepy.py launches on every rank (train.py, ...)")
    script = [sys.executable, "-u", args.user_script, "--neox_config", config_path]
    return BACKENDS[args.launcher](_Launch(args, active, env, forwarded, script, run_dir, config_path))
