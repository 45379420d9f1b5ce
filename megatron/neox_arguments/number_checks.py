"""Integers beyond 64 bits anywhere in a config value, including inside dict-valued keys (``optimizer.params``,
``zero_optimization``, ``deepspeed_extra_args``, ...), and the helpers that print hostile values in one line.

``huge_int_problems``: such integers are never valid (no tensor, counter or DeepSpeed setting takes one) and must be
refused before anything prints them: Python cannot even ``repr`` an integer of more than 4300 digits. The types and
ranges of the settings inside dict-valued keys are checked by ``nested_checks.py``; ``walk`` is the one walk over a
config value's containers that both use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

INT64_MAX = 2**63 - 1


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


def walk(
    value: Any, enter: Callable[[tuple[str | int, ...], Any], bool] | None = None
) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(path below ``value``, item) for ``value`` and everything inside its dicts, lists and tuples, depth first in
    order. A container is entered once (a shared or recursive one, from ``from_dict`` with Python objects: once is
    enough), and not where ``enter(path, item)`` is False."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    seen: set[int] = set()
    while stack:
        path, v = stack.pop()
        yield path, v
        if not isinstance(v, (dict, list, tuple)) or id(v) in seen or (enter is not None and not enter(path, v)):
            continue
        seen.add(id(v))
        items = v.items() if isinstance(v, dict) else enumerate(v)
        stack.extend(((*path, k), child) for k, child in reversed(list(items)))


def _numbers(value: Any) -> Iterator[tuple[tuple[str | int, ...], int | float]]:
    """(path below the key, number) for every int/float inside ``value`` (bools are not numbers)."""
    for path, v in walk(value):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            yield path, v


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
