"""What the planner reads: the hardware (command line) and the training setup (the resolved config)."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar

from megatron.config_utils import NeoXValues, require_keys
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.rwkv_checks import rwkv_sizes
from megatron.neox_arguments.sections.model import LayerTypeKeys, MLPWidthKeys, PrecisionKeys, SequenceKeys, ShapeKeys
from megatron.neox_arguments.sections.optimizer import OptimizerTypeKeys, ZeroKeys
from megatron.neox_arguments.sections.other import LayerSplitKeys, PlanOnlyKeys, VocabKeys
from megatron.neox_arguments.sections.training import ActivationCheckpointKeys, RecomputeKeys
from megatron.neox_arguments.zero_offload import offloaded_blocks
from megatron.parallel_config import ParallelConfig
from megatron.planner.layer_flops import sparse_kept_fractions
from megatron.training.optimizer_registry import OPTIMIZERS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": 2**30, "tib": 2**40})
MAX_BYTES = 2**50  # 1 PiB per GPU: far beyond any accelerator, small enough for exact arithmetic


def parse_bytes(text: str, what: str = "--gpu-memory") -> int:
    """``40GB`` / ``80GiB`` / ``512MB`` / a plain number of bytes → bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    size = float(m.group(1)) * _UNITS[unit] if m and unit in _UNITS else 0.0
    if not 1 <= size <= MAX_BYTES:
        raise ConfigError(f"{what} {text!r}: expected a size between 1 byte and 1 PiB such as 40GB, 80GiB or 512MB")
    return int(size)


