"""Per-rank training memory: weights, gradients, fp32 master weights, optimizer states, activations, buffers.

Bytes per parameter follow what DeepSpeed allocates for the configured precision and ZeRO stage:

* fp16 and bf16 (any stage): 16-bit weights and gradients, fp32 master weights and optimizer
  states; ZeRO-1 shards master + states over the DP ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights
  (tensors up to ``stage3_param_persistence_threshold`` elements stay whole on every rank, besides their shard,
  when there is more than one DP rank).
* fp32: the optimizer steps the weights themselves at ZeRO-0 and (``megatron/training/deepspeed_adapter.py, item 7``)
  the rank's parameter partition at ZeRO-3; ZeRO-1/2 still keep an fp32 copy of the rank's partition (measured
  with DeepSpeed's CPU accelerator).
* bf16 with a pipeline and ZeRO-0, or ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16 optimizer (fp32
  master and states sharded over DP, fp32 gradients); without a pipeline ZeRO-0 bf16 is like fp16.
* ZeRO-Offload (an ``offload_optimizer`` / ``offload_param`` section with ``device`` cpu or nvme): the master
  weights and optimizer states, at ZeRO-2/3 also the gradient partition (fp32), and with ``offload_param`` at
  ZeRO-3 the 16-bit weight shard live in host memory (``host_bytes``), not on the GPU; the gradient-reduce and
  prefetch buckets stay. ``checkpoint_in_cpu`` keeps the activation checkpoints there too.

Activations per micro-batch and transformer layer on one TP rank (Korthikanti et al. 2022, 16-bit):
``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes without checkpointing (``10/t`` with sequence parallelism; the
attention-score term drops with flash attention); with checkpointing each layer keeps only its ``2·s·b·h``-byte input (``/t`` with
``partition_activations``) and one checkpointed block is recomputed at a time. A pipeline stage keeps
``min(stages - stage, micro-batches)`` micro-batches in flight (DeepSpeed's 1F1B schedule). Selective
recomputation, the interleaved schedule and context parallelism change these as :mod:`megatron.planner.knobs` says. Mamba, RWKV and gMLP layers
keep what :mod:`megatron.planner.families` counts instead (a mixed model: the average over its layers).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megatron.planner.families import gmlp_layer_bytes, mamba_layer_bytes, rwkv_layer_bytes
from megatron.planner.inputs import TrainingSetup
from megatron.planner.knobs import in_flight_chunks, keeps_attention_scores, layer_scale, virtual_stages
from megatron.planner.params import StageParams

FP32 = 4


@dataclass(frozen=True)
class BytesPerParam:
    """Where each parameter's bytes live and whether they are sharded over the DP ranks."""

    weights: int
    grads: int
    master: int
    states: int
    grads_sharded: bool
    master_sharded: bool


def bytes_per_param(setup: TrainingSetup) -> BytesPerParam:
    """The DeepSpeed optimizer layout for the setup's precision, ZeRO stage and optimizer."""
    floats = setup.optimizer_state_floats
    w, zero = setup.param_bytes, setup.zero_stage
    bf16_optimizer = (zero == 0 and setup.pp >= 1) or (zero == 1 and setup.grad_accum_fp32)
    if setup.precision == "bfloat16" and bf16_optimizer:  # DeepSpeed's BF16_Optimizer
        return BytesPerParam(w, FP32, FP32, floats * FP32, False, True)
    master = 0 if setup.precision == "fp32" and zero in (0, 3) else FP32
    return BytesPerParam(w, w, master, floats * FP32, zero >= 2, zero >= 1)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank (of one pipeline stage) holds during training."""

    stage: int
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    activations: int
    communication_buffers: int
    activations_per_micro_batch: dict[str, int]
    micro_batches_in_flight: int  # with the interleaved schedule: chunks of a micro-batch (1/virtual_stages each)
    virtual_stages: int = 1
    host_bytes: int = 0  # ZeRO-Offload: what the rank keeps in CPU (or NVMe) memory instead, not in ``total``

    @property
    def param_optimizer(self) -> int:
        """Parameters + master weights + optimizer states (what training reports as param_optimizer_bytes)."""
        return self.parameters + self.master_weights + self.optimizer_states

    @property
    def total(self) -> int:
        """Everything above."""
        return self.param_optimizer + self.gradients + self.activations + self.communication_buffers

    def to_dict(self) -> dict[str, object]:
        """Plain data, with the derived totals."""
        return {**asdict(self), "param_optimizer": self.param_optimizer, "total": self.total}


def _layer_activation_bytes(setup: TrainingSetup) -> dict[str, float]:
    s, b, h, a, t = setup.seq_length, setup.micro_batch, setup.hidden_size, setup.num_heads, setup.tp
    scale = setup.param_bytes / 2 * layer_scale(setup)  # 16-bit activations; context parallelism keeps 1/c
    scores = 5.0 * a * s / (h * t) if keeps_attention_scores(setup) else 0.0
    replicated = 10.0 / t if setup.sequence_parallel else 10.0  # layer norms and dropouts, split by SP
    full = s * b * h * (replicated + 24.0 / t + scores) * scale
    kinds = list(setup.attention_config or ())
    if setup.layer_family != "transformer":  # per layer kind (megatron/planner/families.py), averaged over layers
        by_kind = {
            "mamba": mamba_layer_bytes(b, s, h, setup.mamba_inner, t, setup.norm_type),
            "gmlp": gmlp_layer_bytes(b, s, h, t, setup.norm_type),
            "amlp": gmlp_layer_bytes(b, s, h, t, setup.norm_type, setup.amlp_attn_dim),
        }
        if "rwkv" in kinds:
            by_kind["rwkv"] = rwkv_layer_bytes(b, s, h, setup.rwkv_ffn, a)
        full = sum(by_kind.get(kind, full) for kind in kinds) / len(kinds)
    checkpoint = 2.0 * s * b * h * scale
    return {"full": full, "checkpoint": checkpoint, "partitioned": checkpoint / t}


def activation_bytes(setup: TrainingSetup, layers: int, last_stage: bool) -> dict[str, int]:
    """One micro-batch's activations on a stage with ``layers`` transformer layers, three ways.

    ``*_kept`` entries are what a micro-batch keeps while it waits for its backward pass; the others add what the
    micro-batch in its backward pass needs on top (the recomputed block, the logits on the last stage).
    """
    per = _layer_activation_bytes(setup)
    c = min(setup.checkpoint_num_layers, max(layers, 1))
    blocks = math.ceil(layers / c)
    logits = 0.0
    if last_stage:  # 16-bit logits and the fp32 copy the cross entropy works on
        logits = setup.seq_length * setup.micro_batch * setup.vocab_rows / setup.tp * (setup.param_bytes + 4)
        logits *= layer_scale(setup)
    kept = {
        "no_checkpointing": layers * per["full"],
        "checkpointing": blocks * per["checkpoint"],
        "checkpointing_partitioned": blocks * per["partitioned"],
    }
    if setup.layer_family == "rwkv":  # RWKV blocks are not checkpointed (GPT-NeoX leaves them out too)
        kept = dict.fromkeys(kept, kept["no_checkpointing"])
        c = 0
    working = {"no_checkpointing": logits, "checkpointing": c * per["full"] + logits}
    working["checkpointing_partitioned"] = working["checkpointing"]
    out = {k: int(v + working[k]) for k, v in kept.items()}
    out.update({f"{k}_kept": int(v) for k, v in kept.items()})
    return out


def _buffers(setup: TrainingSetup, held: int, layout: BytesPerParam) -> int:
    """ZeRO's gradient-reduce and all-gather buckets (at most the rank's parameters), DeepSpeed's defaults."""
    if setup.dp == 1 and setup.zero_stage == 0:
        return 0
    reduce = min(setup.reduce_bucket_size, held) * layout.grads * (2 if setup.overlap_comm else 1)
    if setup.zero_stage == 3:
        return reduce + min(setup.prefetch_bucket_size, held) * layout.weights
    if setup.zero_stage in (1, 2):
        return reduce + min(setup.allgather_bucket_size, held) * layout.weights
    return min(setup.reduce_bucket_size, held) * layout.grads  # DeepSpeed's all-reduce bucket


