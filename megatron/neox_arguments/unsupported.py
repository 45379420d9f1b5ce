"""THE table of GPT-NeoX features neox-forge accepts as keys but does not implement yet.

A key listed here may appear in a config with its default value; any other value is refused with
"not supported yet: <key>". Shrink this table as features land.
"""

from __future__ import annotations

import importlib.util
from typing import Any

TRANSFORMER_ENGINE = "Transformer Engine"
# key -> feature. A non-default value of the key is refused.
UNSUPPORTED_KEYS: dict[str, str] = {
    **{
        k: TRANSFORMER_ENGINE
        for k in (
            "te_columnparallel",
            "te_rowparallel",
            "te_layernorm_mlp",
            "te_mha",
            "te_fp8_format",
            "te_fp8_wgrad",
            "te_fp8_amax_history_len",
            "te_fp8_amax_compute_algo",
            "te_fp8_margin",
            "te_fp8_mha",
        )
    },
    **{
        k: "ADLR auto-resume (an NVIDIA-internal cluster service; use `load: auto` with SLURM requeue)"
        for k in ("adlr_autoresume", "adlr_autoresume_interval")
    },
    # Layout knobs only `deepy.py --plan` models (megatron/planner/knobs.py; the planner reads them before this check)
    "recompute_granularity": "selective activation recomputation; `deepy.py --plan` models it",
    "num_layers_per_virtual_pipeline_stage": "the interleaved pipeline schedule; `deepy.py --plan` models it",
    "context_parallel_size": "context parallelism; `deepy.py --plan` models it",
    # DeepSpeed 0.19 removed these features and rejects their config keys
    "sparse_gradients": "sparse embedding gradients (removed from DeepSpeed)",
    "amp": "Apex AMP (removed from DeepSpeed; use fp16 or bf16)",
    "compression_training": "DeepSpeed compression (removed from DeepSpeed)",
    "elasticity": "DeepSpeed elastic training (removed from DeepSpeed)",
    "sparse_attention": "DeepSpeed sparse attention (removed from DeepSpeed)",
}

_FP16_BLOCK = "DeepSpeed reads the loss-scaling settings from the fp16 block (fp16.{}); set it there"
_RUNTIME = "GPT-NeoX bookkeeping set while running; neox-forge decides from the data keys"

# key -> why it changes nothing here. A non-default value is accepted and warned about once, at config time.
IGNORED_KEYS: dict[str, str] = {
    "fused_kernels_build_path": "neox-forge builds no fused CUDA kernels (its fusions are PyTorch code)",
    "hysteresis": _FP16_BLOCK.format("hysteresis"),
    "loss_scale_window": _FP16_BLOCK.format("loss_scale_window"),
    "min_scale": _FP16_BLOCK.format("min_loss_scale"),
    "use_cpu_initialization": "weights are always initialised in full on the CPU and then sharded (layout-invariant)",
    "deepspeed_activation_checkpointing": "deprecated in GPT-NeoX; activation checkpointing always uses DeepSpeed's",
    "detect_nvlink_pairs": "DeeperSpeed-only device remapping; DeepSpeed has no such option",
    "no_ssh_check": "deepy never runs a passwordless-ssh check (pdsh reports unreachable hosts itself)",
    "short_seq_prob": "unused by GPT training in GPT-NeoX as well",
    "lazy_mpu_init": "external distributed managers are not supported; neox-forge initialises torch.distributed itself",
    "deepscale": "deprecated DeepSpeed flag with no effect",
    "deepscale_config": "deprecated DeepSpeed flag with no effect",
    "do_train": _RUNTIME,
    "do_valid": _RUNTIME,
    "do_test": _RUNTIME,
    "scheduler": "the learning rate follows lr_decay_style, warmup and min_lr; GPT-NeoX passes this block to "
    "DeepSpeed with its own scheduler, which DeepSpeed prefers, so it is ignored there too",
    "comet_experiment": "GPT-NeoX's handle of the Comet experiment it starts while running; neox-forge starts it "
    "from use_comet and the other comet_* keys",
    "curriculum_seqlen": "GPT-NeoX's running sequence length of curriculum learning, which curriculum_learning's "
    "schedule sets each iteration",
}

