"""Worker side: turn whatever started this rank (torchrun, DeepSpeed, srun, mpirun) into torch.distributed's env.

torch.distributed reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. torchrun and
DeepSpeed's per-node launcher set them; ``srun`` (``deepspeed_slurm``) and ``mpirun`` (``deepspeed_mpi``) set their
own variables instead, which are translated here. Every value is parsed and range-checked first
(``megatron/cluster/env_values.py``): a bad one is one line naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from megatron.cluster.env_values import (
    DEFAULT_MASTER_PORT,
    MAX_WORLD_SIZE,
    LaunchEnvError,
    check_launch_env,
    env_int,
    world_size,
)


@dataclass(frozen=True)
class RankSource:
    """Where one launcher keeps rank, local rank, world size and local world size."""

    name: str
    rank: str
    local_rank: str
    size: str
    local_size: str


MPI_SOURCES = (
    RankSource(
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    RankSource(
        "mvapich",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    RankSource("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (hydra)
)
# SLURM_STEP_* exist only inside an srun step: the batch script itself (SLURM_PROCID=0, SLURM_NTASKS=N) is no rank.
SLURM_SOURCE = RankSource("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list (``gpu[01-03,07],login``) as host names, in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            if not (lo.isdigit() and hi.isdigit() and len(lo) <= 9 and len(hi) <= 9):
                raise LaunchEnvError(f"cannot read the SLURM node list {nodelist!r} (range {part!r})")
            if int(hi) - int(lo) + len(hosts) >= MAX_WORLD_SIZE:
                raise LaunchEnvError(f"the SLURM node list {nodelist[:60]!r} names more than {MAX_WORLD_SIZE} hosts")
            hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


_TASKS_PER_NODE = re.compile(r"([0-9]{1,9})(\(x[0-9]{1,9}\))?(,[0-9]{1,9}(\(x[0-9]{1,9}\))?)*")


def _first_count(env: Mapping[str, str], name: str, world: int) -> int:
    """``SLURM_STEP_TASKS_PER_NODE`` looks like ``4(x2),3``; the first node's count."""
    raw = env.get(name)
    m = _TASKS_PER_NODE.fullmatch(raw) if raw is not None else None
    if raw is None or (m and 1 <= int(m.group(1)) <= world):
        return int(m.group(1)) if m else world
    raise LaunchEnvError(
        f"environment variable {name}={raw[:40]!r} is not valid: it must list tasks per node as SLURM writes it "
        f"(e.g. 4(x2),3), each from 1 to {world} (the step's task count)"
    )


def _apply(env: MutableMapping[str, str], src: RankSource) -> None:
    """Translate a scheduler's variables, each parsed and range-checked under its own name."""
    world = env_int(env, src.size, 1, MAX_WORLD_SIZE)
    rank = env_int(env, src.rank, 0, world - 1, why=f" ({src.size} is {world})")
    if src is SLURM_SOURCE:
        local_world = _first_count(env, src.local_size, world)
    else:
        local_world = env_int(env, src.local_size, 1, world, world, f" ({src.size} is {world})")
    local_rank = env_int(env, src.local_rank, 0, local_world - 1, 0, f" ({src.local_size} is {local_world})")
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local_world))


def _master_addr(env: MutableMapping[str, str], source: str) -> str:
    if source == "slurm":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_nodelist(nodelist) if nodelist else []
        if hosts:
            return hosts[0]
    if int(env["LOCAL_WORLD_SIZE"]) == int(env["WORLD_SIZE"]):
        return "127.0.0.1"  # every rank is on this node
    raise LaunchEnvError(
        f"ranks started by {source} span several nodes but MASTER_ADDR is not set: export MASTER_ADDR=<first node> "
        "(deepy.py's openmpi/mvapich/slurm launches do)"
    )


def discover_rank_env(
    env: MutableMapping[str, str],
    *,
    prefer_slurm: bool = False,
    master_port: int | None = None,
    fill_defaults: bool = True,
) -> str:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT in ``env``; return the source.

    A launcher that already set ``RANK`` (torchrun, DeepSpeed) wins. Otherwise MPI variables are read first
    (mpirun inside a SLURM job also sets SLURM variables, per node), SLURM step variables first when
    ``prefer_slurm`` (``deepspeed_slurm``). With none of them this is a single process: rank 0 of 1. Without
    ``fill_defaults`` (reading the config, before torch.distributed starts) only a scheduler's variables are
    translated and ``env`` is otherwise left alone.
    """
    if "RANK" in env:
        source = "launcher"
        check_launch_env(env)  # before any default is derived from these values
    else:
        candidates = [SLURM_SOURCE, *MPI_SOURCES] if prefer_slurm else [*MPI_SOURCES, SLURM_SOURCE]
        found = next((s for s in candidates if s.rank in env and s.size in env), None)
        source = found.name if found else "single process"
        if found:
            _apply(env, found)
        elif fill_defaults:
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if fill_defaults or source not in ("launcher", "single process"):
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", env["WORLD_SIZE"]))
        env.setdefault("LOCAL_SIZE", env["LOCAL_WORLD_SIZE"])  # DeepSpeed's name
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = _master_addr(env, source)
        if "MASTER_PORT" not in env:
            # master_port None: a caller without a config (megatron.distributed)
            env["MASTER_PORT"] = str(master_port if master_port is not None else DEFAULT_MASTER_PORT)
    check_launch_env(env)
    return source


def describe_ranks(env: MutableMapping[str, str], source: str) -> str:
    """One line for rank 0's log: where the ranks came from and where they meet."""
    where = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}"
    return f"ranks from {source}: world size {env.get('WORLD_SIZE', '1')}, master {where}"


def launched_rank(env: Mapping[str, str] | None = None) -> int:
    """The global rank the launcher gave this process (``RANK``; 0 in a plain process). Before the process group
    exists this is the only source; afterwards :func:`megatron.mpu.world_rank` reads the group (and falls back to
    this)."""
    return env_int(os.environ if env is None else env, "RANK", 0, MAX_WORLD_SIZE - 1, 0)


def launched_local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's index among the ranks on its host (``LOCAL_RANK``; 0 in a plain process)."""
    return env_int(os.environ if env is None else env, "LOCAL_RANK", 0, MAX_WORLD_SIZE - 1, 0)


def launched_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many ranks the launcher started (``WORLD_SIZE``; 1 in a plain process)."""
    return world_size(os.environ if env is None else env)
