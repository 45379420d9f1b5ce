"""The collective timeout a run's process group gets (docs/gpt-neox-differences.md, docs/cluster.md)."""

from __future__ import annotations

import sys

from tests.harness import free_port, run_command

# A fresh process: a default config's start-up (start_processes), then the timeout of the default group it made.
SCRIPT = """
import torch, torch.distributed as dist
from megatron.initialize import InitConfig, start_processes
from megatron.neox_arguments import LaunchEnv, NeoXArgs
args = NeoXArgs({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                 "max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 1, "train_iters": 1},
                env=LaunchEnv(world_size=1, on_cpu=True))
start_processes(InitConfig.from_neox_args(args))
group = dist.distributed_c10d._get_default_group()
print("TIMEOUT_S", group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
dist.destroy_process_group()
"""


def test_the_collective_timeout_is_distributed_timeout_minutes() -> None:
    """A default run waits 10 minutes for a missing rank (GPT-NeoX: DeepSpeed's 30, set by DEEPSPEED_TIMEOUT,
    which has no effect here)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(free_port()), "DEEPSPEED_TIMEOUT": "45"}
    result = run_command([sys.executable, "-c", SCRIPT], env=env, timeout=240)
    assert "TIMEOUT_S 600.0" in result.stdout, result.describe()
