"""The real FLOPs of the layers GPT-NeoX's logged formula counts as dense transformer layers: gMLP/aMLP blocks and
block-sparse attention. The planner's compute time uses them; the logged ``runtime/*`` figures keep GPT-NeoX's
formula (:mod:`megatron.logging.flops`), which counts every such layer as ``24·s·h² + 4·s²·h`` forward FLOPs per
sample, as GPT-NeoX's ``get_flops`` does.

Forward FLOPs per sample of ``s`` tokens (a matrix multiply of ``m×k`` by ``k×n`` is ``2·m·k·n``; norms,
activations, softmax and other element-wise work are not counted, as in GPT-NeoX's formula), summed over the
``tp`` tensor-parallel ranks:

* gMLP (``megatron/model/gmlp.py``, ``f = 4h``): ``input_linear`` ``2·s·h·2f``, the spatial gating unit's
  ``s × s`` sequence projection ``2·f·s²`` (the masked upper triangle is multiplied too: the weight is dense),
  ``output_linear`` ``2·s·f·h``: ``24·s·h² + 8·h·s²``.
* aMLP adds its tiny attention (width ``A`` = ``gmlp_attn_dim``; every TP rank has its own of ``A``):
  ``proj_qkv`` ``2·s·2f·3A``, the scores and the weighted values ``tp·4·s²·A``, ``proj_ffn`` ``2·s·A·f``:
  ``14·s·f·A + 4·tp·s²·A``.
* A block-sparse attention layer (``local``, ``sparse_fixed``, ``sparse_variable``, ``bigbird``, ``bslongformer``):
  the transformer layer with its scores and weighted values (``4·s²·h``, a full ``s × s`` as in GPT-NeoX's formula)
  scaled by the layout's kept fraction ``κ``: the layout's causal blocks (``[h][r][c] = 1``, ``c <= r``) over
  ``heads · n²`` (``n = s / block``), the layout made as the model makes it (``sparse_layouts.gpt_neox_layout``
  at ``seq_length``, random blocks from ``layout_rng(seed, layer)``).

Backward is twice the forward (every multiply computes both operands' gradients), so a step is ``K = 3`` (4 with
the recomputed forward) times the batch times these, as in the logged formula. ``tests/unit/test_layer_flops.py``
checks the gMLP/aMLP counts against ``torch.utils.flop_counter.FlopCounterMode`` on a real block, forward and
backward (at TP 2: ``tests/distributed/test_gmlp_tp.py``), and the sparse count against the layout of the model's
own ``SparseAttention``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES, gpt_neox_layout, gpt_neox_settings, layout_rng

GMLP_FF_MULT = 4  # megatron/model/gmlp.py FF_MULT
GMLP_TYPES = ("gmlp", "amlp")
_COUNTED = frozenset(GMLP_TYPES + SPARSE_TYPES)
LAYER_FLOPS_FORMULA = (
    "step time: gMLP 24·s·h² + 8·h·s², aMLP + 14·s·4h·A + 4·tp·s²·A, sparse layers' 4·s²·h × kept blocks "
    "(megatron/planner/layer_flops.py)"
)


def transformer_layer_forward(s: int, h: int) -> float:
    """The forward FLOPs per sample GPT-NeoX's formula gives one layer: ``24·s·h² + 4·s²·h``."""
    return 24.0 * s * h * h + 4.0 * s * s * h


def gmlp_layer_forward(s: int, h: int, tp: int = 1, attn_dim: int = 0) -> float:
    """Forward FLOPs per sample of one gMLP block (aMLP with ``attn_dim`` > 0), all ``tp`` ranks together."""
    f = GMLP_FF_MULT * h
    flops = 2.0 * s * h * 2 * f + 2.0 * f * s * s + 2.0 * s * f * h
    if attn_dim:
        flops += 2.0 * s * 2 * f * 3 * attn_dim + 4.0 * tp * s * s * attn_dim + 2.0 * s * attn_dim * f
    return flops


def sparse_layer_forward(s: int, h: int, kept: float) -> float:
    """Forward FLOPs per sample of a transformer layer whose attention keeps the fraction ``kept`` of its blocks."""
    return 24.0 * s * h * h + 4.0 * s * s * h * kept


def layout_kept_fraction(layout: Sequence[Sequence[Sequence[int]]]) -> float:
    """The causal blocks a ``[heads][n][n]`` layout keeps (``c <= r``) over ``heads · n²``."""
    n = len(layout[0])
    kept = 0
    seen: dict[int, int] = {}
    for grid in layout:
        if id(grid) not in seen:  # heads sharing one grid object (one layout for every head) count once
            seen[id(grid)] = sum(sum(row[: r + 1]) for r, row in enumerate(grid))  # entries are 0/1
        kept += seen[id(grid)]
    return kept / (len(layout) * n * n)


@lru_cache(maxsize=256)
def _kept(kind: str, sparsity_json: str, heads: int, seq_length: int, seed: int, layer: int) -> float:
    sparsity = json.loads(sparsity_json)
    _, layout = gpt_neox_layout(kind, sparsity, heads, seq_length, layout_rng(seed, layer))
    return layout_kept_fraction(layout)


def _draws_random_blocks(kind: str, sparsity: dict[str, Any] | None) -> bool:
    return kind in ("sparse_variable", "bigbird") and bool(gpt_neox_settings(kind, sparsity)[1]["num_random_blocks"])


def sparse_kept_fractions(
    attention_config: Sequence[str] | None, sparsity: dict[str, Any] | None, heads: int, seq_length: int, seed: int
) -> tuple[float, ...]:
    """Each layer's kept block fraction (1.0 for a layer without a block layout); ``()`` without sparse layers."""
    kinds = list(attention_config or ())
    if not set(kinds) & set(SPARSE_TYPES):
        return ()
    text = json.dumps(sparsity or {}, sort_keys=True)
    out = []
    for layer, kind in enumerate(kinds):
        if kind not in SPARSE_TYPES:
            out.append(1.0)
            continue
        # a layout without random blocks is the same at every layer: one build for all of them
        out.append(_kept(kind, text, heads, seq_length, seed, layer if _draws_random_blocks(kind, sparsity) else 0))
    return tuple(out)


def forward_flops_delta(
    attention_config: Sequence[str] | None,
    seq_length: int,
    hidden_size: int,
    tp: int = 1,
    amlp_attn_dim: int = 0,
    sparse_kept: Sequence[float] = (),
) -> float:
    """Forward FLOPs per sample by which the model's gMLP/aMLP and sparse layers differ from GPT-NeoX's formula
    (summed over the layers; 0 for a model without them, and for RWKV models, which the logged formula counts
    as a whole)."""
    kinds = attention_config or ()
    present = set(kinds)
    if "rwkv" in present or not present & _COUNTED:  # the search calls this per candidate: the common case is quick
        return 0.0
    s, h = seq_length, hidden_size
    dense = transformer_layer_forward(s, h)
    delta = 0.0
    for layer, kind in enumerate(kinds):
        if kind in GMLP_TYPES:
            delta += gmlp_layer_forward(s, h, tp, amlp_attn_dim if kind == "amlp" else 0) - dense
        elif kind in SPARSE_TYPES:
            delta += sparse_layer_forward(s, h, sparse_kept[layer]) - dense
    return delta
