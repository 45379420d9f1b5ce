"""Parallelism, tokenizer and miscellaneous keys (GPT-NeoX's ``NeoXArgsParallelism/Tokenizer/Other``)."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.neox_arguments.fields import arg

TOKENIZER_TYPES = Literal[
    "GPT2BPETokenizer", "HFTokenizer", "HFGPT2Tokenizer", "SPMTokenizer", "CharLevelTokenizer", "TiktokenTokenizer"
]


@dataclass(kw_only=True)
class ParallelSizeKeys:
    """The tensor- and pipeline-parallel sizes."""

    model_parallel_size: int = arg(1, "Tensor-parallel degree.", checkpointed=True)
    pipe_parallel_size: int = arg(
        0, "Pipeline stages. 0: no pipeline engine (layers run sequentially); >= 1: DeepSpeed pipeline engine."
    )


@dataclass(kw_only=True)
class LayerSplitKeys:
    """How layers are split over ranks: sequence parallelism and the pipeline partition."""

    sequence_parallel: bool = arg(
        False, "Megatron sequence parallelism: norm/dropout regions sharded along the sequence (needs TP > 1)."
    )
    pipe_partition_method: str = arg(
        "type:transformerlayer|mlp",
        "How layers are split over pipeline stages: `parameters`, `uniform` or `type:<regex>` (balance the "
        "layers whose class or function name matches). The default weighs the transformer (and gMLP) layers only, "
        "so layers that divide by the stages split evenly; GPT-NeoX's default `type:transformer|mlp` also weighs "
        "the parameter-free functions around the layers and can put a layer more on one stage.",
    )


@dataclass(kw_only=True)
class PlanOnlyKeys:
    """Layout knobs of large runs that ``deepy.py --plan`` models and neox-forge's training cannot run yet (a launch
    refuses them: ``not supported yet``). Megatron-LM's names: GPT-NeoX has no such keys."""

    recompute_granularity: str | None = arg(
        None,
        "Megatron-LM's selective activation recomputation: `selective` keeps every activation except the attention "
        "scores, softmax and its dropout, which the backward recomputes (Korthikanti et al. 2022). Planner only "
        "(`deepy.py --plan`); for full recomputation use checkpoint_activations.",
    )
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None,
        "Megatron-LM's interleaved 1F1B pipeline schedule: layers per model chunk; each pipeline rank holds "
        "layers-per-stage / this many chunks (the virtual stages). Planner only (`deepy.py --plan`).",
    )
    context_parallel_size: int = arg(
        1,
        "Megatron-LM's context parallelism: ranks each sequence is split over (ring attention over the key/value "
        "chunks); the data-parallel size is GPUs / (model_parallel_size x stages x this). Planner only "
        "(`deepy.py --plan`).",
    )


@dataclass(kw_only=True)
class ParallelismArgs(ParallelSizeKeys, LayerSplitKeys, PlanOnlyKeys):
    """Pipeline, tensor and sequence parallelism."""

    world_size: int | None = arg(None, "Number of processes; set at run time from the launcher's environment.")
    is_pipe_parallel: bool = arg(False, "True when pipe_parallel_size >= 1 (derived).", derived=True)
    dp_world_size: int = arg(
        None,
        "Data-parallel size: global_num_gpus / (max(pipe_parallel_size, 1) x model_parallel_size) (derived).",
        derived=True,
    )


@dataclass(kw_only=True)
class VocabKeys:
    """The padded vocabulary size (rows of the embedding)."""

    padded_vocab_size: int | None = arg(
        None,
        "Vocabulary size after padding; set once the tokenizer is built (depends on model_parallel_size).",
        checkpointed=True,
    )


@dataclass(kw_only=True)
class TokenizerArgs(VocabKeys):
    """Tokenizer choice and the padded vocabulary size."""

    tokenizer_type: TOKENIZER_TYPES = arg("GPT2BPETokenizer", "Tokenizer implementation.", checkpointed=True)


