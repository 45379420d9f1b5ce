"""Types and ranges of the settings inside dict-valued keys: ``optimizer.params``, ``zero_optimization`` (with its
``offload_*`` blocks), ``fp16``/``bf16``, ``activation_checkpointing``, ``scheduler.params``, and the same blocks
inside ``deepspeed_extra_args`` (which DeepSpeed reads as top-level settings, so a top-level key's range from
``ranges.py`` applies to it there too).

``NESTED`` holds one rule per setting, keyed by the end of its key path (list indices dropped), so
``zero_optimization.stage`` also covers ``deepspeed_extra_args.zero_optimization.stage``. Integers are integers
(an integral float such as ``5.0e8`` is accepted: DeepSpeed's pydantic config converts it; a string such as
``'5e8'`` is not), booleans are booleans, and every float anywhere must be finite. ``OPTIMIZER_PARAMS`` lists the
constructor arguments each ``optimizer.type`` takes (tests/unit/test_config_nested_checks.py compares it with the
real constructors), so an unknown one is refused before a rank fails on it.

Messages name the dotted key path and the file: ``zero_optimization.reduce_bucket_size='5e8' must be an integer
>= 1 (set in a.yml)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from megatron.neox_arguments.number_checks import short_repr, walk
from megatron.neox_arguments.ranges import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, RANGES, Range

# (dotted name, value) -> problems, each "name=value must ..." without the file
Rule = Callable[[str, Any], list[str]]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(name: str, x: float) -> list[str]:
    return [] if math.isfinite(x) else [f"{name}={x!r} must be a finite number"]


def number(rng: Range | None = None, *, numeric_string: bool = False) -> Rule:
    """A finite int or float in ``rng``. ``numeric_string``: also a string that is a number (``lr: '6e-4'``, as
    GPT-NeoX's builders take it; ``OptimizerConfig.params`` converts it)."""
    what = "a finite number" + (f" {rng.describe()}" if rng else "")

    def check(name: str, x: Any) -> list[str]:
        if numeric_string and isinstance(x, str):
            try:
                value = float(x)
            except ValueError:
                return [f"{name}={short_repr(x)} must be {what}"]
            return (
                []
                if math.isfinite(value) and (rng is None or rng.contains(value))
                else [f"{name}={short_repr(x)} must be {what}"]
            )
        if not _is_number(x):
            return [f"{name}={short_repr(x)} must be {what}"]
        if isinstance(x, float) and not math.isfinite(x):
            return _finite(name, x)
        return [] if rng is None or rng.contains(float(x)) else [f"{name}={x!r} must be {rng.describe()}"]

    return check


def integer(rng: Range | None = None, *, optional: bool = False) -> Rule:
    """An integer in ``rng`` (an integral float is accepted, as DeepSpeed converts it). ``optional``: None too."""
    what = "an integer" + (f" {rng.describe()}" if rng else "")

    def check(name: str, x: Any) -> list[str]:
        if optional and x is None:
            return []
        if isinstance(x, float) and not math.isfinite(x):
            return _finite(name, x)
        if not _is_number(x) or (isinstance(x, float) and not x.is_integer()):
            return [f"{name}={short_repr(x)} must be {what}"]
        return [] if rng is None or rng.contains(float(x)) else [f"{name}={x!r} must be {what}"]

    return check


def boolean(*, optional: bool = False) -> Rule:
    """true or false (not the string 'true', not 0/1). ``optional``: None too."""

    def check(name: str, x: Any) -> list[str]:
        ok = isinstance(x, bool) or (optional and x is None)
        return [] if ok else [f"{name}={short_repr(x)} must be true or false"]

    return check


def text(*choices: str, optional: bool = False) -> Rule:
    """A string (one of ``choices`` when given). ``optional``: None too."""

    def check(name: str, x: Any) -> list[str]:
        if (optional and x is None) or (isinstance(x, str) and (not choices or x in choices)):
            return []
        valid = f"one of {', '.join(map(repr, choices))}" if choices else "a string"
        return [f"{name}={short_repr(x)} must be {valid}"]

    return check


def pair(rng: Range) -> Rule:
    """Two numbers, each in ``rng`` (Adam's ``betas``)."""
    each = number(rng)

    def check(name: str, x: Any) -> list[str]:
        if not isinstance(x, (list, tuple)) or len(x) != 2:
            return [f"{name}={short_repr(x)} must be two numbers {rng.describe()}, e.g. [0.9, 0.95]"]
        return [p for i, item in enumerate(x) for p in each(f"{name}[{i}]", item)]

    return check


def _zero_stage(name: str, x: Any) -> list[str]:
    # a list (or 'all') is DeepSpeed autotuning's search space
    stages = x if isinstance(x, list) else [x]
    if x == "all" or (stages and all(type(s) is int and 0 <= s <= 3 for s in stages)):
        return []
    return [f"{name}={short_repr(x)} must be 0, 1, 2 or 3"]


BETA = Range(0, 1, hi_open=True)
FLAG = boolean()
COUNT = integer(NON_NEGATIVE)

# optimizer.params: every constructor argument of a registered optimizer (see OPTIMIZER_PARAMS)
_PARAM_NUMBERS: dict[str, Range] = {
    "lr": NON_NEGATIVE,
    "beta": BETA,
    "eps": POSITIVE,
    "weight_decay": NON_NEGATIVE,  # validate.py: it belongs at top level
    "momentum": NON_NEGATIVE,
    "dampening": NON_NEGATIVE,
}
NUMERIC_PARAMS = frozenset(_PARAM_NUMBERS)
"""The numeric ``optimizer.params``, which may be strings that are numbers (converted by ``OptimizerConfig``)."""
_PARAMS: dict[str, Rule] = {
    **{name: number(rng, numeric_string=True) for name, rng in _PARAM_NUMBERS.items()},
    "betas": pair(BETA),
    "freeze_step": COUNT,
    "comm_backend_name": text("nccl", "mpi", "compressed", "hccl"),
    **dict.fromkeys(("amsgrad", "nesterov", "maximize", "capturable", "differentiable", "bias_correction"), FLAG),
    **dict.fromkeys(("fused", "torch_adam", "adam_w_mode", "adamw_mode", "fp32_optimizer_states"), FLAG),
    "cuda_aware": FLAG,
    "foreach": boolean(optional=True),
}

_ADAM_BASE = ("lr", "betas", "eps", "weight_decay", "amsgrad")
# optimizer.type -> the optimizer.params it takes (megatron/training/optimizer_registry.py's factories)
OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    # torch.optim.AdamW, plus fused/torch_adam/adam_w_mode (which select DeepSpeed's FusedAdam)
    "adam": (*_ADAM_BASE, "maximize", "foreach", "capturable", "differentiable", "fused", "torch_adam", "adam_w_mode"),
    "cpu_adam": (*_ADAM_BASE, "bias_correction", "adamw_mode", "fp32_optimizer_states"),  # DeepSpeedCPUAdam
    "cpu_torch_adam": (*_ADAM_BASE, "bias_correction", "adamw_mode", "fp32_optimizer_states"),
    # DeepSpeed builds it from its config (docs: deepspeed.ai/docs/config-json, OneBitAdam)
    "onebitadam": ("lr", "betas", "eps", "weight_decay", "freeze_step", "cuda_aware", "comm_backend_name"),
    "sgd": (
        "lr",
        "momentum",
        "dampening",
        "weight_decay",
        "nesterov",
        "maximize",
        "foreach",
        "differentiable",
        "fused",
    ),
    "sm3": ("lr", "momentum", "beta", "eps", "weight_decay"),
    "madgrad_wd": ("lr", "momentum", "weight_decay", "eps"),
    "lion": ("lr", "betas", "weight_decay"),
}

