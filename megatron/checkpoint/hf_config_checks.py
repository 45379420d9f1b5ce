"""Type and range checks of every field the importer reads from a Hugging Face ``config.json``, before transformers
or the model config sees it.

A field is checked when it is present and not null (a missing one takes transformers' default, which the weight
shapes are checked against later). Sizes are integers (not strings, bools or floats) from 1 to 2^31 - 1, epsilons
and RoPE bases finite and > 0, fractions inside their interval, flags true or false; the heads divide the hidden
size and the key/value heads divide the heads; no implied weight matrix may exceed ``MAX_MATRIX_ELEMENTS``. Each
problem is one line naming the file, the field and what would be valid.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import CheckpointError
from megatron.neox_arguments.ranges import Range

MAX_DIM = 2**31 - 1
MAX_MATRIX_ELEMENTS = 2**40  # ~10^12 per weight matrix: beyond any released model, far below int64 overflow
SIZE = Range(1, MAX_DIM)
POSITIVE = Range(0, lo_open=True)
INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "max_position_embeddings", "head_dim", "sliding_window", "num_local_experts",
        "num_experts_per_tok")  # fmt: skip
FLOATS: dict[str, Range] = {
    **dict.fromkeys(("layer_norm_eps", "rms_norm_eps", "rope_theta", "rotary_emb_base"), POSITIVE),
    **dict.fromkeys(("initializer_range", "router_aux_loss_coef"), Range(0)),
    **dict.fromkeys(("attention_dropout", "hidden_dropout", "router_jitter_noise"), Range(0, 1, hi_open=True)),
    **dict.fromkeys(("rotary_pct", "partial_rotary_factor"), Range(0, 1, lo_open=True)),
}
BOOLS = ("tie_word_embeddings", "use_parallel_residual", "attention_bias", "mlp_bias")
STRINGS = ("model_type", "hidden_act")
ROPE_SECTIONS = ("rope_parameters", "rope_scaling")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        str: "a string",
        float: "a float",
        int: "an integer",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _field_problem(field: str, value: Any) -> str | None:
    """What is wrong with one present, non-null field, or None."""
    if field in INTS:
        if type(value) is not int:
            return f"must be an integer {SIZE.describe()}, not {_type_name(value)}"
        return None if SIZE.contains(float(value)) else f"must be an integer {SIZE.describe()}"
    if field in FLOATS:
        valid = FLOATS[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a finite number {valid.describe()}, not {_type_name(value)}"
        number = float(value) if abs(value) < 1e308 else math.inf
        return None if valid.contains(number) else f"must be a finite number {valid.describe()}"
    if field in BOOLS:
        return None if isinstance(value, bool) else f"must be true or false, not {_type_name(value)}"
    if field in STRINGS:
        return None if isinstance(value, str) and value else f"must be a non-empty string, not {_type_name(value)}"
    return None


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The present, non-null fields read, ``rope_parameters``' RoPE keys included (``rope_parameters.rope_theta``)."""
    out = {k: raw[k] for k in (*INTS, *FLOATS, *BOOLS, *STRINGS) if raw.get(k) is not None}
    for section in ROPE_SECTIONS:
        nested = raw.get(section)
        if nested is not None and not isinstance(nested, dict):
            out[section] = nested
        elif isinstance(nested, dict):
            out.update({f"{section}.{k}": v for k, v in nested.items() if k in FLOATS and v is not None})
    return out


def check_hf_config(path: Path, raw: dict[str, Any]) -> None:
    """Raise CheckpointError (one line naming ``path`` and the field) for the first invalid field of ``raw``."""
    fields = _fields(raw)
    for name, value in fields.items():
        if name in ROPE_SECTIONS:
            problem: str | None = f"must be an object, not {_type_name(value)}"
        else:
            problem = _field_problem(name.rsplit(".", 1)[-1], value)
        if problem:
            raise CheckpointError(f"{path}: {name}={_shown(value)} {problem}")
    _check_shape(path, fields)


def _check_shape(path: Path, f: dict[str, Any]) -> None:
    h, heads, kv = f.get("hidden_size"), f.get("num_attention_heads"), f.get("num_key_value_heads")
    if h and heads and "head_dim" not in f and h % heads:
        raise CheckpointError(
            f"{path}: hidden_size={h} is not divisible by num_attention_heads={heads} (each head gets hidden_size / "
            "num_attention_heads channels; set head_dim when they differ)"
        )
    if heads and kv and (kv > heads or heads % kv):
        raise CheckpointError(
            f"{path}: num_key_value_heads={kv} must divide num_attention_heads={heads} (grouped-query attention)"
        )
    experts, top_k = f.get("num_local_experts"), f.get("num_experts_per_tok")
    if experts and top_k and top_k > experts:
        raise CheckpointError(f"{path}: num_experts_per_tok={top_k} must be at most num_local_experts={experts}")
    if h:
        qkv = 3 * (f.get("head_dim") or 1) * (heads or 1)
        wide = max(f.get("vocab_size", 1), 3 * h, 3 * f.get("intermediate_size", 1), qkv)
        if h * wide > MAX_MATRIX_ELEMENTS:
            raise CheckpointError(
                f"{path}: hidden_size={h} with vocab_size/intermediate_size/heads implies a weight matrix of "
                f"{h * wide:.3g} elements, more than the {MAX_MATRIX_ELEMENTS:.3g} any checkpoint holds "
                "(a size field is wrong)"
            )
