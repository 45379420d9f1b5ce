"""DeepSpeed JSON-config keys and DeepSpeed runner (launcher) keys."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.neox_arguments.fields import arg

_DS = "DeepSpeed `{}` config block, passed through unchanged."


@dataclass(kw_only=True)
class BatchSizeKeys:
    """The global batch, the micro batch and gradient accumulation."""

    train_batch_size: int = arg(
        None, "Global batch = micro batch x gradient accumulation x data-parallel size.", derived=True
    )
    train_micro_batch_size_per_gpu: int = arg(None, "Samples per rank per forward/backward.", derived=True)
    gradient_accumulation_steps: int = arg(1, "Micro-batches accumulated per optimizer step.", derived=True)


@dataclass(kw_only=True)
class OptimizerDictKeys:
    """DeepSpeed's optimizer and scheduler dicts."""

    optimizer: dict | None = arg(None, "`{type, params}`: optimizer name and constructor arguments (lr, betas...).")
    scheduler: dict | None = arg(None, "`{type, params}` of a DeepSpeed LR scheduler (normally unset).")


@dataclass(kw_only=True)
class GradientReduceKeys:
    """How gradients are all-reduced."""

    fp32_allreduce: bool = arg(False, "All-reduce gradients (and TP reductions) in fp32.")
    prescale_gradients: bool = arg(False, "Scale gradients before the all-reduce.")
    gradient_predivide_factor: float = arg(1.0, "Divide gradients by this factor before averaging.")


@dataclass(kw_only=True)
class ReportingKeys:
    """DeepSpeed's progress and timer reports."""

    steps_per_print: int = arg(10, "DeepSpeed's own progress print interval.")
    wall_clock_breakdown: bool = arg(False, "Time forward/backward/step separately.")


@dataclass(kw_only=True)
class CurriculumKeys:
    """Sequence-length curriculum learning."""

    curriculum_learning: dict | None = arg(
        None,
        "Sequence-length curriculum (DeepSpeed's CurriculumScheduler): enabled, curriculum_type (seqlen), "
        "min_difficulty, max_difficulty (<= seq_length), schedule_type (fixed_linear, fixed_root, fixed_discrete), "
        "schedule_config (total_curriculum_step, difficulty_step, root_degree; or difficulty, max_step).",
    )


@dataclass(kw_only=True)
class UniversalCheckpointKeys:
    """Loading DeepSpeed universal checkpoints."""

    load_universal: bool = arg(
        False,
        "The checkpoint to load is a DeepSpeed universal checkpoint: `load` holds `latest_universal` naming a folder "
        "written by DeepSpeed's `ds_to_universal` (`tools/ckpts/convert_to_universal.py`). It loads into another "
        "TP/PP/DP size or ZeRO stage with the optimizer state; needs zero_optimization.stage >= 1 (docs/checkpoints.md).",
    )


@dataclass(kw_only=True)
class DeepspeedConfigArgs(
    BatchSizeKeys, OptimizerDictKeys, GradientReduceKeys, ReportingKeys, CurriculumKeys, UniversalCheckpointKeys
):
    """Keys that go into the DeepSpeed config (``args.deepspeed_config``) when they differ from their default."""

    deepspeed: bool = arg(True, "DeepSpeed is always used (must be true).")
    sparse_gradients: bool = arg(False, "Sparse all-reduce of embedding gradients.")
    fp16: dict | None = arg(None, "fp16 settings: enabled, loss_scale (0 = dynamic), initial_scale_power, ...")
    bf16: dict | None = arg(None, "bf16 settings: enabled.")
    amp: dict | None = arg(None, "Apex AMP settings: enabled, ...")
    gradient_clipping: float = arg(1.0, "Clip gradients to this global norm (0: off).")
    zero_optimization: dict | None = arg(
        None, "ZeRO settings: stage (0-3), bucket sizes, overlap_comm, offload... Unset: stage 0.", derived=True
    )
    curriculum_seqlen: int = arg(0, "Current curriculum sequence length (set while running).")
    dump_state: bool = arg(False, "Print the DeepSpeed engine state after initialisation.")
    flops_profiler: dict | None = arg(None, _DS.format("flops_profiler"))
    communication_data_type: str | None = arg(None, "Data type of gradient communication.")
    autotuning: dict | None = arg(None, _DS.format("autotuning"))
    activation_checkpointing: dict | None = arg(None, _DS.format("activation_checkpointing"))
    sparse_attention: dict | None = arg(None, _DS.format("sparse_attention"))
    data_efficiency: dict | None = arg(None, _DS.format("data_efficiency"))
    tensorboard: dict | None = arg(None, _DS.format("tensorboard"))
    wandb: dict | None = arg(None, _DS.format("wandb"))
    csv_monitor: dict | None = arg(None, _DS.format("csv_monitor"))
    elasticity: dict | None = arg(None, _DS.format("elasticity"))
    comms_logger: dict | None = arg(None, _DS.format("comms_logger"))
    compression_training: dict | None = arg(None, _DS.format("compression_training"))
    checkpoint: dict | None = arg(None, _DS.format("checkpoint"))
    data_types: dict | None = arg(None, "Data types, e.g. `{grad_accum_dtype: fp32}`.")
    deepspeed_extra_args: dict | None = arg(
        None, "Any further DeepSpeed config keys; a key also set at top level is an error."
    )


@dataclass(kw_only=True)
class DeepspeedRunnerArgs:
    """Launch keys: DeepSpeed's runner on one node; srun/mpirun/pdsh across nodes (docs/cluster.md)."""

    hostfile: str | None = arg(None, "MPI-style hostfile, one `hostname slots=N` per line.")
    include: str | None = arg(None, "Resources to use: `NODE[:SLOT,SLOT][@NODE...]`, e.g. `worker-0@worker-1:0,2`.")
    exclude: str | None = arg(None, "Resources to leave out, same format as include.")
    num_nodes: int = arg(-1, "Use the first N hosts of the hostfile (-1: all).")
    num_gpus: int | None = arg(
        None, "Devices per node (unset: all). On a CPU-only machine: the number of CPU ranks (default 1)."
    )
    master_port: int = arg(29500, "Rendezvous port. On a CPU-only machine a free port is picked when unset.")
    master_addr: str | None = arg(None, "Rendezvous address (default: first host).")
    launcher: Literal["pdsh", "openmpi", "mvapich", "slurm"] = arg(
        "pdsh", "Multi-node backend: pdsh (ssh), openmpi/mvapich (mpirun), slurm (srun); see docs/cluster.md."
    )
    force_multi: bool = arg(False, "Use the multi-node backend even for one host.")
    detect_nvlink_pairs: bool = arg(False, "DeeperSpeed-only: remap devices by NVLink pairs (ignored).")
    autotuning_run: Literal["tune", "run"] | None = arg(
        None,
        "DeepSpeed's autotuner: `tune` (experiments, then the optimal config) or `run` (then train with it); from --autotuning.",
    )
    no_ssh_check: bool = arg(
        False, "Skip the passwordless-ssh check. deepy never runs one: pdsh reports unreachable hosts itself."
    )
    comment: str | None = arg(None, "`srun --comment` (launcher slurm; noted as unused by the others).")
    account: str | None = arg(None, "`srun --account` (launcher slurm; noted as unused by the others).")
