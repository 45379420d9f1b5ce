"""Half precision on the CPU: what this CPU runs natively, a warning when it does not, and the fp16 switch.

PyTorch runs bf16/fp16 matrix products on the CPU through oneDNN only where the CPU has the instructions for them
(AVX-512 BF16 / AMX for bf16, AVX-512 FP16 / AMX-FP16 for fp16). Elsewhere (any AVX2-only CPU) it falls back to a
scalar loop that is 20-50x slower than fp32, so a bf16 config that is right for a GPU cluster crawls on a laptop.
Ranks on the CPU say so once, with the fix, instead of silently running 40x slower.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from megatron.cpu_features import CPU_FLAGS, cpu_has_native
from megatron.distributed import on_cpu
from megatron.neox_arguments.errors import ConfigError
from megatron.training.deepspeed_adapter import allow_fp16_on_cpu

logger = logging.getLogger("megatron.train")

ALLOW_CPU_FP16_ENV = "NEOX_FORGE_ALLOW_CPU_FP16"


def slow_half_precision_warning(ds_config: dict[str, Any]) -> str | None:
    """The warning for a half-precision run on a CPU without native kernels for it, or None."""
    dtype = next((d for d in ("bf16", "fp16") if (ds_config.get(d) or {}).get("enabled")), None)
    if dtype is None or not on_cpu() or cpu_has_native(dtype):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"{dtype} on this CPU ({capability}, no {' / '.join(CPU_FLAGS[dtype])}): PyTorch emulates {dtype} matrix "
        f"products here, about 20-50x slower than fp32. For CPU runs set `{dtype}: {{enabled: false}}` (fp32)."
    )


def apply_cpu_precision(ds_config: dict[str, Any]) -> None:
    """Warn about emulated half precision on the CPU; refuse fp16 on a CPU without native fp16 unless
    ``NEOX_FORGE_ALLOW_CPU_FP16=1``.

    DeepSpeed's CPU accelerator reports fp16 support only where oneDNN has native fp16 kernels (AVX-512 FP16 /
    AMX-FP16) and refuses fp16 configs elsewhere. There the environment variable is the one documented way around
    it (tests use it): it tells DeepSpeed fp16 is supported, for this process only.
    """
    warning = slow_half_precision_warning(ds_config)
    if warning:
        logger.warning(warning)
    if not (ds_config.get("fp16") or {}).get("enabled") or not on_cpu() or cpu_has_native("fp16"):
        return
    if os.environ.get(ALLOW_CPU_FP16_ENV) != "1":
        raise ConfigError(
            f"fp16.enabled: DeepSpeed has no fp16 support on this CPU (no {' / '.join(CPU_FLAGS['fp16'])}); train in "
            f"fp32 (or bf16 on a CPU with native bf16), or set {ALLOW_CPU_FP16_ENV}=1 to run fp16 anyway (emulated, "
            "~20x slower)"
        )
    logger.warning("%s=1: running fp16 on CPU (emulated and slow)", ALLOW_CPU_FP16_ENV)
    allow_fp16_on_cpu()
