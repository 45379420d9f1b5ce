"""``init_distributed`` on a CPU skips DeepSpeed's shared-memory op build (a ~70 s JIT compile at every start that
training never uses, and a hang when another process left its build lock behind). The skip must reach
DeepSpeed's module: ``import deepspeed.comm.torch as m`` binds ``deepspeed.comm``'s attribute ``torch``, which is
the torch library, so a write through it changes nothing (it once did, silently)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, json
import torch
from megatron.distributed import init_distributed
import deepspeed.comm.comm as ds_comm
init_distributed("gloo")
print(json.dumps({
    "shm_comm_op": repr(ds_comm.cdb.shm_comm_op),
    "build_skipped": importlib.import_module("deepspeed.comm.torch").build_shm_op() is None,
    "torch_untouched": not hasattr(torch, "build_shm_op"),
}))
torch.distributed.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cpu_start_skips_deepspeeds_shared_memory_op_build() -> None:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"shm_comm_op": "None", "build_skipped": True, "torch_untouched": True}, result
