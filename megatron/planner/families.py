"""Activation memory of Mamba and RWKV layers: the bytes each layer keeps for its backward pass.

The transformer formula (:mod:`megatron.planner.memory`) does not describe these layers: their training paths are
scans (``megatron/model/mamba/segmented.py``, segments of ``64`` tokens; ``megatron/model/rwkv/wkv.py``,
chunk ``T = 8``, its chunks' states carried by the same linear scan) whose saved tensors are dominated by per-token state-sized tensors. The formulas below count, term
by term, the fp32 tensors autograd saves in one layer's forward (measured with ``torch.autograd.graph.saved_tensors_hooks``, every
storage once, parameters and the layer's input excluded, tensors of discarded outputs — the final scan state —
not counted). ``tests/unit/test_planner_families.py`` checks them to the byte against that measurement for micro-batches
of 2 or more and sequence lengths that are multiples of the chunk, in fp32. 16-bit training is not checked (the
scans compute in fp32 whatever the precision, so most of these bytes stay fp32); the planner uses the fp32 count.

Mamba (``d`` = inner width per TP rank, ``r = ⌈h/16⌉``, ``n = 16`` state size), bytes:
``4·(12·b·s·d + ⌈s/64⌉·b·d·n + 3·b·d + b·s·r + 2·b·s·h + b·s·(4·n + 1) + 2·d·n)`` with ``rmsnorm``
(the ``[b, d, s]`` streams and their time-first copies the scan keeps, one ``[b, d, n]`` state per segment of 64
tokens, the convolution's state, the Δ/B/C projections, the norm, ``A``: the scan recomputes its ``[s, b, d, n]``
tensors segment by segment in the backward instead of keeping them); ``layernorm`` keeps
``b·s·h + 2·b·s`` floats instead of rmsnorm's ``2·b·s·h + b·s``, ``scalenorm`` ``2·b·s·h + 2·b·s``.

RWKV (``H`` heads of size ``N``, channel-mix width ``F``, no TP, ``C = s/T`` chunks, ``C'`` = ``C`` rounded up to
the linear scan's chunk length), bytes:
``4·(b·s·h·(2·T + 34 + 1/T) + (T + 3)·b·s·H + 2·b·s·F + 230·b·s + b·H·N²·(C + C' + 1)) + T²``
(``8·T·b·s·h`` bytes of the pairwise decays and ``r·k`` products, the token-shift, LoRA, receptance/key/value/gate
streams, the chunk-major copies the WKV computes on, the ``T × T`` scores per chunk, the scan's decays, states and
start state of ``N × N`` per head and chunk, the causal mask).

gMLP (``f = 4h/tp``; ``p``, ``q`` the norm's floats per feature and per token: rmsnorm 2, 1; layernorm 1, 2;
scalenorm 2, 2): ``4·(b·s·(p·h + p·f + 6·f) + 2·q·b·s + s²)`` (the block's and the gate's norms, the ``2f``-wide
projection and activation, the gate's transposes, ``gate · res``, the causal ``s × s`` weight); aMLP adds
``4·(2·b·s·f + 4·b·s·A + b·s²) + s²`` for its tiny attention of width ``A`` (``gmlp_attn_dim``).
"""

from __future__ import annotations

import math

from megatron.model.linear_scan import chunk_length

MAMBA_STATE = 16  # d_state
MAMBA_SEGMENT = 64  # megatron/model/mamba/segmented.py DEFAULT_SEGMENT (tests/unit/test_planner_families.py checks)
RWKV_CHUNK = 8  # megatron/model/rwkv/wkv.py DEFAULT_CHUNK (tests/unit/test_planner_families.py checks they agree)
FP32 = 4

MAMBA_MEMORY_FORMULA = "4·(12·b·s·d + ⌈s/64⌉·b·d·n + 3·b·d + b·s·⌈h/16⌉ + 2·b·s·h + b·s·(4·n+1) + 2·d·n), n=16"
RWKV_MEMORY_FORMULA = (
    "4·(b·s·h·(2·T + 34 + 1/T) + (T + 3)·b·s·H + 2·b·s·F + 230·b·s + b·H·N²·(C + C' + 1)) + T², T=8, C = s/T, "
    "C' = C rounded up to the linear scan's chunk length (≈√C)"
)


