"""``deepy.py --plan ... --search``: the layouts that fit, ranked by the calibrated throughput prediction.

Candidates: every TP (powers of two up to the GPUs) x pipeline stages (dividing the rest) x ZeRO stage 0-3 x
micro-batch (dividing the samples per data-parallel rank) x activation checkpointing on/off, with the global batch
(``train_batch_size``) fixed, so gradient accumulation follows. Each is either a layout that fits (memory from
:mod:`~megatron.planner.memory`, exact parameter counts) or rejected with the first reason found (the structural
checks GPT-NeoX or DeepSpeed would refuse, then memory). ``--search-fix`` keeps some knobs at the configured
values (:data:`KNOBS`), so only the others vary.

The layout knobs of :mod:`~megatron.planner.knobs` (and ``sequence_parallel``) are held at the configured values in
every candidate unless ``--search-vary`` names them (:data:`VARY`), and each candidate is predicted as ``--plan``
predicts it (:func:`~megatron.planner.knobs.predict_knobs`): ``context_parallel_size`` takes its ranks out of the GPUs
before the data-parallel size; a candidate with activation checkpointing recomputes fully instead of selectively
(``recompute_granularity: selective`` applies to the others); ``num_layers_per_virtual_pipeline_stage`` applies to
candidates with 2 or more pipeline stages and must divide their layers per stage. Varied, ``sp`` tries sequence
parallelism off and on where TP > 1, ``recompute`` no, full and selective recomputation (instead of checkpointing
on/off), ``vpp`` no interleaving and every chunk of layers dividing the layers per stage, ``cp`` context-parallel
sizes 1, 2, 4 and 8 that divide the GPUs and half the sequence.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from megatron.neox_arguments.derive import padded_vocab_size
from megatron.planner.calibrated import DEFAULT_FRAMEWORK, Prediction
from megatron.planner.inputs import Hardware, TrainingSetup
from megatron.planner.knobs import check_knobs, placements, predict_knobs, upper_bound_with_knobs
from megatron.planner.memory import rank_memory
from megatron.planner.params import count_params
from megatron.planner.partition import even_split_method
from megatron.planner.plan import PlanInputs, link, workload, zero_placements
from megatron.planner.throughput import estimate_step

GB = 1e9
MAX_MICRO_BATCH = 64
DEFAULT_SEARCH_SECONDS = 60.0  # --search-seconds: time budget of the candidate loop
DEFAULT_HEADROOM = 0.10  # of the GPU memory kept free for the CUDA context, NCCL buffers, fragmentation
SHOWN_REJECTIONS = 50  # rejected layouts listed in full (the rest are counted by reason)
Reason = tuple[str, str]  # (kind, message); kinds: tp-spans-nodes, heads, layers, zero-pipeline, batch, memory
# --search-fix: the knobs that can be kept at the configured value -> what each one is
KNOBS = {
    "tp": "tensor parallelism (model_parallel_size)",
    "pp": "pipeline stages (pipe_parallel_size)",
    "zero": "ZeRO stage (zero_optimization.stage)",
    "micro": "micro-batch (train_micro_batch_size_per_gpu)",
    "ckpt": "activation checkpointing (checkpoint_activations)",
}
# --search-vary: the layout knobs that can be varied -> what each one is
VARY = {
    "sp": "sequence parallelism (sequence_parallel)",
    "recompute": "recomputation: none, full (checkpoint_activations) or selective (recompute_granularity)",
    "vpp": "interleaved pipeline chunks (num_layers_per_virtual_pipeline_stage)",
    "cp": "context parallelism (context_parallel_size)",
}
MAX_CONTEXT_PARALLEL = 8
# (recompute_granularity, sequence_parallel, num_layers_per_virtual_pipeline_stage, context_parallel_size)
Knobs = tuple[str | None, bool, int | None, int]


@dataclass(frozen=True)
class Candidate:
    """One layout, its upper bound and (when it is valid) its calibrated prediction and memory."""

    tp: int
    pp: int  # pipe_parallel_size (0: no pipeline)
    dp: int
    zero_stage: int
    micro_batch: int
    gas: int
    checkpoint_activations: bool
    upper_bound_tokens_per_s: float
    predicted: Prediction | None
    memory_bytes: int | None  # the worst rank's
    reason: str | None  # why rejected; None: fits
    reason_kind: str | None = None
    recompute_granularity: str | None = None  # "selective": the configured selective recomputation applies
    sequence_parallel: bool = False
    layers_per_chunk: int | None = None  # num_layers_per_virtual_pipeline_stage (None: no interleaving)
    context_parallel: int = 1  # context_parallel_size

    @property
    def stages(self) -> int:
        """Pipeline stages."""
        return max(self.pp, 1)

    @property
    def knobs(self) -> Knobs:
        """(recompute_granularity, sequence_parallel, layers per chunk, context-parallel size)."""
        return (self.recompute_granularity, self.sequence_parallel, self.layers_per_chunk, self.context_parallel)

    @property
    def key(self) -> tuple[Any, ...]:
        """(TP, stages, ZeRO, micro-batch, checkpointing, *knobs): what identifies a layout."""
        return (self.tp, self.stages, self.zero_stage, self.micro_batch, self.checkpoint_activations, *self.knobs)

    @property
    def plan_only(self) -> list[str]:
        """The knobs of this layout that neox-forge cannot run yet."""
        return [
            name
            for name, on in (
                ("recompute_granularity", self.recompute_granularity is not None),
                ("num_layers_per_virtual_pipeline_stage", self.layers_per_chunk is not None),
                ("context_parallel_size", self.context_parallel > 1),
            )
            if on
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        out: dict[str, Any] = {
            "tensor_parallel": self.tp,
            "pipe_parallel_size": self.pp,
            "data_parallel": self.dp,
            "zero_stage": self.zero_stage,
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.gas,
            "checkpoint_activations": self.checkpoint_activations,
            "sequence_parallel": self.sequence_parallel,
            "num_layers_per_virtual_pipeline_stage": self.layers_per_chunk,
            "context_parallel_size": self.context_parallel,
            "upper_bound_tokens_per_s": self.upper_bound_tokens_per_s,
            "memory_bytes": self.memory_bytes,
        }
        if self.predicted is not None:
            p = self.predicted
            out.update(tflops_per_gpu=p.tflops_per_gpu, mfu=p.mfu, tokens_per_s=p.tokens_per_s, step_s=p.step_s)
        if self.reason is not None:
            out.update(reason=self.reason, reason_kind=self.reason_kind)
        if self.recompute_granularity is not None:
            out.update(recompute_granularity=self.recompute_granularity)
        return out


@dataclass
class SearchResult:
    """Fitting layouts best first, the rejected ones that the upper bound ranks above the best, and counts."""

    hardware: Hardware
    usable_memory_bytes: int
    train_batch: int
    layouts: list[Candidate]
    rejected_better_bound: list[Candidate]
    rejected_counts: dict[str, int]
    configured: tuple[Any, ...]  # Candidate.key of the configured layout
    configured_rank: int | None  # 1-based among the fitting layouts; None: the configured layout does not fit
    evaluated: int = 0  # candidate layouts evaluated
    cut_short: bool = False  # the time budget ran out before every candidate was evaluated
    budget_seconds: float = DEFAULT_SEARCH_SECONDS
    partition_method: str = ""  # the pipe_partition_method the pipelines were planned with
    partition_note: str | None = None  # why it is not the configured one
    fixed: tuple[str, ...] = ()  # the knobs kept at the configured values (--search-fix), in KNOBS order
    varied: tuple[str, ...] = ()  # the layout knobs varied (--search-vary), in VARY order
    configured_reason: str | None = None  # why the configured layout was rejected (when it was evaluated)

    def to_json(self, top: int) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "gpus": self.hardware.gpus,
            "cut_short": self.cut_short,
            "candidates_evaluated": self.evaluated,
            "search_seconds": self.budget_seconds,
            "usable_memory_bytes": self.usable_memory_bytes,
            "train_batch_size": self.train_batch,
            "layouts": [c.to_dict() for c in self.layouts[:top]],
            "layouts_that_fit": len(self.layouts),
            "configured_layout": dict(
                zip(("tp", "stages", "zero_stage", "micro_batch", "checkpoint"), self.configured[:5], strict=True)
            ),
            "configured_knobs": dict(
                zip(
                    ("recompute_granularity", "sequence_parallel", "num_layers_per_virtual_pipeline_stage"),
                    self.configured[5:8],
                    strict=True,
                ),
                context_parallel_size=self.configured[8],
            ),
            "configured_rank": self.configured_rank,
            "rejected_above_best": [c.to_dict() for c in self.rejected_better_bound[:SHOWN_REJECTIONS]],
            "rejected_above_best_count": len(self.rejected_better_bound),
            "rejected_by_reason": self.rejected_counts,
            "pipe_partition_method": self.partition_method,
            "pipe_partition_note": self.partition_note,
            "fixed_knobs": list(self.fixed),
            "varied_knobs": list(self.varied),
            "configured_rejected_reason": self.configured_reason,
        }


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length())]


def _divisors(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` up to ``limit``, ascending (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return [d for d in sorted({*small, *(n // d for d in small)}) if d <= limit]


def _structural_reason(
    base: TrainingSetup, hw: Hardware, tp: int, stages: int, zero: int, chunk: int | None
) -> Reason | None:
    """(kind, message) of the first structural check the layout fails, if any."""
    if tp > hw.gpus_per_node:
        return "tp-spans-nodes", f"TP {tp} exceeds the {hw.gpus_per_node} GPUs per node (all-reduces would cross nodes)"
    if base.num_heads % tp:
        return "heads", f"num_attention_heads {base.num_heads} not divisible by TP {tp}"
    if base.kv_heads % tp:
        return "heads", f"num_kv_heads {base.kv_heads} not divisible by TP {tp}"
    if stages > 1 and base.num_layers % stages:
        return "layers", f"num_layers {base.num_layers} not divisible by {stages} pipeline stages"
    if stages > 1 and chunk and (base.num_layers // stages) % chunk:
        per_stage = base.num_layers // stages
        return "layers", f"num_layers_per_virtual_pipeline_stage {chunk} does not divide {per_stage} layers per stage"
    if stages > 1 and zero >= 2:
        return (
            "zero-pipeline",
            f"ZeRO-{zero} with {stages} pipeline stages: DeepSpeed's pipeline engine runs ZeRO-0/1 only",
        )
    return None


# (TP, pipe_parallel_size, DP, ZeRO, micro-batch, checkpointing, knobs)
Layout = tuple[int, int, int, int, int, bool, Knobs]


def check_fixed(knobs: str | None) -> tuple[str, ...]:
    """``--search-fix tp,zero`` -> the knobs in :data:`KNOBS` order; ValueError naming the valid ones."""
    names = [k.strip() for k in (knobs or "").split(",") if k.strip()]
    unknown = [k for k in names if k not in KNOBS]
    if unknown or (knobs is not None and not names):
        raise ValueError(f"--search-fix {knobs!r}: a comma-separated list of {', '.join(KNOBS)}")
    return tuple(k for k in KNOBS if k in names)


def check_varied(knobs: str | None, fixed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``--search-vary sp,recompute`` -> the knobs in :data:`VARY` order; ValueError naming the valid ones (or the
    conflict with ``--search-fix ckpt``)."""
    names = [k.strip() for k in (knobs or "").split(",") if k.strip()]
    unknown = [k for k in names if k not in VARY]
    if unknown or (knobs is not None and not names):
        raise ValueError(f"--search-vary {knobs!r}: a comma-separated list of {', '.join(VARY)}")
    if "recompute" in names and "ckpt" in fixed:
        raise ValueError("--search-vary recompute varies checkpointing too: drop ckpt from --search-fix")
    return tuple(k for k in VARY if k in names)


