"""GPT-NeoX's DeepSpeed-autotuning keys: ``autotuning`` (DeepSpeed's block) and ``autotuning_run`` (``deepy.py
--autotuning tune|run``).

Under ``--autotuning`` deepy starts DeepSpeed's runner with ``--autotuning MODE`` and gives every rank the DeepSpeed
config as ``--deepspeed_config FILE``; DeepSpeed's autotuner then launches its experiments itself, each with its own
DeepSpeed config (base64), from which the ranks take the keys GPT-NeoX lets it tune (:data:`AUTOTUNING_ARGS`).
On CPU deepy tells DeepSpeed's CPU accelerator how many ranks a node runs (``LOCAL_SIZE``; it would count NUMA
nodes), so the autotuner schedules its experiments on the CPU ranks (tests/e2e/test_deepspeed_autotuning.py).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from megatron.neox_arguments.errors import ConfigError

# the keys an autotuning experiment's DeepSpeed config sets for the ranks (GPT-NeoX's list)
AUTOTUNING_ARGS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "autotuning",
)


def autotuning_overrides(deepspeed_config: str) -> dict[str, Any]:
    """The :data:`AUTOTUNING_ARGS` of ``--deepspeed_config`` (a JSON file or base64-encoded JSON, as DeepSpeed's
    autotuner passes it); ConfigError naming the flag when it is neither."""
    try:
        if os.path.isfile(deepspeed_config):
            with open(deepspeed_config, encoding="utf-8") as f:
                config = json.load(f)
        else:
            config = json.loads(base64.urlsafe_b64decode(deepspeed_config).decode("utf-8"))
    except (OSError, ValueError) as e:
        shown = deepspeed_config if len(deepspeed_config) <= 60 else deepspeed_config[:60] + "..."
        raise ConfigError(f"--deepspeed_config {shown}: neither a JSON file nor base64-encoded JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed_config: expected a JSON object, got {type(config).__name__}")
    return {k: config[k] for k in AUTOTUNING_ARGS if k in config}


ZERO_MIRRORS = ("zero_stage", "zero_reduce_scatter", "zero_contiguous_gradients", "zero_reduce_bucket_size",
                "zero_allgather_bucket_size")  # fmt: skip
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def with_experiment(resolved: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """A resolved config (deepy's ``--neox_config``) with an experiment's tuned keys: the values derived from the keys
    it replaces (the ZeRO mirrors, the batch keys it leaves out) are dropped, to be derived again."""
    out = {k: v for k, v in resolved.items() if not ("zero_optimization" in tuned and k in ZERO_MIRRORS)}
    if any(k in tuned for k in BATCH_KEYS):
        out = {k: v for k, v in out.items() if k not in BATCH_KEYS}
    return {**out, **tuned}
