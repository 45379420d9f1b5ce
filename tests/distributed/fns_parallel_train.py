"""``pretrain()`` runs on spawned ranks that also report DeepSpeed's activation-checkpointing state afterwards."""

from __future__ import annotations

from typing import Any

from tests.distributed.fns_train import run_pretrain


def checkpointing_state() -> dict[str, Any]:
    """DeepSpeed's process-global activation-checkpointing settings."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    return {
        "partition_activations": ds_ckpt.PARTITION_ACTIVATIONS,
        "contiguous_checkpointing": ds_ckpt.CONTIGUOUS_CHECKPOINTING,
        "checkpoint_in_cpu": ds_ckpt.CPU_CHECKPOINT,
        "synchronize_each_layer": ds_ckpt.SYNCHRONIZE,
        "num_checkpoints": ds_ckpt.num_layers,
    }


def run_pretrain_with_checkpointing_state(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run_pretrain`` for each config in turn, each result with the checkpointing state it left behind."""
    results = []
    for config in configs:
        result = run_pretrain(config)
        result["checkpointing"] = checkpointing_state()
        results.append(result)
    return results
