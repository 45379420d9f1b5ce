"""Layout knobs of large runs: selective recomputation, interleaved pipeline stages, context parallelism.

neox-forge's training cannot run these three yet: their keys (Megatron-LM's names, GPT-NeoX has none) are read by
``deepy.py --plan`` only and refused at launch (``megatron/neox_arguments/unsupported.py``). Sequence parallelism,
which neox-forge runs, is modelled in :mod:`~megatron.planner.memory` and :mod:`~megatron.planner.calibrated`.

* ``recompute_granularity: selective`` (Korthikanti et al. 2022): the attention scores, softmax and its dropout are
  not kept but recomputed in the backward. Memory: the ``5·a·s/(h·t)`` term of the per-layer activations drops.
  Time: the forward of the attention core again, ``4·b·s²·h`` FLOPs per layer and sample (``Q·Kᵀ`` and the
  scores times ``V``) at the GEMM pace, and its memory-bound softmax/dropout (a third of the scores' traffic).
* ``num_layers_per_virtual_pipeline_stage`` (Narayanan et al. 2021): each pipeline rank holds ``v`` chunks of
  that many layers. The bubble is divided by ``v``, the pipeline sends multiplied by ``v``. Megatron-LM's schedule
  warms up ``2·(p − i − 1) + (v − 1)·p`` chunk-micro-batches on rank ``i``, so a rank keeps ``min(that + 1, v·m)``
  chunks' activations (the first stage ``L·(1 + (p − 1)/(p·v))`` layers' worth, Korthikanti et al. §4.2.3).
* ``context_parallel_size`` ``c``: every sequence is split over ``c`` ranks (Megatron-LM's order ``tp-cp-dp-pp``:
  context groups between tensor and data). Each rank computes and keeps ``1/c`` of every activation; the gradients
  are reduced over the ``dp·c`` ranks; ring attention passes each rank's key/value chunk
  (``2·b·(s/c)·h_kv/t`` elements) ``c − 1`` times in the forward, key/values and their gradients ``c − 1`` times
  each in the backward (and again for a recomputed forward), charged without overlap at the context group's link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.ranges import RANGES
from megatron.neox_arguments.value_checks import SYNTAX
from megatron.planner.calibrated import Calibration, Link, Prediction, Workload, predict
from megatron.planner.inputs import TrainingSetup
from megatron.planner.layout import GroupPlacement, group_placements, widest_group
from megatron.planner.throughput import StepEstimate

# The keys only the planner reads, with their defaults (a launch refuses any other value).
PLAN_ONLY_KEYS: dict[str, Any] = {
    "recompute_granularity": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "context_parallel_size": 1,
}


def read_plan_only_keys(values: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
    """The plan-only keys of merged config ``values`` (defaults where unset), checked; ConfigError names the key."""
    out = {key: values.get(key, default) for key, default in PLAN_ONLY_KEYS.items()}
    problems = []
    for key, value in out.items():
        where = f" (set in {origins[key]})" if key in origins else ""
        if key == "recompute_granularity":
            problem = None if value is None else SYNTAX[key](value)
        elif value is None:
            problem = None if key == "num_layers_per_virtual_pipeline_stage" else "must be an integer >= 1"
        elif isinstance(value, bool) or not isinstance(value, int):
            problem = "must be an integer >= 1"
        else:
            problem = None if RANGES[key].contains(value) else f"must be {RANGES[key].describe()}"
        if problem:
            problems.append(f"{key}={value!r}: {problem}{where}")
    if problems:
        raise ConfigError(problems)
    return out


class KnobSettings(Protocol):
    """What the knobs' time terms read: a :class:`~megatron.planner.inputs.TrainingSetup`, or a published run
    (:class:`~megatron.planner.published_runs.PublishedRun`) under the same names."""

    @property
    def pp(self) -> int: ...
    @property
    def recompute_granularity(self) -> str | None: ...
    @property
    def num_layers_per_virtual_pipeline_stage(self) -> int | None: ...
    @property
    def context_parallel_size(self) -> int: ...


def plan_only_in_use(setup: TrainingSetup) -> list[str]:
    """The plan-only keys ``setup`` sets to something other than their defaults (what neox-forge cannot run)."""
    return [key for key, default in PLAN_ONLY_KEYS.items() if getattr(setup, key) != default]


def knob_formulas(setup: TrainingSetup, found: dict[str, str]) -> dict[str, str]:
    """``found`` (the plan's formulas) with what the knobs change: the activations' scores term and ``1/c``, the
    recomputed attention core in the hardware FLOPs."""
    out = dict(found)
    if setup.layer_family != "transformer":
        return out
    if setup.recompute_granularity == "selective":
        out["activations_per_layer"] = "s·b·h·(10 + 24/t) (Korthikanti et al., selective recomputation)"
        out["flops"] += "; hardware FLOPs + 4·B·s²·h·l (the recomputed attention core)"
    if setup.context_parallel_size > 1:
        out["activations_per_layer"] += f", / {setup.context_parallel_size} (context parallelism)"
    return out


def virtual_stages(setup: KnobSettings, layers: int) -> int:
    """Model chunks ``v`` per pipeline rank holding ``layers`` layers (1 without interleaving)."""
    n = setup.num_layers_per_virtual_pipeline_stage
    return max(layers // n, 1) if n and setup.pp >= 2 else 1


def check_knobs(setup: TrainingSetup, stage_layers: list[int]) -> None:
    """Raise ConfigError (one line per problem) when the knobs do not fit the layout."""
    problems = []
    n, cp = setup.num_layers_per_virtual_pipeline_stage, setup.context_parallel_size
    if setup.recompute_granularity == "selective" and setup.checkpoint_activations:
        problems.append(
            "recompute_granularity: selective cannot be combined with checkpoint_activations: true (full "
            "recomputation already recomputes the attention core); set one of them"
        )
    if n is not None and setup.pp < 2:
        problems.append("num_layers_per_virtual_pipeline_stage needs pipe_parallel_size >= 2 (an interleaved pipeline)")
    elif n is not None and any(layers % n for layers in stage_layers):
        problems.append(
            f"num_layers_per_virtual_pipeline_stage={n} must divide the layers of every pipeline stage "
            f"({', '.join(map(str, sorted(set(stage_layers))))})"
        )
    if cp > 1 and setup.seq_length % (2 * cp):
        problems.append(
            f"context_parallel_size={cp}: seq_length {setup.seq_length} must divide into 2 x {cp} chunks "
            "(the load-balanced causal split)"
        )
    if problems:
        raise ConfigError(problems)


def layer_scale(setup: TrainingSetup) -> float:
    """The factor context parallelism applies to every activation of a layer (and the logits): ``1/c``."""
    return 1.0 / setup.context_parallel_size


def keeps_attention_scores(setup: TrainingSetup) -> bool:
    """Whether a layer keeps its attention scores for the backward (not with flash attention or selective
    recomputation)."""
    return not setup.flash_attention and setup.recompute_granularity != "selective"


def in_flight_chunks(setup: TrainingSetup, stage: int, v: int) -> int:
    """Micro-batch chunks whose activations a rank of ``stage`` holds at the peak of Megatron-LM's interleaved
    schedule (``v = 1``: DeepSpeed's 1F1B, ``min(stages − stage, micro-batches)``)."""
    if setup.pp < 1:
        return 1
    if v == 1:
        return min(setup.stages - stage, setup.gas)
    return min(2 * (setup.stages - stage - 1) + (v - 1) * setup.stages + 1, v * setup.gas)


def placements(tp: int, pp: int, dp: int, cp: int, gpus_per_node: int) -> list[GroupPlacement]:
    """The tensor, context, pipe and data groups (ranks ``((pipe·dp + data)·cp + context)·tp + tensor``); without
    context parallelism exactly :func:`~megatron.planner.layout.group_placements`."""
    if cp == 1:
        return group_placements(tp, pp, dp, gpus_per_node)
    world = tp * cp * dp * pp
    axes = (("tensor", tp, 1), ("context", cp, tp), ("pipe", pp, dp * cp * tp), ("data", dp, cp * tp))
    return [
        GroupPlacement(a, size, stride, widest_group(size, stride, world, gpus_per_node)) for a, size, stride in axes
    ]


def predict_placements(tp: int, pp: int, dp: int, cp: int, gpus_per_node: int) -> list[GroupPlacement]:
    """The groups :func:`~megatron.planner.calibrated.predict` reads: tensor, pipe and, as ``data``, the group the
    gradients are reduced over (``dp·c`` ranks ``tp`` apart); the ``context`` group besides."""
    found = placements(tp, pp, dp, cp, gpus_per_node)
    if cp == 1:
        return found
    world, size = tp * cp * dp * pp, dp * cp
    grads = GroupPlacement("data", size, tp, widest_group(size, tp, world, gpus_per_node))
    return [grads if p.axis == "data" else p for p in found]


@dataclass(frozen=True)
class KnobPrediction(Prediction):
    """:class:`~megatron.planner.calibrated.Prediction` plus the knobs' own seconds (in ``step_s``)."""

    selective_recompute_s: float = 0.0  # the recomputed attention core (GEMMs and softmax/dropout)
    context_comm_s: float = 0.0  # ring attention's key/value traffic
    virtual_stages: int = 1
    context_parallel_size: int = 1

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        return super().step_s + self.selective_recompute_s + self.context_comm_s


def predict_knobs(
    w: Workload,
    link: Link,
    setup: KnobSettings,
    gpus_per_node: int,
    cal: Calibration | None = None,
    extra: list[GroupPlacement] | None = None,
) -> KnobPrediction:
    """The calibrated prediction of ``w`` (:func:`~megatron.planner.calibrated.predict`) with ``setup``'s knobs on
    nodes of ``gpus_per_node`` (``extra``: further groups ``predict`` reads, e.g. ZeRO++'s hpZ); without knobs the
    same numbers as ``predict``."""
    cal = cal or Calibration()
    cp, v = setup.context_parallel_size, virtual_stages(setup, w.layers_per_stage)
    found = [*predict_placements(w.tp, w.pp, w.dp, cp, gpus_per_node), *(extra or [])]
    base = predict(w, link, found, cal)  # every rank's share of the work: 1/c of it with context parallelism
    grads = predict(replace(w, dp=w.dp * cp), link, found, cal) if cp > 1 else base  # over DP x CP ranks
    bw = {p.axis: (link.intra_node_GBps if p.inside_node else link.inter_node_GBps) * cal.bus_efficiency for p in found}
    gemm, memory = base.gemm_s / cp, base.memory_bound_s / cp
    tensor, pipe = base.tensor_comm_s / cp, base.pipe_comm_s / cp * v
    s, h, b, a, t = w.seq_length, w.hidden_size, w.micro_batch, w.num_heads, w.tp
    layer_mb = w.layers_per_stage * w.gas
    selective = core_flops = 0.0
    if setup.recompute_granularity == "selective":
        core_flops = 4.0 * s * s * h * w.num_layers * w.train_batch  # the attention core's forward, every sample
        imbalance = w.layers_per_stage * w.pp / w.num_layers
        selective = core_flops / grads.gpus * imbalance / (link.peak_tflops * 1e12 * base.gemm_efficiency)
        scores = 0.0 if w.flash_attention else 5.0 * a * s * s * b / t * w.param_bytes / 2 / cp
        selective += cal.activation_traffic / 3.0 * scores * layer_mb / (link.hbm_GBps * 1e9)
    context = 0.0
    if cp > 1:
        chunk = 2.0 * b * (s / cp) * (h * (w.kv_heads or a) / a) / t * w.param_bytes
        passes = 4 if w.checkpoint_activations or setup.recompute_granularity == "selective" else 3
        context = layer_mb * passes * (cp - 1) * chunk / (bw["context"] * 1e9)
    per_micro_batch = (gemm + memory + tensor + pipe + selective + context + base.engine_overhead_s) / w.gas
    bubble = (w.pp - 1) * per_micro_batch / v
    hidden = cal.overlap(w.engine) * min(grads.zero3_comm_s, gemm + memory) if grads.zero3_comm_s else 0.0
    fields = {k: getattr(base, k) for k in Prediction.__dataclass_fields__}
    fields.update(
        data_comm_s=grads.data_comm_s,
        zero3_comm_s=grads.zero3_comm_s,
        gpus=grads.gpus,
        gemm_s=gemm,
        memory_bound_s=memory,
        tensor_comm_s=tensor,
        pipe_comm_s=pipe,
        bubble_s=bubble,
        zero3_hidden_s=hidden,
        hardware_flops=base.hardware_flops + core_flops,
        gemm_flops=base.gemm_flops + core_flops,
    )
    return KnobPrediction(
        **fields, selective_recompute_s=selective, context_comm_s=context, virtual_stages=v, context_parallel_size=cp
    )


def upper_bound_with_knobs(step: StepEstimate, setup: TrainingSetup, layers_per_stage: int, params_per_rank: int,
                           gpus_per_node: int, hw_link: Link) -> StepEstimate:  # fmt: skip
    """The peak-FLOPs upper bound (:func:`~megatron.planner.throughput.estimate_step`) with the knobs: the
    recomputed attention core in the hardware FLOPs, the bubble ``/ v``, the tensor and pipeline traffic of ``1/c``
    of the tokens (pipeline sends ``× v``), the gradients over ``dp·c`` ranks; ring attention's traffic is left out
    (a bound). Without knobs ``step`` itself."""
    cp, v = setup.context_parallel_size, virtual_stages(setup, layers_per_stage)
    selective = setup.recompute_granularity == "selective"
    if cp == 1 and v == 1 and not selective:
        return step
    s, h = setup.seq_length, setup.hidden_size
    core = 4.0 * s * s * h * setup.num_layers * setup.train_batch if selective else 0.0
    hardware, real = step.hardware_flops + core, step.compute_flops + core
    compute = real / step.peak_flops_total
    data = step.data_comm_s
    if cp > 1 and setup.mics_group == 1:  # (MiCS: estimate_step already counts its groups over DP x CP)
        grads = next(
            p for p in predict_placements(setup.tp, setup.stages, setup.dp, cp, gpus_per_node) if p.axis == "data"
        )
        gbps = hw_link.intra_node_GBps if grads.inside_node else hw_link.inter_node_GBps
        n = grads.size
        data = 2.0 * (n - 1) / n * params_per_rank * setup.param_bytes / (gbps * 1e9)
        data *= 1.5 if setup.zero_stage == 3 else 1.0
    return replace(
        step,
        hardware_flops=hardware,
        compute_flops=real,
        compute_s=compute,
        bubble_s=compute * (setup.stages - 1) / setup.gas / v,
        tensor_comm_s=step.tensor_comm_s / cp,
        pipe_comm_s=step.pipe_comm_s * v / cp,
        data_comm_s=data,
    )
