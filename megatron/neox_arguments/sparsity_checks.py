"""Checks of ``sparsity_config`` against the sparse attention types a config uses (run by config validation; each
problem names the key and the valid values). Plain Python: the layouts are built here as the model builds them, so
a setting DeepSpeed's classes would reject fails at config time, not when the model is built."""

from __future__ import annotations

import logging
from typing import Any

from megatron.neox_arguments.sparse_layouts import (
    BLOCK_DEFAULT,
    GPT_NEOX_DEFAULTS,
    SPARSE_TYPES,
    SPARSITY_KEYS,
    gpt_neox_layout,
    layout_rng,
)

logger = logging.getLogger(__name__)

# key -> smallest valid value of a count
_COUNTS = {
    "block": 1,
    "num_local_blocks": 1,
    "num_global_blocks": 1,
    "num_different_global_patterns": 1,
    "num_sliding_window_blocks": 1,
    "num_random_blocks": 0,
}
# key -> (smallest valid entry, may the list be empty)
_LISTS = {"local_window_blocks": (1, False), "global_block_indices": (0, True), "global_block_end_indices": (1, True)}


def _is_int(x: Any) -> bool:
    return type(x) is int


def _value_problems(sparsity: dict[str, Any]) -> list[str]:
    out = []
    for key, value in sparsity.items():
        if key in _COUNTS and not (_is_int(value) and value >= _COUNTS[key]):
            out.append(f"sparsity_config.{key}={value!r} must be an integer >= {_COUNTS[key]}")
        elif key == "different_layout_per_head" and not isinstance(value, bool):
            out.append(f"sparsity_config.{key}={value!r} must be true or false")
        elif key in _LISTS and not (key == "global_block_end_indices" and value is None):
            low, may_be_empty = _LISTS[key]
            ok = isinstance(value, list) and all(_is_int(x) and x >= low for x in value)
            if not ok or (not value and not may_be_empty):
                kind = "list" if may_be_empty else "non-empty list"
                out.append(f"sparsity_config.{key}={value!r} must be a {kind} of integers >= {low}")
    return out


def sparsity_problems(values: dict[str, Any]) -> list[str]:
    """Every problem of ``sparsity_config`` for the sparse layers of ``attention_config`` (expanded); warns about
    settings no layer of the config reads (GPT-NeoX ignores them too)."""
    sparsity = values.get("sparsity_config")
    layers = values.get("attention_config") or []  # expanded, unless its expansion failed (reported elsewhere)
    kinds = [k for k in dict.fromkeys(x for x in layers if isinstance(x, str)) if k in SPARSE_TYPES]
    if sparsity is None:
        sparsity = {}
    if not isinstance(sparsity, dict):
        return [f"sparsity_config={sparsity!r} must be a mapping of sparse-attention settings"]
    unknown = sorted(set(sparsity) - SPARSITY_KEYS)
    if unknown:
        return [f"sparsity_config: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(SPARSITY_KEYS))}"]
    problems = _value_problems(sparsity)
    if problems:
        return problems
    if sparsity and not kinds:
        logger.warning(
            "sparsity_config is ignored: no layer of attention_config is sparse (%s)", ", ".join(SPARSE_TYPES)
        )
    elif sparsity:
        read = {"block"}.union(*(GPT_NEOX_DEFAULTS[k] for k in kinds))
        for key in sorted(set(sparsity) - read):
            users = [k for k in SPARSE_TYPES if key in GPT_NEOX_DEFAULTS[k]]
            logger.warning(
                "sparsity_config.%s is ignored: only %s layers read it, and this config's sparse layers are %s",
                key,
                "/".join(users),
                "/".join(kinds),
            )
    seq = values.get("seq_length") or values.get("max_position_embeddings")
    if not isinstance(seq, int) or not kinds:
        return problems
    block = sparsity.get("block", BLOCK_DEFAULT)
    if seq % block:
        return [f"seq_length={seq} must be divisible by sparsity_config.block={block} (sparse attention layers)"]
    for kind in kinds:  # the layout's own rules (one head: no rule depends on the number of heads)
        try:
            gpt_neox_layout(kind, sparsity, 1, seq, layout_rng(0, 0))
        except ValueError as e:
            problems.append(f"attention_config {kind} layers: {e} (sparsity_config)")
    return problems