_OFFLOAD: dict[str, Rule] = {  # offload_param and offload_optimizer
    "device": text("none", "cpu", "nvme"),
    "nvme_path": text(optional=True),
    "buffer_count": COUNT,
    "pin_memory": FLAG,
}
_OFFLOAD_PARAM: dict[str, Rule] = {**_OFFLOAD, "buffer_size": COUNT, "max_in_cpu": COUNT}
_OFFLOAD_OPTIMIZER: dict[str, Rule] = {
    **_OFFLOAD,
    **dict.fromkeys(("pipeline_read", "pipeline_write", "fast_init"), FLAG),
    "ratio": number(FRACTION),
}

_PRECISION: dict[str, Rule] = {  # DeepSpeed's fp16 block; GPT-NeoX writes the same keys into bf16
    "enabled": FLAG,
    "auto_cast": FLAG,
    "loss_scale": number(NON_NEGATIVE),  # 0: dynamic loss scaling
    "initial_scale_power": integer(NON_NEGATIVE),
    "loss_scale_window": integer(AT_LEAST_ONE),
    "hysteresis": integer(AT_LEAST_ONE),
    "consecutive_hysteresis": FLAG,
    "min_loss_scale": integer(AT_LEAST_ONE),
    "fp16_master_weights_and_grads": FLAG,
    "fp16": FLAG,  # DeeperSpeed's spelling (GPT-NeoX configs), dropped before DeepSpeed sees it
    "type": text(),  # DeeperSpeed's, as above
}

_BF16: dict[str, Rule] = {
    **_PRECISION,
    **dict.fromkeys(("immediate_grad_update", "check_grad_overflow"), FLAG),
    **dict.fromkeys(("bf16_master_weights_and_grads", "bf16_optimizer_states"), FLAG),
}

