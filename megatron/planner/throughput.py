"""FLOPs per step (GPT-NeoX's formulas, :mod:`megatron.logging.flops`: transformer, Mamba or RWKV) and a step-time estimate.

The estimate adds, without overlap: the compute at the given peak (hardware FLOPs: with activation checkpointing
the forward runs twice; gMLP/aMLP blocks and sparse attention layers at their real FLOPs,
:mod:`megatron.planner.layer_flops`, while the logged model and hardware FLOPs keep GPT-NeoX's formula), the
pipeline bubble ``(stages - 1) / micro-batches`` of it, the tensor-parallel all-reduces (2 per layer in the
forward, 2 in the backward, 2 more for the recomputed forward; ring all-reduce moves ``2·(n-1)/n`` of the buffer),
the pipeline sends (one activation per micro-batch each way), and the
data-parallel gradient exchange (all-reduce, or reduce-scatter + all-gather under ZeRO; ZeRO-3 gathers the
weights for the forward and the backward too). Each collective runs at the intra-node bandwidth when its group
stays inside a node, else at the inter-node one. Real runs reach a fraction of the peak, so read the step time as
a lower bound and the MFU as an upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron.logging.flops import FlopsConfig, flops_per_iteration
from megatron.planner.inputs import Hardware, TrainingSetup
from megatron.planner.layer_flops import forward_flops_delta
from megatron.planner.layout import GroupPlacement


@dataclass(frozen=True)
class StepEstimate:
    """Seconds per training step, by part, and the resulting utilisation."""

    model_flops: float  # per step, whole batch (forward + backward)
    hardware_flops: float  # with the recomputed forward
    compute_flops: float  # what compute_s runs: hardware FLOPs, gMLP/aMLP and sparse layers at their real count
    compute_s: float
    bubble_s: float
    tensor_comm_s: float
    pipe_comm_s: float
    data_comm_s: float
    tokens_per_step: int
    peak_flops_total: float

    @property
    def step_s(self) -> float:
        """Estimated seconds per step."""
        return self.compute_s + self.bubble_s + self.tensor_comm_s + self.pipe_comm_s + self.data_comm_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (fraction of the peak) as the run logs it: GPT-NeoX's formula's model FLOPs."""
        return self.model_flops / (self.step_s * self.peak_flops_total)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput."""
        return self.tokens_per_step / self.step_s

    def to_dict(self) -> dict[str, float]:
        """Plain data, with the derived values."""
        return {**asdict(self), "step_s": self.step_s, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s}


def _ring(nbytes: float, n: int, gbps: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` ranks (reduce-scatter + all-gather: the same)."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / (gbps * 1e9)


def flops_config(setup: TrainingSetup) -> FlopsConfig:
    """The values :mod:`megatron.logging.flops` reads, from a training setup (its layer types pick the formula)."""
    return FlopsConfig(
        train_batch_size=setup.train_batch,
        seq_length=setup.seq_length,
        num_layers=setup.num_layers,
        hidden_size=setup.hidden_size,
        padded_vocab_size=setup.padded_vocab_size,
        num_attention_heads=setup.num_heads,
        checkpoint_activations=setup.checkpoint_activations,
        attention_config=setup.attention_config,
        intermediate_size=setup.intermediate_size,
        expansion_factor=setup.expansion_factor,
    )


def layer_flops_delta(setup: TrainingSetup) -> float:
    """Forward FLOPs per sample by which the setup's gMLP/aMLP and sparse layers differ from GPT-NeoX's formula."""
    return forward_flops_delta(
        setup.attention_config, setup.seq_length, setup.hidden_size, setup.tp, setup.amlp_attn_dim, setup.sparse_kept
    )


def compute_flops(setup: TrainingSetup, k: int) -> float:
    """FLOPs of one step with gMLP/aMLP and sparse attention layers at their real count (``k = 3`` forward +
    backward, 4 with the recomputed forward); equal to the logged formula for every other model."""
    return flops_per_iteration(flops_config(setup), k) + k * setup.train_batch * layer_flops_delta(setup)


def estimate_step(
    setup: TrainingSetup, hw: Hardware, placements: list[GroupPlacement], params_per_rank: int, layers_per_stage: int
) -> StepEstimate:
    """The estimate for one step of ``setup`` on ``hw``."""
    flops_cfg = flops_config(setup)
    model = flops_per_iteration(flops_cfg, 3)
    hardware = flops_per_iteration(flops_cfg, 4 if setup.checkpoint_activations else 3)
    real = compute_flops(setup, 4 if setup.checkpoint_activations else 3)
    peak_total = hw.peak_tflops * 1e12 * hw.gpus
    compute = real / peak_total
    bubble = compute * (setup.stages - 1) / setup.gas
    bw = {p.axis: hw.intra_node_GBps if p.inside_node else hw.inter_node_GBps for p in placements}
    act = setup.micro_batch * setup.seq_length * setup.hidden_size * setup.param_bytes
    per_layer = 6 if setup.checkpoint_activations else 4
    tensor = setup.gas * layers_per_stage * per_layer * _ring(act, setup.tp, bw["tensor"])
    pipe = 0.0 if setup.stages == 1 else 2.0 * setup.gas * act / (bw["pipe"] * 1e9)
    grads = params_per_rank * setup.param_bytes
    zero3 = 1.5 if setup.zero_stage == 3 else 1.0  # ZeRO-3: 2 weight gathers + 1 reduce-scatter
    data = _ring(grads, setup.dp, bw["data"]) * zero3
    mics = setup.mics_group
    if mics > 1:  # MiCS: the gathers and reduce-scatter within its groups, the shards all-reduced across them
        replicas = setup.dp * setup.context_parallel_size // mics
        data = _ring(grads, mics, bw.get("zero_mics", bw["data"])) * zero3
        data += _ring(grads / mics, replicas, bw.get("zero_replicas", bw["data"]))
    return StepEstimate(
        model_flops=model,
        hardware_flops=hardware,
        compute_flops=real,
        compute_s=compute,
        bubble_s=bubble,
        tensor_comm_s=tensor,
        pipe_comm_s=pipe,
        data_comm_s=data,
        tokens_per_step=setup.train_batch * setup.seq_length,
        peak_flops_total=peak_total,
    )
