"""Numbers anywhere in a config value, including inside dict-valued keys (``optimizer.params``, ``zero_optimization``,
``scheduler.params``, ``deepspeed_extra_args``, ...), which the per-key ranges of ``ranges.py`` do not reach.

* ``huge_int_problems``: integers beyond 64 bits, at any depth. They are never valid (no tensor, counter or
  DeepSpeed setting takes one) and must be refused before anything prints them: Python cannot even ``repr`` an
  integer of more than 4300 digits.
* ``nested_problems``: inside dict-valued keys every float must be finite, and the known nested settings must lie in
  their range (``NESTED_RANGES``, matched on the end of the key path, so ``optimizer.params.lr`` also covers
  ``deepspeed_extra_args.optimizer.params.lr``; a top-level key's range also applies to it inside
  ``deepspeed_extra_args``, which DeepSpeed reads as top-level settings).

Messages name the dotted key path and the file: ``optimizer.params.lr=inf must be a finite number (set in a.yml)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from megatron.neox_arguments.ranges import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, RANGES, Range

INT64_MAX = 2**63 - 1

# Nested settings with a known valid range, keyed by the end of their path (list indices dropped).
NESTED_RANGES: dict[tuple[str, ...], Range] = {
    ("optimizer", "params", "lr"): NON_NEGATIVE,
    ("optimizer", "params", "betas"): Range(0, 1, hi_open=True),
    ("optimizer", "params", "eps"): NON_NEGATIVE,
    ("optimizer", "params", "momentum"): NON_NEGATIVE,
    ("optimizer", "params", "weight_decay"): NON_NEGATIVE,
    ("scheduler", "params", "warmup_min_lr"): NON_NEGATIVE,
    ("scheduler", "params", "warmup_max_lr"): NON_NEGATIVE,
    ("scheduler", "params", "warmup_num_steps"): NON_NEGATIVE,
    ("scheduler", "params", "total_num_steps"): AT_LEAST_ONE,
    ("zero_optimization", "reduce_bucket_size"): AT_LEAST_ONE,
    ("zero_optimization", "allgather_bucket_size"): AT_LEAST_ONE,
    ("zero_optimization", "stage3_prefetch_bucket_size"): NON_NEGATIVE,
    ("zero_optimization", "stage3_param_persistence_threshold"): NON_NEGATIVE,
    ("zero_optimization", "stage3_max_live_parameters"): NON_NEGATIVE,
    ("zero_optimization", "stage3_max_reuse_distance"): NON_NEGATIVE,
    ("zero_optimization", "sub_group_size"): AT_LEAST_ONE,
    ("fp16", "loss_scale"): NON_NEGATIVE,
    ("fp16", "initial_scale_power"): NON_NEGATIVE,
    ("fp16", "loss_scale_window"): AT_LEAST_ONE,
    ("fp16", "hysteresis"): AT_LEAST_ONE,
    ("fp16", "min_loss_scale"): POSITIVE,
}


def describe_number(x: Any) -> str:
    """``repr`` of a number, or ``an integer of N digits`` for one too long to print."""
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > INT64_MAX:
        digits = max(1, int(abs(x).bit_length() * math.log10(2)))
        return f"<an integer of about {digits} digits>"
    return repr(x)


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr`` of a value for a one-line message: long strings and containers cut, huge integers described."""
    if isinstance(value, int) and not isinstance(value, bool):
        return describe_number(value)
    if isinstance(value, str) and len(value) > limit:
        return f"{value[: limit // 2]!r}... ({len(value)} characters)"
    text = repr(value) if not isinstance(value, (dict, list, tuple)) or len(value) < 1000 else ""
    return text if text and len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def _numbers(value: Any) -> Iterator[tuple[tuple[str | int, ...], int | float]]:
    """(path below the key, number) for every int/float inside ``value`` (bools are not numbers)."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    seen: set[int] = set()
    while stack:
        path, v = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield path, v
        elif isinstance(v, (dict, list, tuple)):
            if id(v) in seen:  # a shared or recursive container (from_dict with Python objects): once is enough
                continue
            seen.add(id(v))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend(((*path, k), child) for k, child in reversed(list(items)))


def _dotted(key: str, path: tuple[str | int, ...]) -> str:
    out = key
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _suffix(where: str | None) -> str:
    return f" (set in {where})" if where else ""


def huge_int_problems(values: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """Integers beyond 64 bits anywhere in ``values``."""
    out = []
    for key, value in values.items():
        for path, x in _numbers(value):
            if isinstance(x, int) and abs(x) > INT64_MAX:
                out.append(
                    f"{_dotted(key, path)}={describe_number(x)} is too large: integers must fit in 64 bits "
                    f"(at most {INT64_MAX}){_suffix(origins.get(key))}"
                )
    return out


def _nested_range(key: str, path: tuple[str | int, ...]) -> Range | None:
    names = tuple(str(p) for p in (key, *path) if not isinstance(p, int))
    for n in range(len(names), 1, -1):
        rng = NESTED_RANGES.get(names[-n:])
        if rng is not None:
            return rng
    if key == "deepspeed_extra_args" and len(names) == 2:
        return RANGES.get(names[1])
    return None


def nested_problems(values: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """Non-finite floats and out-of-range known settings inside dict-valued keys."""
    out = []
    for key, value in values.items():
        if not isinstance(value, dict):
            continue  # top-level numbers and lists: their key's range (ranges.py) or syntax check covers them
        for path, x in _numbers(value):
            name = _dotted(key, path)
            if isinstance(x, float) and not math.isfinite(x):
                out.append(f"{name}={x!r} must be a finite number{_suffix(origins.get(key))}")
                continue
            rng = _nested_range(key, path)
            if rng is not None and not rng.contains(float(x)):
                out.append(f"{name}={x!r} must be {rng.describe()}{_suffix(origins.get(key))}")
    return out
