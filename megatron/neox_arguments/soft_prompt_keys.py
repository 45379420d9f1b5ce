"""The sub-keys of ``soft_prompt_tuning`` (GPT-NeoX's names and defaults) and the check of the dict's syntax."""

from __future__ import annotations

import math
from typing import Any

# GPT-NeoX reads these with dict.get(key, default) in its get_model; its docstring's ``num_tokens`` is not read.
SOFT_PROMPT_DEFAULTS: dict[str, Any] = {"enabled": False, "n_tokens": 10, "init_string": "", "init_range": 0.5}


def soft_prompt_problem(value: Any) -> str | None:
    """What is wrong with a ``soft_prompt_tuning`` dict, or None."""
    if not isinstance(value, dict):
        return "must be a dict with keys " + ", ".join(SOFT_PROMPT_DEFAULTS)
    unknown = sorted(set(value) - set(SOFT_PROMPT_DEFAULTS))
    if unknown:
        hint = " (GPT-NeoX reads n_tokens, not num_tokens)" if "num_tokens" in unknown else ""
        return f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(SOFT_PROMPT_DEFAULTS)}{hint}"
    if not isinstance(value.get("enabled", False), bool):
        return "enabled must be true or false"
    n = value.get("n_tokens", SOFT_PROMPT_DEFAULTS["n_tokens"])
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"n_tokens={n!r} must be an integer >= 1"
    if not isinstance(value.get("init_string", ""), str):
        return "init_string must be a string"
    r = value.get("init_range", SOFT_PROMPT_DEFAULTS["init_range"])
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
        return f"init_range={r!r} must be a finite number > 0"
    return None


def soft_prompt_settings(value: dict | None) -> dict[str, Any] | None:
    """The full settings (defaults filled in) when soft prompt tuning is enabled, else None."""
    if not value or not value.get("enabled", False):
        return None
    return {**SOFT_PROMPT_DEFAULTS, **value}
