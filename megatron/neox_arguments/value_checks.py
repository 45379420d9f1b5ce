"""Checks of single config values before anything is derived: numeric ranges (``ranges.py``) and the syntax of
structured strings, lists and dicts (``SYNTAX`` below). Cross-field rules live in ``validate.py``.

Each syntax check takes the (type-checked) value and returns what is wrong with it, or None.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable
from typing import Any

from megatron.cluster.hostfile import parse_filter
from megatron.errors import DataError
from megatron.neox_arguments.nested_checks import nested_problems
from megatron.neox_arguments.ranges import range_problems
from megatron.neox_arguments.soft_prompt_keys import soft_prompt_problem

Check = Callable[[Any], "str | None"]


def parse_split(split: str) -> list[float]:
    """``"969, 30, 1"`` or ``"98/2/0"`` -> three normalised fractions (missing ones are 0)."""
    sep = "," if "," in split else "/"
    try:
        parts = [float(s) for s in split.split(sep)] if sep in split else [float(split)]
    except ValueError:
        raise DataError(f"split {split!r} must be numbers separated by ',' or '/', e.g. '949,50,1'") from None
    parts = [*parts, 0.0, 0.0, 0.0][:3]
    if not all(0 <= p < math.inf for p in parts) or not 0 < sum(parts) < math.inf:
        raise DataError(f"split {split!r} needs finite non-negative parts with a positive sum (and a finite one)")
    total = sum(parts)
    return [p / total for p in parts]


def check_preemption_keys(signals: list[Any] | None, minutes: float | None) -> list[str]:
    """Problems with ``preemption_signals`` / ``exit_duration_in_mins`` (for the config's rule table too)."""
    out = []
    for name in signals or []:
        if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
            out.append(f"preemption_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1, SIGUSR2)")
        elif name in ("SIGKILL", "SIGSTOP"):
            out.append(f"preemption_signals: {name} cannot be caught")
    if minutes is not None and not minutes > 0:
        out.append(f"exit_duration_in_mins={minutes!r} must be > 0")
    return out


def _strings(value: Any) -> str | None:
    items = [value] if isinstance(value, str) else value
    bad = next((x for x in items if not isinstance(x, str) or not x.strip()), None)
    return None if bad is None else f"entry {bad!r} is not a non-empty string"


def _weights(value: list) -> str | None:
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            return f"entry {x!r} is not a finite number >= 0"
    if not math.isfinite(sum(float(x) for x in value)):  # [1e308, 1e308]: normalising would give [0.0, 0.0]
        return "weights must be finite and their sum must be finite; scale them down (only their ratios matter)"
    return None if any(x > 0 for x in value) or not value else "needs at least one weight > 0"


def _iterations(value: list) -> str | None:
    bad = next((x for x in value if isinstance(x, bool) or not isinstance(x, int) or x < 0), None)
    return None if bad is None else f"entry {bad!r} is not an iteration (an integer >= 0)"


def _split(value: str) -> str | None:
    if len(re.split(r"[,/]", value)) > 3:
        return "has more than three parts (train, valid, test)"
    try:
        parse_split(value)
    except ValueError as e:
        return str(e).replace(f"split {value!r} ", "")
    return None


def _partition(value: str) -> str | None:
    if value in ("parameters", "uniform"):
        return None
    if not value.startswith("type:"):
        return "must be 'parameters', 'uniform' or 'type:<regex>'"
    try:
        re.compile(value[len("type:") :], re.IGNORECASE)
    except re.error as e:
        return f"holds an invalid regular expression ({e})"
    return None


def _attention_config(value: list) -> str | None:
    if all(isinstance(t, str) for t in value):
        return None  # the expanded form: one type name per layer
    for entry in value:
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (list, tuple))
        repeat = entry[1] if ok else None
        if not ok or not (repeat == "all" or (type(repeat) is int and repeat >= 1)):
            return f"entry {entry!r} is not a [[types...], repeat] pair (repeat: a count >= 1 or 'all')"
        if not entry[0] or not all(isinstance(t, str) for t in entry[0]):
            return f"entry {entry!r} needs a non-empty list of attention type names"
    return None


def _enabled(value: dict) -> str | None:
    # its type (fp16.enabled: true or false) is checked with the block's other settings: nested_checks.py
    return None if "enabled" in value else "must contain 'enabled' (true or false)"


def _optimizer(value: dict) -> str | None:
    if not isinstance(value.get("type"), str):
        return "needs 'type' (the optimizer's name)"
    if not isinstance(value.get("params", {}), dict):
        return f"'params' must be a mapping of constructor arguments, got {value['params']!r}"
    return None


def _resources(what: str) -> Check:
    def check(value: str) -> str | None:
        if any(not part.strip() for part in value.split("@")):
            return "has an empty NODE between '@'s; expected NODE[:SLOT,SLOT][@NODE...]"
        try:
            parse_filter(value, what)
        except ValueError as e:
            return str(e).removeprefix(f"{what}: ")
        return None

    return check


def _one_of(*choices: str) -> Check:
    return lambda value: None if value in choices else f"must be one of {', '.join(map(repr, choices))}"


def _separator(value: str) -> str | None:
    return None if value else "must not be empty (it separates the prompts; default a newline)"


def _url(value: str) -> str | None:
    return None if re.match(r"^https?://[^\s/]+", value) else "must be a URL starting with http:// or https://"


DATA_PATH_LISTS = tuple(
    [f"{s}_{kind}data_paths" for s in ("train", "valid", "test") for kind in ("", "label_", "reward_")]
    + [
        f"{pn}_{s}_{kind}data_paths"
        for pn in ("pos", "neg")
        for s in ("train", "valid", "test")
        for kind in ("", "label_")
    ]
)

SYNTAX: dict[str, Check] = {
    **dict.fromkeys(DATA_PATH_LISTS, _strings),
    **dict.fromkeys(("online_dataserver_ips", "comet_tags", "eval_tasks"), _strings),
    **dict.fromkeys(("train_data_weights", "valid_data_weights", "test_data_weights"), _weights),
    "extra_save_iters": _iterations,
    "split": _split,
    "pipe_partition_method": _partition,
    "attention_config": _attention_config,
    **dict.fromkeys(("fp16", "bf16", "amp", "flops_profiler"), _enabled),
    "optimizer": _optimizer,
    "include": _resources("include"),
    "exclude": _resources("exclude"),
    "communication_data_type": _one_of("fp32", "fp16", "bf16"),
    "distributed_backend": _one_of("nccl", "gloo", "mpi", "ccl", "hccl", "xccl"),
    "param_sharing_style": _one_of("grouped", "spaced"),
    "recompute_granularity": _one_of("selective"),
    "soft_prompt_tuning": soft_prompt_problem,
    "wandb_host": _url,
    "prompt_end": _separator,
}


def value_problems(values: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """Every problem of the given (type-checked) values, each naming its key (and the file that set it)."""
    problems = range_problems(values, origins) + nested_problems(values, origins)
    for key, value in values.items():
        check = SYNTAX.get(key)
        problem = check(value) if check is not None and value is not None else None
        if problem:
            where = origins.get(key)
            problems.append(f"{key}={value!r}: {problem}" + (f" (set in {where})" if where else ""))
    return problems
