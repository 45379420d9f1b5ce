"""THE table of GPT-NeoX keys neox-forge accepts and ignores, each with the reason; a non-default value is warned about.

Every config key is either read by the code, refused when set (``unsupported.py``), or listed here
(``tests/unit/test_config_keys_consumed.py`` enforces it).
"""

from __future__ import annotations

from typing import Any

_FP16_BLOCK = "DeepSpeed reads the loss-scaling settings from the fp16 block (fp16.{}); set it there"
_RUNTIME = "GPT-NeoX bookkeeping set while running; neox-forge decides from the data keys"

# key -> why it has no effect.
IGNORED_KEYS: dict[str, str] = {
    "hysteresis": _FP16_BLOCK.format("hysteresis"),
    "loss_scale_window": _FP16_BLOCK.format("loss_scale_window"),
    "min_scale": _FP16_BLOCK.format("min_loss_scale"),
    "use_cpu_initialization": "weights are always initialised in full on the CPU and then sharded (layout-invariant)",
    "deepspeed_activation_checkpointing": "deprecated in GPT-NeoX; activation checkpointing always uses DeepSpeed's",
    "detect_nvlink_pairs": "DeeperSpeed-only device remapping; DeepSpeed has no such option",
    "gradient_noise_scale_n_batches": "gradient-noise-scale logging is not implemented (log_gradient_noise_scale)",
    "gradient_noise_scale_cpu_offload": "gradient-noise-scale logging is not implemented (log_gradient_noise_scale)",
    "short_seq_prob": "unused by GPT training in GPT-NeoX as well",
    "lazy_mpu_init": "external distributed managers are not supported; neox-forge initialises torch.distributed itself",
    "deepscale": "deprecated DeepSpeed flag with no effect",
    "deepscale_config": "deprecated DeepSpeed flag with no effect",
    "do_train": _RUNTIME,
    "do_valid": _RUNTIME,
    "do_test": _RUNTIME,
}


def ignored_warnings(values: dict[str, Any], defaults: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """One ``'<key>=<value> (set in <file>) is ignored: <reason>'`` line per listed key set to a non-default value."""
    return [
        f"{key}={values[key]!r} (set in {origins.get(key, 'the configuration')}) is ignored: {reason}"
        for key, reason in IGNORED_KEYS.items()
        if key in values and values[key] != defaults.get(key)
    ]
