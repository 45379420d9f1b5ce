"""What this CPU multiplies natively: bf16 / fp16 matrix products through oneDNN, or an emulated scalar loop.

Read by training (``training/cpu_precision.py``: warn or refuse before a run crawls) and by generation
(``inference_precision`` on the CPU) alike, so it sits below both.
"""

from __future__ import annotations

import torch

CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpuinfo_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native(dtype: str) -> bool:
    """Whether this CPU multiplies ``dtype`` ("bf16" or "fp16") matrices natively (oneDNN), not emulated."""
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return bool(cpuinfo_flags() & set(CPU_FLAGS[dtype]))
