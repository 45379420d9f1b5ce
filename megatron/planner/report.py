"""The plan as a human-readable table or as JSON (same numbers, bytes and seconds unrounded in JSON)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from megatron.planner.calibrated import Prediction
from megatron.planner.inputs import TrainingSetup
from megatron.planner.knobs import PLAN_ONLY_KEYS, plan_only_in_use
from megatron.planner.plan import Plan

GB = 1e9
MEMORY_ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("master_weights", "fp32 master weights"),
    ("optimizer_states", "optimizer states"),
    ("activations", "activations (in flight)"),
    ("communication_buffers", "communication buffers"),
)


def finite_or_null(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, ±inf) replaced by None, in nested dicts, lists and tuples."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_or_null(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_null(v) for v in data]
    return data


def strict_json(data: Any) -> str:
    """What ``--json`` prints: RFC 8259 JSON (no ``NaN``/``Infinity``); a number the models cannot give as a finite
    value (the flag ranges keep every estimate finite) would be ``null``."""
    return json.dumps(finite_or_null(data), indent=2, allow_nan=False)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """Plain data for ``--json``."""
    setup = plan.setup
    return {
        "hardware": asdict(plan.hardware),
        "parameters": {
            "total": plan.params.total,
            "embedding": plan.params.embedding,
            "per_rank_by_stage": [s.total for s in plan.params.stages],
            "layers_by_stage": [s.num_layers for s in plan.params.stages],
        },
        "layout": {
            "gpus": plan.hardware.gpus,
            "tensor_parallel": setup.tp,
            "pipeline_stages": setup.stages,
            "data_parallel": setup.dp,
            "zero_stage": setup.zero_stage,
            "precision": setup.precision,
            "micro_batch": setup.micro_batch,
            "gradient_accumulation_steps": setup.gas,
            "train_batch_size": setup.train_batch,
            "context_parallel": setup.context_parallel_size,
            "virtual_stages": plan.ranks[0].virtual_stages,
            "groups": [p.to_dict() for p in plan.placements],
        },
        "memory": {
            "training_state_bytes": plan.training_state_bytes,
            "weights_16bit_bytes": plan.weights_16bit_bytes,
            "kv_cache": plan.kv_cache,
            "gpu_memory_bytes": plan.hardware.gpu_memory_bytes,
            "fits": plan.fits,
            "worst_stage": plan.worst.stage,
            "per_rank": [r.to_dict() for r in plan.ranks],
        },
        "throughput": {
            **plan.step.to_dict(),
            "predicted": {**plan.predicted.to_dict(), "framework": plan.framework},
            **(
                {"predicted_neox_forge": plan.neox_forge_predicted.to_dict()}
                if plan.neox_forge_predicted is not None
                else {}
            ),
        },
        "formulas": plan.formulas,
        "knobs": {
            "sequence_parallel": setup.sequence_parallel,
            **{key: getattr(setup, key) for key in PLAN_ONLY_KEYS},
            "not_runnable_by_neox_forge": plan_only_in_use(setup),
        },
        "warnings": plan.warnings,
    }


def knobs_line(setup: TrainingSetup) -> list[str]:
    """The layout knobs in use and which of them neox-forge cannot run (none: no line)."""
    runs = ["sequence_parallel"] if setup.sequence_parallel else []
    planned = [f"{key} {getattr(setup, key)}" for key in plan_only_in_use(setup)]
    parts = ([f"{', '.join(runs)} (neox-forge runs it)"] if runs else []) + (
        [f"{', '.join(planned)} (planned only: neox-forge cannot run {'it' if len(planned) == 1 else 'them'} yet)"]
        if planned
        else []
    )
    return [f"layout knobs        {'; '.join(parts)}"] if parts else []


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def predicted_lines(p: Prediction) -> list[str]:
    """The calibrated prediction (docs/planner.md#calibration), two lines."""
    return [
        f"predicted step      {p.step_s:.2f} s = GEMM {p.gemm_s:.2f} (at {100 * p.gemm_efficiency:.0f}% of peak) + "
        f"memory-bound {p.memory_bound_s:.2f} + TP {p.tensor_comm_s:.2f} + PP {p.pipe_comm_s:.2f} + bubble "
        f"{p.bubble_s:.2f} + DP {p.data_comm_s + p.zero3_comm_s - p.zero3_hidden_s:.2f}{_extra_parts(p)} (calibrated)",
        f"predicted           {p.tflops_per_gpu:.1f} TFLOP/s per GPU (GPT-NeoX's logged figure), "
        f"{p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}%",
    ]


def _extra_parts(p: Prediction) -> str:
    # the parts only some layouts have: DeepSpeed's pipeline engine, the layout knobs'
    parts = {"engine": "engine_overhead_s", "selective recompute": "selective_recompute_s", "CP": "context_comm_s"}
    return "".join(f" + {label} {getattr(p, f):.2f}" for label, f in parts.items() if getattr(p, f, 0.0))


def format_plan(plan: Plan) -> str:
    """The table ``deepy.py --plan`` prints."""
    s, hw, step = plan.setup, plan.hardware, plan.step
    lines = [
        "==================== neox-forge plan ====================",
        f"parameters          {plan.params.total:,} ({plan.params.total / 1e9:.2f}B; embedding {plan.params.embedding:,})",
        f"training state      {_gb(plan.training_state_bytes)} before sharding (weights, grads, master, optimizer)",
        f"16-bit weights      {_gb(plan.weights_16bit_bytes)}",
        f"KV cache            {_gb(plan.kv_cache['bytes'])} at batch {plan.kv_cache['batch']} x "
        f"{plan.kv_cache['tokens']} tokens ({_gb(plan.kv_cache['per_rank_bytes'])} per model-parallel rank)",
        "",
        f"layout              {hw.gpus} GPUs ({hw.gpus_per_node} per node) = TP {s.tp} x "
        f"{f'CP {s.context_parallel_size} x ' if s.context_parallel_size > 1 else ''}PP {s.stages}"
        f"{f' ({plan.ranks[0].virtual_stages} virtual stages each)' if plan.ranks[0].virtual_stages > 1 else ''} "
        f"x DP {s.dp}; "
        f"ZeRO-{s.zero_stage} over {s.dp * s.context_parallel_size} "
        f"{'DP x CP' if s.context_parallel_size > 1 else 'DP'} ranks; {s.precision}",
        f"batch               {s.micro_batch} per GPU x {s.gas} micro-batches x {s.dp} = {s.train_batch} samples "
        f"of {s.seq_length} tokens",
    ]
    lines += knobs_line(s)
    for p in plan.placements:
        where = "inside a node" if p.inside_node else f"spans {p.nodes_spanned} nodes"
        lines.append(f"  {p.axis:<8} groups    size {p.size:<4} stride {p.stride:<5} {where}")
    lines += ["", "per-rank memory     " + "".join(f"{'stage ' + str(r.stage):>14}" for r in plan.ranks)]
    for key, label in MEMORY_ROWS:
        lines.append(f"  {label:<24}" + "".join(f"{_gb(getattr(r, key)):>14}" for r in plan.ranks))
    lines.append(f"  {'total':<24}" + "".join(f"{_gb(r.total):>14}" for r in plan.ranks))
    lines.append(f"  {'of GPU memory':<24}" + "".join(f"{r.total / hw.gpu_memory_bytes:>14.0%}" for r in plan.ranks))
    if any(r.host_bytes for r in plan.ranks):
        lines.append(f"  {'offloaded to host':<24}" + "".join(f"{_gb(r.host_bytes):>14}" for r in plan.ranks))
    worst = plan.worst
    per_mb = worst.activations_per_micro_batch
    compute = []  # the step time's own FLOPs count, where it differs from the logged one
    if "compute_flops" in plan.formulas:
        compute = [f"  compute FLOPs     {step.compute_flops:.3e}, {plan.formulas['compute_flops']}"]
    lines += [
        f"activations / micro-batch (stage {worst.stage}, {worst.micro_batches_in_flight} "
        f"{f'chunks of 1/{worst.virtual_stages} micro-batch ' if worst.virtual_stages > 1 else ''}in flight): "
        f"no checkpointing {_gb(per_mb['no_checkpointing'])}, checkpointing {_gb(per_mb['checkpointing'])}, "
        f"checkpointing + partitioned {_gb(per_mb['checkpointing_partitioned'])}",
        "",
        f"FLOPs per step      {step.model_flops:.3e} model, {step.hardware_flops:.3e} hardware",
        f"  FLOPs formula     {plan.formulas['flops']}",
        *compute,
        f"  activations/layer {plan.formulas['activations_per_layer']}",
        f"step time           {step.step_s:.2f} s = compute {step.compute_s:.2f} + bubble {step.bubble_s:.2f} + TP "
        f"{step.tensor_comm_s:.2f} + PP {step.pipe_comm_s:.2f} + DP {step.data_comm_s:.2f} "
        f"(at {hw.peak_tflops:g} TFLOP/s peak, no overlap)",
        f"throughput          {step.tokens_per_s:,.0f} tokens/s, MFU {100 * step.mfu:.1f}% (upper bound)",
        *predicted_lines(plan.predicted),
    ]
    if plan.neox_forge_predicted is not None:
        ours = plan.neox_forge_predicted
        lines[-2] = lines[-2].replace("(calibrated)", f"(calibrated, {plan.framework}'s engine)")
        lines.append(
            f"neox-forge          {ours.tflops_per_gpu:.1f} TFLOP/s per GPU, {ours.tokens_per_s:,.0f} tokens/s on "
            f"this layout (its own engine, DeepSpeed's)"
        )
    lines += [
        "",
        f"fits                {'yes' if plan.fits else 'NO'} ({_gb(worst.total)} of {_gb(hw.gpu_memory_bytes)})",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