def _knob_options(base: TrainingSetup, tp: int, stages: int, varied: tuple[str, ...]) -> Iterator[tuple[bool, Knobs]]:
    """(checkpointing, knobs) per candidate of one TP x stages shape: the configured knobs, or the varied ones."""
    recompute: list[tuple[bool, str | None]] = [(True, None), (False, base.recompute_granularity)]
    if "recompute" in varied:
        recompute = [(True, None), (False, None), (False, "selective")]
    sps = [False, True] if "sp" in varied and tp > 1 else [base.sequence_parallel]
    chunks: list[int | None] = [base.num_layers_per_virtual_pipeline_stage]
    if "vpp" in varied:
        per_stage = base.num_layers // stages
        chunks = [None, *(_divisors(per_stage, per_stage - 1) if stages > 1 else [])]
    for ckpt, granularity in recompute:
        for sp in sps:
            for chunk in chunks:
                yield ckpt, (granularity, sp, chunk, base.context_parallel_size)


def _context_sizes(base: TrainingSetup, hw: Hardware, varied: tuple[str, ...]) -> list[int]:
    if "cp" not in varied:
        return [base.context_parallel_size]
    sizes = _powers_of_two(MAX_CONTEXT_PARALLEL)
    return [c for c in sizes if c == 1 or (hw.gpus % c == 0 and base.seq_length % (2 * c) == 0)]


