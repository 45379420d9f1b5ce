"""RWKV's sizes and the rules of an ``attention_config`` with ``rwkv`` layers (plain Python: the config layer,
the model and the planner all read them).

GPT-NeoX's sizing (``megatron/model/rwkv/v6/rwkv.py``): ``dim_att`` defaults to ``hidden_size``; ``head_size`` is
``dim_att // num_attention_heads``; the channel-mix width is ``intermediate_size``, else ``int(expansion_factor ·
hidden_size)`` with ``expansion_factor`` 3.5 by default, rounded down to a multiple of 32. Where GPT-NeoX's code and
its documentation of the keys disagree, the documentation wins: a given ``ffn_dim`` is used (GPT-NeoX overwrites
it), an unset ``dim_att`` means ``hidden_size`` (GPT-NeoX fails on ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RWKV_FFN_EXPANSION = 3.5
RWKV_FFN_MULTIPLE = 32


@dataclass(frozen=True)
class RWKVSizes:
    """Widths of one RWKV block."""

    dim_att: int
    head_size: int
    num_heads: int
    ffn_dim: int


def rwkv_sizes(cfg: Any) -> RWKVSizes:
    """The block widths from GPT-NeoX's keys on ``cfg`` (any object with its flat attribute names)."""
    dim_att = cfg.dim_att if cfg.dim_att is not None else cfg.hidden_size
    heads = cfg.num_attention_heads
    if cfg.ffn_dim is not None:
        ffn = cfg.ffn_dim
    else:
        if cfg.intermediate_size:
            ffn = cfg.intermediate_size
        else:
            ffn = int((cfg.expansion_factor or RWKV_FFN_EXPANSION) * cfg.hidden_size)
        ffn = int(ffn // RWKV_FFN_MULTIPLE * RWKV_FFN_MULTIPLE)
    return RWKVSizes(dim_att=dim_att, head_size=dim_att // heads if heads else 0, num_heads=heads, ffn_dim=ffn)


def rwkv_problems(v: dict[str, Any]) -> list[str]:
    """What a config with ``rwkv`` layers (resolved values ``v``, ``attention_config`` expanded) cannot have."""
    if "rwkv" not in (v.get("attention_config") or []):
        return []
    out = []
    layers, heads = v.get("num_layers"), v.get("num_attention_heads")
    tp = v.get("model_parallel_size")  # absent when GPTModelConfig checks its own fields
    if tp is not None and tp > 1:
        out.append(
            f"model_parallel_size={v['model_parallel_size']}: RWKV layers do not support tensor parallelism "
            "(GPT-NeoX refuses it too); use model_parallel_size: 1 (pipeline and data parallelism work)"
        )
    stage = v.get("zero_stage")
    if isinstance(stage, int) and stage >= 3:
        out.append("zero_optimization.stage=3 is not supported with RWKV layers (GPT-NeoX refuses it too); use 0-2")
    if isinstance(layers, int) and layers < 2:
        out.append(f"num_layers={layers}: RWKV's initialisation needs num_layers >= 2 (it divides by num_layers - 1)")
    if not heads or not v.get("hidden_size"):
        return out
    values = {k: v.get(k) for k in ("dim_att", "ffn_dim", "intermediate_size", "expansion_factor", "hidden_size")}
    sizes = rwkv_sizes(type("Keys", (), {**values, "num_attention_heads": heads})())
    for key in ("dim_att", "ffn_dim"):
        if v.get(key) is not None and (not isinstance(v[key], int) or v[key] < 1):
            out.append(f"{key}={v[key]!r} must be a positive int")
            return out
    if sizes.dim_att % heads or sizes.dim_att < 2:
        out.append(f"dim_att={sizes.dim_att} (RWKV) must be >= 2 and divisible by num_attention_heads={heads}")
    elif v.get("head_size") is not None and v["head_size"] != sizes.head_size:
        out.append(
            f"head_size={v['head_size']!r} disagrees with dim_att // num_attention_heads = {sizes.head_size} "
            "(RWKV derives it); remove head_size or make them agree"
        )
    if sizes.ffn_dim < 1:
        out.append(f"the RWKV channel-mix width is {sizes.ffn_dim}; set ffn_dim or a larger intermediate_size")
    return out
