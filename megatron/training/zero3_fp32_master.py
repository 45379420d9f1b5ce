"""fp32 ZeRO-3 without a second fp32 copy of each rank's partition.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` is meant to reuse the parameter
partition as the optimizer's fp32 master partition when it already has the master dtype and lives on the
optimizer's device (its comment: weights already in fp32 need no other copy). It tests
``partition.device == self.device``, where ``self.device`` is the string ``get_accelerator().current_device_name()``
(``'cpu'``, ``'cuda:0'``); a ``torch.device`` never equals a string, so that branch is never taken and fp32
training holds every partition twice (4 extra bytes per parameter and data-parallel rank share).

:func:`share_fp32_zero3_partitions` runs that method with ``self.device`` as a ``torch.device`` for its duration,
so the branch DeepSpeed wrote applies: the optimizer steps the partition in place and DeepSpeed's copy of the
master partition back into the parameter partition after each step copies a tensor onto itself. Nothing else
changes: bf16/fp16 partitions (another dtype) and optimizer offload (its own branch, first) still get their copy.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

logger = logging.getLogger("megatron.train")

_PATCHED = "_neox_forge_shares_fp32_partitions"


def share_fp32_zero3_partitions() -> None:
    """Install the device comparison fix on DeepSpeed's ZeRO-3 optimizer (process-wide, idempotent; a DeepSpeed
    without that method is left as it is, with a debug line)."""
    original = getattr(DeepSpeedZeroOptimizer_Stage3, "_create_fp32_partitions", None)
    if original is None:
        logger.debug("DeepSpeed has no _create_fp32_partitions: fp32 ZeRO-3 partitions left to DeepSpeed")
        return
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def create_fp32_partitions(self: Any) -> None:
        device = self.device
        if isinstance(device, str):
            self.device = torch.device(device)
        try:
            original(self)
        finally:
            self.device = device

    setattr(create_fp32_partitions, _PATCHED, True)
    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_fp32_partitions