def rank_memory(setup: TrainingSetup, stage: int, params: StageParams) -> RankMemory:
    """The memory of one rank of pipeline ``stage`` holding ``params``."""
    layout = bytes_per_param(setup)
    held, dp = params.total, setup.dp * setup.context_parallel_size  # ZeRO shards over the gradients' group
    dp = setup.mics_group if setup.mics_group > 1 else dp  # MiCS: within its groups, replicated across them
    shard = math.ceil(held / dp)
    if setup.zero_stage == 3 and dp > 1:  # at dp=1 the partition is the parameter itself
        persistent = sum(n for n in params.numels if n <= setup.param_persistence_threshold)
        weights = (persistent + shard) * layout.weights
    else:
        weights = held * layout.weights
    states_on_rank = shard if layout.master_sharded else held
    gradients = (shard if layout.grads_sharded else held) * layout.grads
    master, states = states_on_rank * layout.master, states_on_rank * layout.states
    host = 0
    if "offload_optimizer" in setup.offload:  # fp32 master weights, optimizer states (and sharded gradients, fp32)
        host = master + states + (shard * FP32 if layout.grads_sharded else 0)
        master = states = 0
        gradients = 0 if layout.grads_sharded else gradients
    if "offload_param" in setup.offload and setup.zero_stage == 3 and dp > 1:  # the 16-bit weight shard
        host += shard * layout.weights
        weights -= shard * layout.weights
    v = virtual_stages(setup, params.num_layers)
    chunks = in_flight_chunks(setup, stage, v)  # v = 1: micro-batches
    per_mb = activation_bytes(setup, params.num_layers, stage == setup.stages - 1)
    key = "no_checkpointing"
    if setup.checkpoint_activations:
        key = "checkpointing_partitioned" if setup.partition_activations else "checkpointing"
    kept = round(chunks * per_mb[f"{key}_kept"] / v)
    if setup.checkpoints_on_host:
        host, kept = host + kept, 0
    return RankMemory(
        stage=stage,
        parameters=weights,
        gradients=gradients,
        master_weights=master,
        optimizer_states=states,
        activations=kept + per_mb[key] - per_mb[f"{key}_kept"],
        communication_buffers=_buffers(setup, held, layout),
        activations_per_micro_batch=per_mb,
        micro_batches_in_flight=chunks,
        virtual_stages=v,
        host_bytes=host,
    )


def training_state_bytes(setup: TrainingSetup, total_params: int) -> int:
    """Weights + gradients + master weights + optimizer states of the whole model before any sharding."""
    layout = bytes_per_param(setup)
    return total_params * (layout.weights + layout.grads + layout.master + layout.states)


def kv_cache_bytes(setup: TrainingSetup, batch: int, tokens: int) -> int:
    """Keys and values of every layer for ``batch`` sequences of ``tokens`` in 16-bit (the whole model)."""
    kv_width = setup.hidden_size * setup.kv_heads // setup.num_heads
    return 2 * setup.num_layers * batch * tokens * kv_width * 2