@dataclass(kw_only=True)
class SeedKeys:
    """The base random seed."""

    seed: int = arg(1234, "Seed of python, numpy and torch random generators, and of data shuffling.")


@dataclass(kw_only=True)
class DistributedKeys:
    """The torch.distributed backend and timeout."""

    distributed_backend: str = arg("nccl", "torch.distributed backend; neox-forge uses gloo on CPU-only machines.")
    distributed_timeout_minutes: float = arg(
        10.0,
        "How long a collective (and the start-up rendezvous) waits for a missing rank before every waiting rank fails "
        "with an error, instead of hanging: a dead or unreachable node ends the run after at most this long (NCCL "
        "needs TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default). Raise it when one rank legitimately works alone for "
        "long (building data indices, saving large checkpoints); see docs/cluster.md. Valid: 0.001 (60 ms) to 10080 (7 days).",
    )


@dataclass(kw_only=True)
class LaunchKeys:
    """What the launcher decides: multi-node mode, the user script, the GPU count."""

    deepspeed_mpi: bool = arg(
        False,
        "Ranks started by mpirun: rank/world size from OMPI_COMM_WORLD_*/MV2_COMM_WORLD_*/PMI_* (implies force_multi).",
    )
    deepspeed_slurm: bool = arg(
        False, "Ranks started by srun: rank/world size from SLURM_PROCID/LOCALID/STEP_NUM_TASKS, master = first node."
    )
    user_script: str | None = arg(None, "The script deepy.py launched (train.py, generate.py, eval.py).")
    global_num_gpus: int = arg(
        None,
        "Total number of ranks. Unset: WORLD_SIZE inside a launched rank, else the hostfile's slots (after "
        "include/exclude/num_nodes; num_gpus per host when set), else the GPUs of this node (num_gpus or all, x "
        "num_nodes), else on a CPU-only machine num_gpus CPU ranks (default 1) x num_nodes.",
        derived=True,
    )


@dataclass(kw_only=True)
class LoadIterationKeys:
    """The checkpoint iteration to load."""

    iteration: int | None = arg(None, "Current iteration; set while running.")


@dataclass(kw_only=True)
class OnnxKeys:
    """ONNX-exportable operators."""

    onnx_safe: bool = arg(False, "Work around known problems of the torch ONNX exporter.")


@dataclass(kw_only=True)
class LossMaskKeys:
    """Whether the loss skips end-of-document tokens."""

    eod_mask_loss: bool = arg(False, "Exclude end-of-document tokens from the loss.")


@dataclass(kw_only=True)
class OtherArgs(SeedKeys, DistributedKeys, LaunchKeys, LoadIterationKeys, OnnxKeys, LossMaskKeys):
    """Distributed runtime, seeds and values set while running."""

    local_rank: int | None = arg(None, "Rank within the node; set by the launcher.")
    rank: int | None = arg(None, "Global rank; set by the launcher.")
    lazy_mpu_init: bool = arg(False, "Let an external manager finish distributed initialisation.")
    fused_kernels_build_path: str | None = arg(
        None,
        "Where GPT-NeoX builds its fused CUDA kernels. neox-forge builds none (its fusions are PyTorch code): a set "
        "value is ignored with a warning.",
    )
    short_seq_prob: float = arg(0.1, "Probability of producing a short sequence (unused by GPT training).")
    adlr_autoresume: bool = arg(False, "Enable ADLR cluster auto-resume.")
    adlr_autoresume_interval: int = arg(1000, "Iterations between auto-resume termination checks.")
    deepscale: bool = arg(False, "Deprecated DeepSpeed flag (no effect).")
    deepscale_config: str | None = arg(None, "Deprecated DeepSpeed config path (no effect).")
    do_train: bool | None = arg(None, "Whether a training set exists; set while running.")
    do_valid: bool | None = arg(None, "Whether a validation set exists; set while running.")
    do_test: bool | None = arg(None, "Whether a test set exists; set while running.")
    config_files: dict | None = arg(
        None, "Raw text of every config file, by file name (set by the loader; saved with checkpoints)."
    )