# fp16's loss-scaling keys, which GPT-NeoX configs also write into the bf16 block (rwkv/170M.yml): bf16 training has
# no loss scaling (DeeperSpeed ignores them there, DeepSpeed refuses them). Dropped from the bf16 block DeepSpeed gets.
BF16_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")

RWKV_KEYS = ("dim_att", "head_size", "ffn_dim")  # warned about as ignored without rwkv layers

# key -> {value: feature}: values of otherwise supported keys that are refused.
UNSUPPORTED_VALUES: dict[str, dict[Any, str]] = {
    "norm": {"te_rmsnorm": TRANSFORMER_ENGINE, "te_layernorm": TRANSFORMER_ENGINE},
    "attention_config": {},
}


def transformer_engine_missing(on_cpu: bool) -> str:
    """What this machine lacks for Transformer Engine: a CUDA GPU, the ``transformer_engine`` package, and (where it
    has both) neox-forge's Transformer Engine layers, which do not exist yet."""
    missing = ["no CUDA GPU"] if on_cpu else []
    if importlib.util.find_spec("transformer_engine") is None:  # found without importing it
        missing.append("transformer_engine not installed")
    return f"needs a CUDA GPU and the transformer_engine package; here: {', '.join(missing or ['neox-forge has no Transformer Engine layers yet'])}"


def unsupported_problems(
    values: dict[str, Any], defaults: dict[str, Any], origins: dict[str, str], on_cpu: bool = True
) -> list[str]:
    """One 'not supported yet: <key>=<value>, ... (<feature>; set in <file>)' line per feature in use; Transformer
    Engine's line names what this machine lacks (``on_cpu``: no CUDA device).

    ``attention_config`` must already be expanded to one type per layer.
    """
    found: dict[str, list[str]] = {}  # feature -> ["key=value", ...]
    files: dict[str, set[str]] = {}
    for key, feature in UNSUPPORTED_KEYS.items():
        if values.get(key) != defaults.get(key):
            found.setdefault(feature, []).append(f"{key}={values[key]!r}")
            files.setdefault(feature, set()).add(origins.get(key, "the configuration"))
    for key, refused in UNSUPPORTED_VALUES.items():
        value = values.get(key)
        items = value if isinstance(value, list) else [value]
        for hit in sorted({x for x in items if isinstance(x, str) and x in refused}):
            found.setdefault(refused[hit], []).append(f"{key}={hit}")
            files.setdefault(refused[hit], set()).add(origins.get(key, "the configuration"))
    why = {TRANSFORMER_ENGINE: f"{TRANSFORMER_ENGINE} {transformer_engine_missing(on_cpu)}"}
    return [
        f"not supported yet: {', '.join(items)} ({why.get(feature, feature)}; set in {', '.join(sorted(files[feature]))})"
        for feature, items in found.items()
    ]


def ignored_warnings(
    values: dict[str, Any], defaults: dict[str, Any], origins: dict[str, str] | None = None
) -> list[str]:
    """One '<key>=<value> is ignored: <why> (set in <file>)' line per key of ``IGNORED_KEYS`` set to something other
    than its default."""
    origins = origins or {}
    out = [
        f"{key}={values[key]!r} is ignored: {why} (set in {origins.get(key, 'the configuration')})"
        for key, why in IGNORED_KEYS.items()
        if values.get(key) != defaults.get(key)
    ]
    if "rwkv" not in (values.get("attention_config") or []):
        out += [
            f"{key}={values[key]!r} is ignored: it sizes RWKV layers and attention_config has none "
            f"(set in {origins.get(key, 'the configuration')})"
            for key in RWKV_KEYS
            if values.get(key) is not None
        ]
    if values.get("autotuning") is not None and values.get("autotuning_run") is None:
        out.append(
            "autotuning is ignored: DeepSpeed's autotuner reads it under deepy.py --autotuning tune|run; this launch "
            f"trains without it (set in {origins.get('autotuning', 'the configuration')})"
        )
    bf16 = values.get("bf16")
    scaling = [k for k in BF16_LOSS_SCALING if isinstance(bf16, dict) and k in bf16]
    if scaling:
        out.append(
            f"bf16.{', bf16.'.join(scaling)} ignored: bf16 training uses no loss scaling "
            f"(set in {origins.get('bf16', 'the configuration')})"
        )
    return out
