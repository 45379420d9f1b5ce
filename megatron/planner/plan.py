"""The plan: exact parameter counts, per-rank memory of every pipeline stage, layout, step estimate, warnings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import ClassVar

from megatron.config_utils import NeoXValues, neox_values
from megatron.logging.flops import flops_formula
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.model import VocabPaddingKeys
from megatron.neox_arguments.sections.other import LayerSplitKeys
from megatron.planner.calibrated import DEFAULT_FRAMEWORK, FRAMEWORKS, Link, Prediction, Workload
from megatron.planner.families import formulas
from megatron.planner.inputs import Hardware, TrainingSetup
from megatron.planner.knobs import (
    check_knobs,
    knob_formulas,
    placements,
    plan_only_in_use,
    predict_knobs,
    upper_bound_with_knobs,
)
from megatron.planner.layer_flops import LAYER_FLOPS_FORMULA
from megatron.planner.layout import GroupPlacement, widest_group
from megatron.planner.memory import RankMemory, kv_cache_bytes, rank_memory, training_state_bytes
from megatron.planner.params import ParamCounts, count_params
from megatron.planner.partition import uneven_split_warning
from megatron.planner.throughput import StepEstimate, estimate_step, flops_config, layer_flops_delta
from megatron.training.optimizer_registry import CPU_ADAM_TYPES

BUBBLE_WARNING = 0.10  # warn when the pipeline idles more than this fraction of the compute
GB = 1e9


@dataclass
class Plan:
    """Everything ``deepy.py --plan`` prints."""

    hardware: Hardware
    setup: TrainingSetup
    params: ParamCounts
    ranks: list[RankMemory]  # one per pipeline stage
    placements: list[GroupPlacement]
    step: StepEstimate
    training_state_bytes: int
    weights_16bit_bytes: int
    kv_cache: dict[str, int]
    predicted: Prediction
    formulas: dict[str, str] = field(default_factory=dict)  # which activation and FLOPs formulas the plan used
    warnings: list[str] = field(default_factory=list)
    framework: str = DEFAULT_FRAMEWORK  # whose engine ``predicted`` models (--framework)
    neox_forge_predicted: Prediction | None = None  # neox-forge on the same layout, when framework is another

    @property
    def worst(self) -> RankMemory:
        """The rank that needs the most memory."""
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        """Every rank's estimate is within the GPU memory."""
        return self.worst.total <= self.hardware.gpu_memory_bytes


def _check_world(setup_tp: int, stages: int, hw: Hardware) -> None:
    if hw.gpus % (setup_tp * stages):
        raise ConfigError(
            f"--gpus {hw.gpus} is not divisible by model_parallel_size x pipeline stages = {setup_tp * stages}"
        )


