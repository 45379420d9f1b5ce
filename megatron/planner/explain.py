"""Why ``--search`` ranks a layout above the configured one: the terms of the predicted step time that differ.

The calibrated step time (:class:`~megatron.planner.calibrated.Prediction`) is a sum of parts; :func:`step_terms`
regroups them into the terms a user weighs when choosing a layout, moving the recomputed forward of activation
checkpointing (its GEMMs, its memory-bound kernels and its 2 extra tensor-parallel all-reduces per layer) into one
``recompute`` term. The terms add up to ``step_s`` exactly (up to float rounding), so the per-term deltas of two
layouts add up to the difference of their step times; the global batch is the same for every candidate, so a
shorter step is proportionally more tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.planner.calibrated import Prediction
from megatron.planner.search import Candidate, SearchResult

# term -> what it stands for (the order they are printed in)
TERMS = {
    "gemm": "matrix multiplies of the forward and backward",
    "recompute": "the recomputed forward of activation checkpointing (GEMMs, memory-bound kernels, 2 all-reduces)",
    "memory_bound": "memory-bound kernels (norms, GeLU, softmax, dropout, residuals) of the forward and backward",
    "tp_comm": "tensor-parallel all-reduces",
    "pipe_comm": "pipeline sends",
    "engine": "DeepSpeed's pipeline engine: its fixed cost per layer and micro-batch",
    "bubble": "pipeline bubble",
    "dp_comm": "data-parallel gradient all-reduce",
    "zero3_comm": "ZeRO-3 parameter gathers and gradient reduce-scatters not hidden behind compute",
    "context_comm": "context parallelism's key/value traffic (ring attention)",
}
SHOWN_EXPLANATIONS = 50  # layouts above the configured one explained in the table (--json: all)
SIGNIFICANT_S = 0.0005  # deltas below this many seconds are left out of the printed line (not of the JSON)


def step_terms(p: Prediction, checkpoint_activations: bool) -> dict[str, float]:
    """Seconds per step by :data:`TERMS`; their sum is ``p.step_s`` (a prediction with the layout knobs' own
    seconds, ``selective_recompute_s`` and ``context_comm_s``, adds them to ``recompute`` and ``context_comm``)."""
    selective, context = getattr(p, "selective_recompute_s", 0.0), getattr(p, "context_comm_s", 0.0)
    k = 4.0 if checkpoint_activations else 3.0
    extra = (k - 3.0) / k  # the recomputed forward's share of the GEMM and memory-bound time (k / 3 passes)
    tp_extra = 2.0 / 6.0 if checkpoint_activations else 0.0  # 6 all-reduces per layer instead of 4
    return {
        "gemm": p.gemm_s * (1.0 - extra),
        "recompute": (p.gemm_s + p.memory_bound_s) * extra + p.tensor_comm_s * tp_extra + selective,
        "memory_bound": p.memory_bound_s * (1.0 - extra),
        "tp_comm": p.tensor_comm_s * (1.0 - tp_extra),
        "pipe_comm": p.pipe_comm_s,
        "engine": p.engine_overhead_s,
        "bubble": p.bubble_s,
        "dp_comm": p.data_comm_s,
        "zero3_comm": p.zero3_comm_s - p.zero3_hidden_s,
        "context_comm": context,
    }


@dataclass(frozen=True)
class Explanation:
    """A layout ranked above the configured one: its rank and its terms minus the configured layout's."""

    rank: int  # 1-based among the fitting layouts
    layout: Candidate
    step_s_delta: float  # this layout's step time minus the configured one's (negative: faster)
    deltas: dict[str, float]  # per term of TERMS, same sign convention; they sum to step_s_delta

    def to_dict(self) -> dict[str, object]:
        """Plain data."""
        return {
            "rank": self.rank,
            "layout": self.layout.to_dict(),
            "step_s_delta": self.step_s_delta,
            "term_deltas_s": self.deltas,
        }


def explain_above_configured(result: SearchResult) -> list[Explanation]:
    """One explanation per fitting layout ranked above the configured one (none when it does not fit)."""
    if result.configured_rank is None:
        return []
    ours = result.layouts[result.configured_rank - 1]
    assert ours.predicted is not None  # fitting layouts carry a prediction
    base = step_terms(ours.predicted, ours.checkpoint_activations)
    out = []
    for i, c in enumerate(result.layouts[: result.configured_rank - 1], 1):
        assert c.predicted is not None
        terms = step_terms(c.predicted, c.checkpoint_activations)
        deltas = {t: terms[t] - base[t] for t in TERMS}
        out.append(Explanation(i, c, c.predicted.step_s - ours.predicted.step_s, deltas))
    return out


def format_deltas(e: Explanation) -> str:
    """``-1.234 s = bubble -0.900 s, recompute -0.500 s, tp_comm +0.166 s`` (largest first, tiny ones left out)."""
    shown = sorted((t for t in TERMS if abs(e.deltas[t]) >= SIGNIFICANT_S), key=lambda t: -abs(e.deltas[t]))
    parts = ", ".join(f"{t} {e.deltas[t]:+.3f} s" for t in shown) or "no term differs by 0.5 ms or more"
    return f"{e.step_s_delta:+.3f} s = {parts}"