def _candidates(
    base: TrainingSetup, hw: Hardware, fixed: tuple[str, ...] = (), varied: tuple[str, ...] = ()
) -> Iterator[tuple[Layout, Reason | None]]:
    """Every candidate layout with its structural rejection (None: to be sized), smallest TP and stages first;
    the ``fixed`` knobs only take the configured value, the ``varied`` layout knobs each of theirs (the
    context-parallel ranks are taken out of the GPUs first)."""
    for cp in _context_sizes(base, hw, varied):
        yield from _shapes(replace(base, context_parallel_size=cp), hw, fixed, varied)


def _shapes(
    base: TrainingSetup, hw: Hardware, fixed: tuple[str, ...], varied: tuple[str, ...]
) -> Iterator[tuple[Layout, Reason | None]]:
    batch, ranks = base.train_batch, hw.gpus // base.context_parallel_size
    for tp in [base.tp] if "tp" in fixed else _powers_of_two(ranks):
        if "tp" in fixed and ranks % tp:
            continue  # a fixed TP that does not divide the GPUs: no layout
        for stages in [base.stages] if "pp" in fixed else _divisors(ranks // tp, ranks):
            if "pp" in fixed and (ranks // tp) % stages:
                continue
            dp = ranks // (tp * stages)
            for zero in [base.zero_stage] if "zero" in fixed else range(4):
                # One stage: ZeRO-2/3 without a PipelineModule (DeepSpeed's pipeline engine runs ZeRO-0/1 only),
                # ZeRO-0/1 as configured (pipe_parallel_size 0 or 1: the engine's per-layer cost differs)
                pp = stages if stages > 1 else (0 if zero >= 2 else min(base.pp, 1))
                if base.precision == "fp16" and pp >= 1 and zero == 0:
                    continue  # GPT-NeoX runs fp16 pipelines with ZeRO-1 anyway (a duplicate of zero == 1)
                for ckpt, knobs in _knob_options(base, tp, stages, varied):
                    if "ckpt" in fixed and ckpt != base.checkpoint_activations:
                        continue
                    reason = _structural_reason(base, hw, tp, stages, zero, knobs[2])
                    if reason is None and batch % dp:
                        reason = ("batch", f"train_batch_size {batch} not divisible by DP {dp}")
                    per_dp = max(batch // dp, 1)
                    micros = _divisors(per_dp, MAX_MICRO_BATCH) if reason is None else [1]
                    if "micro" in fixed:
                        micros = [base.micro_batch] if reason is not None or per_dp % base.micro_batch == 0 else []
                    for micro in micros:
                        yield (tp, pp, dp, zero, micro, ckpt, knobs), reason


def search_layouts(
    inputs: PlanInputs,
    hw: Hardware,
    vocab_size: int,
    headroom: float = DEFAULT_HEADROOM,
    seconds: float = DEFAULT_SEARCH_SECONDS,
    framework: str = DEFAULT_FRAMEWORK,
    fixed: tuple[str, ...] = (),
    varied: tuple[str, ...] = (),
) -> SearchResult:
    """Evaluate every candidate layout of the resolved config on ``hw`` (``vocab_size``: before padding), the
    ``fixed`` knobs (names in :data:`KNOBS`) kept at the configured values, the ``varied`` layout knobs (names in
    :data:`VARY`) taking each of their values.

    A layout fits when its worst rank needs at most ``1 - headroom`` of the GPU memory (the memory model leaves out
    the CUDA context, NCCL's buffers and allocator fragmentation). When ``seconds`` run out the search stops and
    ranks the candidates evaluated so far (``cut_short``).
    """
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"--memory-headroom {headroom}: must be >= 0 and < 1")
    check_knobs(inputs.setup, [])  # the configured knobs themselves (the layers per stage: per candidate)
    deadline = time.monotonic() + seconds
    usable = int(hw.gpu_memory_bytes * (1.0 - headroom))
    base, cfg = inputs.setup, inputs.model
    # Pipelines are planned with the even split when the configured method also weighs the parameter-free functions
    method, divisible_by = even_split_method(cfg, inputs.pipe_partition_method), inputs.make_vocab_size_divisible_by

    @cache
    def counts(tp: int, pp: int) -> Any:
        padded = padded_vocab_size(vocab_size, divisible_by, tp)
        return count_params(replace(cfg, padded_vocab_size=padded), tp, pp, method), padded

    total = count_params(cfg, 1, 0, method).total
    out: list[Candidate] = []
    cut_short = False
    for layout, reason in _candidates(base, hw, fixed, varied):
        if time.monotonic() > deadline:
            cut_short = True
            break
        out.append(_evaluate(base, hw, counts, total, layout, reason, usable, framework))
    fits = sorted((c for c in out if c.reason is None), key=lambda c: -c.predicted.tokens_per_s if c.predicted else 0)
    rejected = [c for c in out if c.reason is not None]
    best_bound = fits[0].upper_bound_tokens_per_s if fits else 0.0
    above = sorted(
        (c for c in rejected if c.upper_bound_tokens_per_s > best_bound), key=lambda c: -c.upper_bound_tokens_per_s
    )
    held = _with_knobs(base)
    configured = (
        *(base.tp, base.stages, base.zero_stage, base.micro_batch, base.checkpoint_activations),
        *(held.recompute_granularity, held.sequence_parallel, held.num_layers_per_virtual_pipeline_stage),
        held.context_parallel_size,
    )
    rank = next((i + 1 for i, c in enumerate(fits) if c.key == configured), None)
    reasons = Counter(c.reason_kind for c in rejected if c.reason_kind)
    result = SearchResult(
        hw, usable, base.train_batch, fits, above, dict(reasons), configured, rank, len(out), cut_short, seconds, method
    )
    result.fixed, result.varied = fixed, varied
    if rank is None:  # a shape refused for every micro-batch is evaluated once, with micro-batch 1
        same = [
            c for c in rejected if c.key == configured or (c.key[:3], c.key[4:]) == (configured[:3], configured[4:])
        ]
        result.configured_reason = next((c.reason for c in sorted(same, key=lambda c: c.key != configured)), None)
    if method != inputs.pipe_partition_method:
        result.partition_note = (
            f"pipelines planned with pipe_partition_method {method!r} (even split); the configured "
            f"{inputs.pipe_partition_method!r} also weighs the parameter-free functions around the layers and can "
            "put a layer more on one stage"
        )
    return result


def _evaluate(
    base: TrainingSetup,
    hw: Hardware,
    counts: Any,
    total: int,
    layout: Layout,
    reason: Reason | None,
    usable: int,
    framework: str = DEFAULT_FRAMEWORK,
) -> Candidate:
    tp, pp, dp, zero, micro, ckpt, (granularity, sp, chunk, cp) = layout
    stages, per_node = max(pp, 1), hw.gpus_per_node
    gas = max(base.train_batch // (dp * micro), 1)
    setup = replace(base, tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch=micro, gas=gas, checkpoint_activations=ckpt)
    setup = _with_knobs(
        replace(
            setup,
            recompute_granularity=granularity,
            sequence_parallel=sp,
            num_layers_per_virtual_pipeline_stage=chunk,
            context_parallel_size=cp,
        )
    )
    knobs: Knobs = (
        setup.recompute_granularity,
        setup.sequence_parallel,
        setup.num_layers_per_virtual_pipeline_stage,
        setup.context_parallel_size,
    )
    groups = placements(tp, stages, dp, setup.context_parallel_size, per_node)

    def bound_of(params_per_rank: int, layers: int) -> float:
        step = estimate_step(setup, hw, groups + zero_placements(setup, per_node), params_per_rank, layers)
        return upper_bound_with_knobs(step, setup, layers, params_per_rank, per_node, link(hw)).tokens_per_s

    if reason is not None:  # shape refused: bound from an even split of the parameters
        bound = bound_of(total // (tp * stages), math.ceil(base.num_layers / stages))
        return Candidate(tp, pp, dp, zero, micro, gas, ckpt, bound, None, None, reason[1], reason[0], *knobs)
    params, padded = counts(tp, pp)
    setup = replace(setup, padded_vocab_size=padded)
    busiest = max(params.stages, key=lambda s: s.total)
    layers = max(s.num_layers for s in params.stages)
    bound = bound_of(busiest.total, layers)
    worst = max(rank_memory(setup, i, s).total for i, s in enumerate(params.stages))
    if worst > usable:
        why = f"does not fit: needs {worst / GB:.1f} GB of {usable / GB:.1f} GB usable ({hw.gpu_memory_bytes / GB:.1f} GB)"
        return Candidate(tp, pp, dp, zero, micro, gas, ckpt, bound, None, worst, why, "memory", *knobs)
    w = workload(setup, busiest.total, layers, framework)
    predicted = predict_knobs(w, link(hw), setup, per_node, extra=zero_placements(setup, per_node))
    return Candidate(tp, pp, dp, zero, micro, gas, ckpt, bound, predicted, worst, None, None, *knobs)


def _with_knobs(setup: TrainingSetup) -> TrainingSetup:
    """A candidate's layout knobs: full recomputation replaces the selective one where it checkpoints, no
    interleaving without a pipeline."""
    if setup.checkpoint_activations and setup.recompute_granularity == "selective":
        setup = replace(setup, recompute_granularity=None)
    if setup.stages < 2 and setup.num_layers_per_virtual_pipeline_stage:
        setup = replace(setup, num_layers_per_virtual_pipeline_stage=None)
    return setup