def _warnings(plan: Plan) -> list[str]:
    out = []
    hw, setup, worst = plan.hardware, plan.setup, plan.worst
    if not plan.fits:
        out.append(
            f"does not fit: a stage-{worst.stage} rank needs {worst.total / GB:.1f} GB but the GPU has "
            f"{hw.gpu_memory_bytes / GB:.1f} GB (raise the ZeRO stage, enable checkpoint_activations, lower "
            "train_micro_batch_size_per_gpu, or add tensor/pipeline parallelism)"
        )
    for p in plan.placements:
        if p.axis == "tensor" and not p.inside_node:
            out.append(f"tensor-parallel groups span {p.nodes_spanned} nodes: every layer's all-reduces cross nodes")
        if p.axis == "pipe" and not p.inside_node:
            out.append(
                f"pipeline groups span {p.nodes_spanned} nodes: stage-to-stage activations cross the inter-node "
                "network (the topology puts pipe outermost, data-parallel replicas between stages)"
            )
    unrunnable = plan_only_in_use(setup)
    if unrunnable:
        out.append(
            f"neox-forge cannot run {', '.join(unrunnable)} yet: planned only (a launch refuses them with "
            "'not supported yet')"
        )
    if "offload_optimizer" in setup.offload and setup.optimizer_type not in CPU_ADAM_TYPES:
        out.append(
            f"zero_optimization offload_optimizer with optimizer.type {setup.optimizer_type!r}: a launch stops at "
            "start unless optimizer.type is cpu_adam (DeepSpeed's CPU Adam) or deepspeed_extra_args sets "
            "zero_force_ds_cpu_optimizer: false"
        )
    moved = [f"zero_optimization {k}" for k in setup.offload]
    moved += ["checkpoint_in_cpu"] if setup.checkpoints_on_host else []
    if moved:
        host = max(r.host_bytes for r in plan.ranks)
        out.append(
            f"{', '.join(moved)}: the offloaded tensors are counted in host memory "
            f"({host / GB:.1f} GB per rank, {host * hw.gpus_per_node / GB:.1f} GB per node of {hw.gpus_per_node}), "
            "not on the GPU; the step time leaves out the CPU optimizer step and the PCIe copies"
        )
    if setup.mics_shard_size:
        ranks, mics = setup.dp * setup.context_parallel_size, setup.mics_group
        planned = (
            f"planned as MiCS: ZeRO-3 within groups of {mics} data-parallel ranks, replicated across {ranks // mics}"
            if mics > 1
            else f"planned as ZeRO-3 over all {ranks} data-parallel ranks (MiCS needs ZeRO-3 and a group size above 1 "
            "that divides them)"
        )
        hpz = (
            "; zero_hpz_partition_size is ignored within MiCS groups"
            if mics > 1 and setup.zero_hpz_partition_size > 1
            else ""
        )
        out.append(
            f"zero_optimization mics_shard_size {setup.mics_shard_size}: neox-forge cannot run that layout yet "
            f"(DeepSpeed 0.19 removed MiCS and refuses the key at start-up); {planned} (zero_hpz_partition_size: "
            f"ZeRO++'s hpZ, which it runs){hpz}"
        )
    engine, gemm = plan.predicted.engine_overhead_s, plan.predicted.gemm_s
    if engine > gemm:
        out.append(
            f"DeepSpeed's pipeline engine: its fitted cost per layer and micro-batch ({engine:.2f} s per step) exceeds "
            f"the GEMM time ({gemm:.2f} s); fitted on 20B-530B runs, unchecked for layers this small "
            "(docs/planner.md#the-pipeline-engines-cost-per-layer); larger micro-batches amortise it"
        )
    bubble = (setup.stages - 1) / setup.gas / plan.ranks[0].virtual_stages
    if bubble > BUBBLE_WARNING:
        out.append(
            f"pipeline bubble: {setup.gas} micro-batches over {setup.stages} stages idle {100 * bubble:.0f}% of the "
            "compute; raise gradient_accumulation_steps (>= 4 x stages keeps it small)"
        )
    return out


def workload(
    setup: TrainingSetup, params_per_rank: int, layers_per_stage: int, framework: str = DEFAULT_FRAMEWORK
) -> Workload:
    """What the calibrated step-time model reads from a training setup, run by ``framework``'s engine (a key of
    :data:`~megatron.planner.calibrated.FRAMEWORKS`; neox-forge runs DeepSpeed's)."""
    return Workload.of(
        setup,
        pp=setup.stages,
        params_per_rank=params_per_rank,
        layers_per_stage=layers_per_stage,
        param_bytes=setup.param_bytes,
        flash_attention=setup.flash_attention,
        sequence_parallel=setup.sequence_parallel,
        flops_config=flops_config(setup),
        engine=FRAMEWORKS[framework],
        kv_heads=setup.kv_heads,
        mlp_widths=setup.mlp_widths,
        zero_hpz_partition_size=setup.zero_hpz_partition_size,
        zero_mics_shard_size=setup.mics_group,
        layer_flops_delta=layer_flops_delta(setup),
        pipeline_engine=setup.pp >= 1,
    )


def zero_placements(setup: TrainingSetup, gpus_per_node: int) -> list[GroupPlacement]:
    """Where ZeRO++'s hpZ groups land (consecutive data-parallel ranks), when ``zero_hpz_partition_size`` > 1, and
    MiCS's sharding groups (consecutive data-parallel ranks) and replica groups (one rank of each sharding group)."""
    world = setup.tp * setup.stages * setup.dp * setup.context_parallel_size
    mics = setup.mics_group
    if mics > 1:
        replicas = setup.dp * setup.context_parallel_size // mics
        return [
            GroupPlacement("zero_mics", mics, setup.tp, widest_group(mics, setup.tp, world, gpus_per_node)),
            GroupPlacement(
                "zero_replicas",
                replicas,
                mics * setup.tp,
                widest_group(replicas, mics * setup.tp, world, gpus_per_node),
            ),
        ]
    size = min(setup.zero_hpz_partition_size, setup.dp)
    if setup.zero_stage != 3 or size <= 1:
        return []
    world = setup.tp * setup.stages * setup.dp
    return [GroupPlacement("zero_hpz", size, setup.tp, widest_group(size, setup.tp, world, gpus_per_node))]


def link(hw: Hardware) -> Link:
    """The hardware figures the calibrated model reads."""
    return Link(hw.peak_tflops, hw.hbm_GBps, hw.intra_node_GBps, hw.inter_node_GBps)