@dataclass(frozen=True)
class Hardware:
    """The cluster the plan is for (defaults: A100-40GB nodes of 8 with NVLink and 200 Gb/s InfiniBand)."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: int = 40 * 10**9
    peak_tflops: float = 312.0
    intra_node_GBps: float = 300.0
    inter_node_GBps: float = 25.0
    hbm_GBps: float = 1555.0

    def check(self) -> None:
        """Raise ConfigError naming the flag when a value is not positive."""
        values = {
            "--gpus": self.gpus,
            "--gpus-per-node": self.gpus_per_node,
            "--peak-tflops": self.peak_tflops,
            "--intra-node-GBps": self.intra_node_GBps,
            "--inter-node-GBps": self.inter_node_GBps,
            "--hbm-GBps": self.hbm_GBps,
        }
        bad = [f"{flag} {value}: must be > 0 and finite" for flag, value in values.items() if not 0 < value < math.inf]
        if bad:
            raise ConfigError(bad)


@dataclass(kw_only=True)  # not frozen: the schema classes it inherits are not
class TrainingSetup(
    PrecisionKeys,
    ZeroKeys,
    SequenceKeys,
    ShapeKeys,
    VocabKeys,
    RecomputeKeys,
    ActivationCheckpointKeys,
    LayerSplitKeys,
    OptimizerTypeKeys,
    MLPWidthKeys,
    LayerTypeKeys,
    PlanOnlyKeys,
):
    """The config values the memory and time models read: the keys (inherited, GPT-NeoX names) and values derived
    from the resolved config under short names of their own."""

    tp: int  # model_parallel_size
    pp: int  # pipe_parallel_size as configured (0: no PipelineModule)
    dp: int
    micro_batch: int
    gas: int
    train_batch: int
    num_heads: int
    kv_heads: int  # num_kv_heads resolved (unset: one key/value head per query head)
    flash_attention: bool
    grad_accum_fp32: bool
    reduce_bucket_size: int
    allgather_bucket_size: int
    overlap_comm: bool
    param_persistence_threshold: int
    prefetch_bucket_size: int
    offload: tuple[str, ...]  # ZeRO offload sections whose device is cpu or nvme (offload_optimizer, offload_param)
    norm_type: str = "layernorm"  # norm: the model's norm (Mamba layers' activation count reads it)
    amlp_attn_dim: int = 0  # gmlp_attn_dim (aMLP's tiny attention width)
    rwkv_ffn: int = 0  # RWKV channel-mix width (rwkv_sizes), 0 without rwkv layers
    mlp_widths: tuple[int, int] = (0, 0)  # the MLP's (linear1 out, linear2 in) widths; (0, 0): plain 4h
    zero_hpz_partition_size: int = 1  # zero_optimization.zero_hpz_partition_size (ZeRO++ hpZ group)
    mics_shard_size: str = ""  # zero_optimization.mics_shard_size as set (MiCS: removed from DeepSpeed 0.19)
    sparse_kept: tuple[float, ...] = ()  # each layer's kept block fraction (layer_flops.py); () without sparse layers

    # not config keys: the layout, batch and attention values the planner derives (its search varies them)
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = (
        "tp",
        "pp",
        "dp",
        "micro_batch",
        "gas",
        "train_batch",
        "num_heads",
        "kv_heads",
        "flash_attention",
        "grad_accum_fp32",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "overlap_comm",
        "param_persistence_threshold",
        "prefetch_bucket_size",
        "offload",
        "rwkv_ffn",
        "norm_type",
        "amlp_attn_dim",
        "mlp_widths",
        "zero_hpz_partition_size",
        "mics_shard_size",
        "sparse_kept",
    )

    def __post_init__(self) -> None:
        require_keys(self, ("precision", "seq_length", "hidden_size", "num_layers", "padded_vocab_size"))

    @property
    def vocab_rows(self) -> int:
        """``padded_vocab_size``, typed without None: a training setup requires it (``__post_init__``)."""
        return typing.cast(int, self.padded_vocab_size)

    @property
    def layer_family(self) -> str:
        """``mamba``, ``rwkv`` or ``gmlp`` (gMLP/aMLP) when every layer is one, ``mixed`` when some are, else ``transformer``."""
        kinds = {"gmlp" if k == "amlp" else k for k in self.attention_config or ()}
        family = kinds & {"mamba", "rwkv", "gmlp"}
        if not family:
            return "transformer"
        return family.pop() if len(kinds) == 1 else "mixed"

    @property
    def mamba_inner(self) -> int:
        """Mamba's inner width ``d_inner`` (``megatron/model/mamba/sizes.py``'s rule)."""
        return self.intermediate_size or int((self.expansion_factor or 2) * self.hidden_size)

    @property
    def stages(self) -> int:
        """Pipeline stages (1 without a pipeline)."""
        return max(self.pp, 1)

    @property
    def checkpoints_on_host(self) -> bool:
        """``checkpoint_in_cpu`` with ``checkpoint_activations``: the kept activation checkpoints wait in host
        memory."""
        return self.checkpoint_activations and self.checkpoint_in_cpu

    @property
    def mics_group(self) -> int:
        """MiCS's sharding group (``zero_optimization.mics_shard_size``) under ZeRO-3 when it is a whole number
        above 1 that divides the ranks the gradients are reduced over; 1 otherwise (plain ZeRO-3)."""
        ranks = self.dp * self.context_parallel_size
        text = self.mics_shard_size.strip()
        size = int(text) if text.lstrip("-").isdigit() else 1
        return size if self.zero_stage == 3 and 1 < size < ranks and ranks % size == 0 else 1

    @property
    def optimizer_state_floats(self) -> int:
        """fp32 optimizer-state values per parameter (the optimizer's registry entry; Adam: 2)."""
        if self.optimizer_type not in OPTIMIZERS:
            raise ConfigError(OPTIMIZERS.unknown(self.optimizer_type))
        return OPTIMIZERS.get(self.optimizer_type).state_floats

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter (and activation element) in the training precision."""
        return 4 if self.precision == "fp32" else 2

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> TrainingSetup:
        """Read a resolved NeoXArgs (``padded_vocab_size`` set)."""
        zero = dict(args.zero_optimization or {})
        heads = args.num_attention_heads
        if args.padded_vocab_size is None:
            raise ValueError("TrainingSetup.from_neox_args: padded_vocab_size is not set (build the tokenizer first)")
        attention = [str(t) for t in (args.attention_config or [])]
        data_types = args.data_types or {}
        return cls(
            precision=args.precision,
            zero_stage=ParallelConfig.from_neox_args(args).zero_stage,  # the stage's owner
            tp=args.model_parallel_size,
            pp=args.pipe_parallel_size,
            dp=args.dp_world_size,
            micro_batch=args.train_micro_batch_size_per_gpu,
            gas=args.gradient_accumulation_steps,
            train_batch=args.train_batch_size,
            seq_length=args.seq_length,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=heads,
            kv_heads=args.num_kv_heads or heads,  # unset: one key/value head per query head
            padded_vocab_size=args.padded_vocab_size,
            checkpoint_activations=args.checkpoint_activations,
            checkpoint_num_layers=args.checkpoint_num_layers,
            partition_activations=args.partition_activations,
            checkpoint_in_cpu=args.checkpoint_in_cpu,
            sequence_parallel=args.sequence_parallel,
            flash_attention=bool(attention) and all(t == "flash" for t in attention),
            optimizer_type=args.optimizer_type,
            grad_accum_fp32=str(data_types.get("grad_accum_dtype", "")).lower() in ("fp32", "float32"),
            reduce_bucket_size=int(zero.get("reduce_bucket_size", 5 * 10**8)),
            allgather_bucket_size=int(zero.get("allgather_bucket_size", 5 * 10**8)),
            overlap_comm=bool(zero.get("overlap_comm", False)),
            param_persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 10**5)),
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 5 * 10**7)),
            offload=offloaded_blocks(zero),
            zero_hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1)),
            mics_shard_size="" if zero.get("mics_shard_size") is None else str(zero["mics_shard_size"]),
            attention_config=attention or None,
            intermediate_size=args.intermediate_size,
            expansion_factor=args.expansion_factor,
            norm_type=args.norm,
            amlp_attn_dim=args.gmlp_attn_dim if "amlp" in attention else 0,
            rwkv_ffn=rwkv_sizes(args).ffn_dim if "rwkv" in attention else 0,
            recompute_granularity=args.recompute_granularity,
            num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
            context_parallel_size=args.context_parallel_size,
            sparse_kept=sparse_kept_fractions(attention, args.sparsity_config, heads, args.seq_length, args.seed),
        )