# what the pre-norm keeps besides the layer's input, in floats per token: (per h, constant)
NORM_FLOATS = {"rmsnorm": (2, 1), "layernorm": (1, 2), "scalenorm": (2, 2)}


def mamba_layer_bytes(b: int, s: int, h: int, d_inner: int, tp: int = 1, norm: str = "rmsnorm") -> float:
    """Bytes one Mamba layer keeps for its backward pass (micro-batch ``b``, sequence ``s``, on one TP rank)."""
    d, n, r = d_inner / tp, MAMBA_STATE, math.ceil(h / 16)
    segments = -(-s // MAMBA_SEGMENT)  # one start state per segment (megatron/model/mamba/segmented.py)
    per_h, per_token = NORM_FLOATS.get(norm, NORM_FLOATS["rmsnorm"])
    per = 12 * b * s * d + segments * b * d * n + 3 * b * d + b * s * r + per_h * b * s * h
    per += b * s * (4 * n + per_token) + 2 * d * n
    return FP32 * per


def rwkv_layer_bytes(b: int, s: int, h: int, ffn_dim: int, heads: int, chunk: int = RWKV_CHUNK) -> float:
    """Bytes one RWKV block (time mix + channel mix) keeps for its backward pass (``chunk``: the WKV's)."""
    t, n = min(chunk, s), h // heads
    chunks = -(-s // t)
    inner = chunk_length(chunks)
    chunks_scan = -(-chunks // inner) * inner  # the scan's state tensor covers whole inner chunks
    per = b * s * h * (2 * t + 34 + 1 / t) + (t + 3) * b * s * heads + 2 * b * s * ffn_dim + 230 * b * s
    per += b * heads * n * n * (chunks + chunks_scan + 1)
    return FP32 * per + t * t


GMLP_FF_MULT = 4  # megatron/model/gmlp.py FF_MULT
GMLP_MEMORY_FORMULA = "4·(b·s·(p·h + p·f + 6·f) + 2·q·b·s + s²), f = 4h/tp; aMLP + 4·(2·b·s·f + 4·b·s·A + b·s²) + s²"


def gmlp_layer_bytes(b: int, s: int, h: int, tp: int = 1, norm: str = "rmsnorm", attn_dim: int = 0) -> float:
    """Bytes one gMLP block (aMLP with ``attn_dim`` > 0) keeps for its backward pass on one TP rank."""
    f = GMLP_FF_MULT * h / tp
    per_h, per_token = NORM_FLOATS.get(norm, NORM_FLOATS["rmsnorm"])  # the block's norm and the gate's norm
    per = b * s * (per_h * h + per_h * f + 6 * f) + 2 * per_token * b * s + s * s
    extra = 0
    if attn_dim:  # the tiny attention: its input copy, q/k/v and output, the probabilities, the causal mask
        per += 2 * b * s * f + 4 * b * s * attn_dim + b * s * s
        extra = s * s
    return FP32 * per + extra


TRANSFORMER_MEMORY_FORMULA = "s·b·h·(10 + 24/t + 5·a·s/(h·t)) (Korthikanti et al.)"


def formulas(family: str, flops_formula: str, compute_flops: str = "") -> dict[str, str]:
    """Which activation-memory and FLOPs formulas a plan of ``family``'s layers uses (printed with the plan);
    ``compute_flops``: the step time's own FLOPs count where it differs from the logged formula."""
    by_family = {"mamba": MAMBA_MEMORY_FORMULA, "rwkv": RWKV_MEMORY_FORMULA, "gmlp": GMLP_MEMORY_FORMULA}
    memory = by_family.get(family, TRANSFORMER_MEMORY_FORMULA)
    if family == "mixed":
        memory = "per layer: Mamba/RWKV counts (megatron/planner/families.py), transformer layers Korthikanti et al."
    if family in ("mamba", "mixed") and "RWKV" not in flops_formula:
        flops_formula = "GPT-NeoX's Mamba formula per Mamba layer (megatron/logging/flops.py), transformer terms else"
    out = {"activations_per_layer": memory, "flops": flops_formula}
    if compute_flops:  # gMLP/aMLP or sparse layers: the step time counts their real FLOPs
        out["compute_flops"] = compute_flops
    return out