@dataclass(kw_only=True)  # not frozen: the schema classes it inherits are not
class PlanInputs(LayerSplitKeys, VocabPaddingKeys):
    """What the planner reads of a resolved config: the training setup, the model config and the two keys the
    parameter count and the search need; built once by the planner's entry (:meth:`from_neox_args`)."""

    setup: TrainingSetup
    model: GPTModelConfig

    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("setup", "model")

    @classmethod
    def from_neox_args(
        cls, args: NeoXValues, padded_vocab_size: int, plan_only: Mapping[str, object] | None = None
    ) -> PlanInputs:
        """Read a resolved NeoXArgs (``global_num_gpus`` = the planned GPUs over ``context_parallel_size``) with the
        given padded vocabulary and the plan-only keys (``megatron/planner/knobs.py``, not in ``args``: a launch
        refuses them); the arguments are not changed."""
        every_key = args.to_dict() if isinstance(args, NeoXArgs) else vars(args)
        values = SimpleNamespace(**{**every_key, "padded_vocab_size": padded_vocab_size, **(plan_only or {})})
        model = GPTModelConfig.from_neox_args(values)
        return cls(
            setup=replace(TrainingSetup.from_neox_args(values), mlp_widths=model.mlp_sizes),
            model=model,
            **neox_values(cls, args),
        )


def build_plan(
    inputs: PlanInputs,
    hw: Hardware,
    *,
    kv_batch: int = 1,
    kv_tokens: int | None = None,
    notes: list[str] | None = None,
    framework: str = DEFAULT_FRAMEWORK,
) -> Plan:
    """Plan a resolved config (``global_num_gpus == hw.gpus``) on ``hw``; the prediction applies ``framework``'s
    engine (and then also gives neox-forge's own on the same layout)."""
    hw.check()
    setup = inputs.setup
    cp = setup.context_parallel_size
    _check_world(setup.tp * cp, setup.stages, hw)
    params = count_params(inputs.model, setup.tp, setup.pp, inputs.pipe_partition_method)
    check_knobs(setup, [s.num_layers for s in params.stages])
    ranks = [rank_memory(setup, i, stage) for i, stage in enumerate(params.stages)]
    groups = placements(setup.tp, setup.stages, setup.dp, cp, hw.gpus_per_node)
    busiest = max(params.stages, key=lambda s: s.total)
    layers_per_stage = max(s.num_layers for s in params.stages)
    per_node = hw.gpus_per_node
    sharding = zero_placements(setup, per_node)
    step = estimate_step(setup, hw, groups + sharding, busiest.total, layers_per_stage)
    step = upper_bound_with_knobs(step, setup, layers_per_stage, busiest.total, per_node, link(hw))
    predicted = predict_knobs(
        workload(setup, busiest.total, layers_per_stage, framework), link(hw), setup, per_node, extra=sharding
    )
    ours = None
    if framework != DEFAULT_FRAMEWORK:
        ours = predict_knobs(
            workload(setup, busiest.total, layers_per_stage), link(hw), setup, per_node, extra=sharding
        )
    tokens = kv_tokens or setup.seq_length
    kv = kv_cache_bytes(setup, kv_batch, tokens)
    plan = Plan(
        hardware=hw,
        setup=setup,
        params=params,
        ranks=ranks,
        placements=groups,
        step=step,
        training_state_bytes=training_state_bytes(setup, params.total),
        weights_16bit_bytes=2 * params.total,
        kv_cache={"batch": kv_batch, "tokens": tokens, "bytes": kv, "per_rank_bytes": kv // (setup.tp * setup.stages)},
        predicted=predicted,
        formulas=knob_formulas(
            setup,
            formulas(
                setup.layer_family,
                flops_formula(flops_config(setup)),
                LAYER_FLOPS_FORMULA if step.compute_flops != step.hardware_flops else "",
            ),
        ),
        framework=framework,
        neox_forge_predicted=ours,
    )
    gmlp = sum(kind in ("gmlp", "amlp") for kind in inputs.model.layer_types)
    if gmlp:  # the logged FLOPs (GPT-NeoX's formula) and the KV cache know attention layers only
        notes = [*(notes or []), f"{gmlp} gmlp/amlp layers: parameters, activation memory and the step time's FLOPs "
                 "counted for them; the logged FLOPs/MFU use GPT-NeoX's transformer formula (as GPT-NeoX logs them), "
                 "the KV cache is estimated as for attention layers"]  # fmt: skip
    uneven = uneven_split_warning(inputs.model, setup.pp, inputs.pipe_partition_method)
    plan.warnings = list(notes or []) + _warnings(plan) + ([uneven] if uneven else [])
    return plan
