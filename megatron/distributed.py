"""Process start-up and tear-down for torch.distributed, on CPU (gloo) and CUDA (nccl) alike.

Only this module and ``megatron.mpu`` talk to ``torch.distributed`` directly.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

import torch

from megatron.cluster.env_values import LaunchEnvError, master_port
from megatron.cluster.worker_env import discover_rank_env, launched_local_rank, launched_rank

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT_MINUTES = 10.0  # distributed_timeout_minutes' default (Megatron-LM's, and NCCL's in torch)


def on_cpu() -> bool:
    """True when ranks run on the CPU (no CUDA device, or ``DS_ACCELERATOR=cpu``)."""
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def default_backend() -> str:
    return "gloo" if on_cpu() else "nccl"


def init_distributed(backend: str | None = None, *, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """Initialise the default process group through DeepSpeed (idempotent).

    ``timeout_minutes`` (``distributed_timeout_minutes``) bounds every collective: a rank whose peer died or became
    unreachable fails after that long instead of waiting forever (torch's default is 30 minutes for gloo).

    On CPU, DeepSpeed would JIT-compile its shared-memory all-reduce op (~70 s) at every start although
    training never uses it, so that build is skipped.
    """
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return

    discover_rank_env(os.environ)  # torchrun / DeepSpeed / srun / mpirun variables -> RANK, WORLD_SIZE, MASTER_*
    env = os.environ
    # one line per rank: which host each rank landed on is the first question when a multi-node launch misbehaves
    logger.info(
        "rank %s (local rank %s of %s) on host %s", env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
        socket.gethostname(),
    )  # fmt: skip
    if on_cpu():
        # the one write into DeepSpeed outside training/deepspeed_adapter.py (tests/unit/test_no_deepspeed_patches.py).
        # Not `import deepspeed.comm.torch as m`: that binds deepspeed.comm's attribute `torch`, the torch library
        # itself (tests/unit/test_distributed_init.py)
        ds_torch_comm: Any = importlib.import_module("deepspeed.comm.torch")
        ds_torch_comm.build_shm_op = lambda: None
    else:
        torch.cuda.set_device(launched_local_rank() % torch.cuda.device_count())
    try:
        deepspeed.init_distributed(
            dist_backend=backend or default_backend(),
            auto_mpi_discovery=False,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    except torch.distributed.DistNetworkError as e:
        raise store_error(e, env) from None
    _record_hosts(timeout_minutes)


def store_error(error: Exception, env: Mapping[str, str]) -> Exception:
    """The rendezvous store's failure to listen on ``MASTER_PORT`` (rank 0 creates it there) as one line; any
    other error as it is. The port may be free when deepy.py checks it and taken when the store binds it."""
    text = str(error)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return error
    return LaunchEnvError(
        f"MASTER_PORT {env.get('MASTER_PORT')} is already in use on this machine (rank 0 cannot listen there for "
        f"the ranks meeting at MASTER_ADDR {env.get('MASTER_ADDR')}): another run or service holds it; set "
        "MASTER_PORT (master_port with deepy.py) to a free port"
    )


def _record_hosts(timeout_minutes: float) -> None:
    """Every rank's host and address, gathered once, so that a lost peer is later reported by name."""
    from megatron.cluster import peers

    env = os.environ
    addr = peers.local_address(env["MASTER_ADDR"], master_port(env))
    me = peers.RankHost(launched_rank(env), socket.gethostname(), addr)
    table: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(table, me)
    peers.record(table, me, timeout_minutes)


def shutdown_and_exit(code: int = 0) -> None:
    """End a rank without interpreter finalisation.

    gloo's background threads can abort the interpreter at exit (SIGABRT) after collectives; a barrier, an
    explicit ``destroy_process_group`` and ``os._exit`` avoid that race.
    """
    dist = torch.distributed
    try:
        if dist.is_available() and dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