_ZERO: dict[str, Rule] = {
    "stage": _zero_stage,
    "reduce_bucket_size": integer(AT_LEAST_ONE),
    "allgather_bucket_size": integer(AT_LEAST_ONE),
    "sub_group_size": integer(AT_LEAST_ONE),
    "zero_hpz_partition_size": integer(AT_LEAST_ONE),
    **dict.fromkeys(
        (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ),
        COUNT,
    ),
    **dict.fromkeys(
        ("overlap_comm", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"), boolean(optional=True)
    ),
    **dict.fromkeys(
        (
            "contiguous_gradients",
            "reduce_scatter",
            "allgather_partitions",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "use_multi_rank_bucket_allreduce",
            "compute_grad_norm",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "ignore_unused_parameters",
            "legacy_stage1",
            "round_robin_gradients",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
        ),
        FLAG,
    ),
}

_ACTIVATION_CHECKPOINTING: dict[str, Rule] = {
    **dict.fromkeys(("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing"), FLAG),
    **dict.fromkeys(("synchronize_checkpoint_boundary", "profile"), FLAG),
    "number_checkpoints": integer(AT_LEAST_ONE, optional=True),
}

_SCHEDULER: dict[str, Rule] = {
    "warmup_min_lr": number(NON_NEGATIVE, numeric_string=True),
    "warmup_max_lr": number(NON_NEGATIVE, numeric_string=True),
    "warmup_num_steps": integer(NON_NEGATIVE),
    "total_num_steps": integer(AT_LEAST_ONE),
}


def _under(prefix: tuple[str, ...], rules: dict[str, Rule]) -> dict[tuple[str, ...], Rule]:
    return {(*prefix, name): rule for name, rule in rules.items()}


# Nested settings by the end of their key path.
NESTED: dict[tuple[str, ...], Rule] = {
    **_under(("optimizer", "params"), _PARAMS),
    **_under(("scheduler", "params"), _SCHEDULER),
    **_under(("zero_optimization",), _ZERO),
    **_under(("zero_optimization", "offload_param"), _OFFLOAD_PARAM),
    **_under(("zero_optimization", "offload_optimizer"), _OFFLOAD_OPTIMIZER),
    **_under(("fp16",), _PRECISION),
    **_under(("bf16",), _BF16),
    **_under(("activation_checkpointing",), _ACTIVATION_CHECKPOINTING),
    ("amp", "enabled"): FLAG,
    ("flops_profiler", "enabled"): FLAG,
}


# Blocks DeepSpeed reads as mappings: a scalar there (``offload_optimizer: true``) would fail inside DeepSpeed.
MAPPINGS = {("zero_optimization", "offload_param"), ("zero_optimization", "offload_optimizer")}


def _rule(names: tuple[str, ...]) -> Rule | None:
    for n in range(len(names), 1, -1):
        rule = NESTED.get(names[-n:])
        if rule is not None:
            return rule
    if names[0] == "deepspeed_extra_args" and len(names) == 2 and names[1] in RANGES:
        return number(RANGES[names[1]])
    return None


def _name(part: Any) -> str:
    """A key as written when it is short and printable, else its shortened ``repr``."""
    return part if isinstance(part, str) and part.isprintable() and len(part) <= 60 else short_repr(part, 60)


def _dotted(key: str, path: tuple[str | int, ...]) -> str:
    out = key
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{_name(part)}"
    return out


def _leaf_problems(key: str, value: Any) -> Iterator[str]:
    """Rule violations of the settings under ``key``, and non-finite floats anywhere else below it."""

    def rule_at(path: tuple[str | int, ...]) -> Rule | None:
        names = tuple(str(p) for p in (key, *path) if not isinstance(p, int))
        return _rule(names) if path and not isinstance(path[-1], int) else None

    for path, v in walk(value, enter=lambda path, _: rule_at(path) is None):  # a rule checks its whole value
        if (key, *path) in MAPPINGS and v is not None and not isinstance(v, dict):
            yield f"{_dotted(key, path)}: {short_repr(v, 60)} is not a block of settings; write e.g. {{device: cpu}}"
        rule = rule_at(path)
        if rule is not None:
            yield from rule(_dotted(key, path), v)
        elif isinstance(v, float):
            yield from _finite(_dotted(key, path), v)


def _unknown_params(optimizer: dict[str, Any]) -> list[str]:
    kind, params = optimizer.get("type"), optimizer.get("params")
    known = OPTIMIZER_PARAMS.get(kind.lower()) if isinstance(kind, str) else None
    if known is None or not isinstance(params, dict):
        return []  # an unknown type or malformed block: value_checks.py / derive.py say so
    return [
        f"optimizer.params.{_name(name)}: not a parameter "
        f"of optimizer type {kind!r}; it takes {', '.join(sorted(known))}"
        for name in params
        if name not in known
    ]


def nested_problems(values: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """Every wrong type, out-of-range or non-finite setting inside the dict-valued keys, and unknown optimizer
    params, each naming its key path and the file that set it."""
    out = []
    for key, value in values.items():
        if not isinstance(value, dict):
            continue  # top-level numbers and lists: their key's range (ranges.py) or syntax check covers them
        where = origins.get(key)
        found = list(_leaf_problems(key, value))
        if key == "optimizer":
            found += _unknown_params(value)
        out += [p + (f" (set in {where})" if where else "") for p in found]
    return out
