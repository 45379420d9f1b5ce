"""Process start-up and tear-down for torch.distributed, on CPU (gloo) and CUDA (nccl) alike.

Only this module and ``megatron.mpu`` talk to ``torch.distributed`` directly.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    """True when ranks run on the CPU (no CUDA device, or ``DS_ACCELERATOR=cpu``)."""
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def default_backend() -> str:
    return "gloo" if on_cpu() else "nccl"


def discover_env_from_scheduler() -> None:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE from SLURM or Open MPI variables when a launcher did not set them."""
    if "RANK" in os.environ:
        return
    env = os.environ
    if "SLURM_PROCID" in env:
        env["RANK"], env["LOCAL_RANK"] = env["SLURM_PROCID"], env.get("SLURM_LOCALID", "0")
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    elif "OMPI_COMM_WORLD_RANK" in env:
        env["RANK"], env["LOCAL_RANK"] = env["OMPI_COMM_WORLD_RANK"], env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
    elif "MV2_COMM_WORLD_RANK" in env:
        env["RANK"], env["LOCAL_RANK"] = env["MV2_COMM_WORLD_RANK"], env.get("MV2_COMM_WORLD_LOCAL_RANK", "0")
        env["WORLD_SIZE"] = env["MV2_COMM_WORLD_SIZE"]


def init_distributed(backend: str | None = None) -> None:
    """Initialise the default process group through DeepSpeed (idempotent).

    On CPU, DeepSpeed would JIT-compile its shared-memory all-reduce op (~70 s) at every start although
    training never uses it, so that build is skipped.
    """
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    discover_env_from_scheduler()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if on_cpu():
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend=backend or default_backend(), auto_mpi_discovery=False)


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
