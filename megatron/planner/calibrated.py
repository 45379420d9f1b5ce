"""Calibrated step-time prediction: what the peak-FLOPs upper bound (:mod:`~megatron.planner.throughput`) leaves out.

One step of the busiest pipeline stage's rank takes

* **GEMM time**: its GEMM FLOPs (GPT-NeoX's formula with each layer's part scaled to the model's real MLP widths
  and key/value heads, :meth:`Workload.gemm_flops`; the layers of the busiest stage) at
  ``peak · GEMM_PEAK_FRACTION · w / (w + GEMM_KNEE)``, ``w = hidden / tp`` being the width of the per-rank GEMMs:
  wide GEMMs approach a fixed fraction of the peak, narrow ones (large TP) fall off;
* **memory-bound time**: layer norms, GeLU, softmax, dropout and residual adds move each activation byte
  (Korthikanti et al. 2022's per-layer activation bytes, the attention scores included unless flash attention)
  ``ACTIVATION_TRAFFIC`` times per forward + backward over HBM (the recomputed forward a third more);
* **tensor-parallel all-reduces** (4 per layer and micro-batch, 6 with checkpointing), **pipeline sends**
  (the activation one way, its gradient back, per micro-batch; Megatron-LM's scatter/gather sends ``1/tp`` of it)
  and the **data-parallel gradient exchange** once per step, all blocking, at ``BUS_EFFICIENCY`` of the link
  bandwidth (NVLink inside a node, the per-GPU InfiniBand share across nodes);
* **DeepSpeed's pipeline engine**: ``PIPELINE_LAYER_OVERHEAD_S`` per layer of the stage and micro-batch, whatever
  the micro-batch's size (bigger micro-batches amortise it; Megatron-LM's loop and PyTorch FSDP: none);
* **the pipeline bubble**: ``(stages - 1)`` micro-batch slots of the stage's per-micro-batch time;
* **ZeRO-3**: the weights are all-gathered for every micro-batch's forward, backward and recomputed forward and
  the gradients reduce-scattered after each micro-batch; DeepSpeed prefetches, so ``ZERO3_OVERLAP`` of the shorter
  of compute and this traffic hides behind the longer. With ZeRO++'s hpZ (``zero_hpz_partition_size`` > 1) the
  backward's (and recomputed forward's) all-gathers run within the hpZ group (placement ``zero_hpz``, else the data
  group's links), the forward's and the reduce-scatter over all DP ranks. PyTorch FSDP (engine ``pytorch``) skips
  the all-gather of the recomputed forward (the backward's gathered weights serve it) and hides the shorter of
  compute and traffic entirely (``FSDP_OVERLAP``).

The constants are global (the same for every run); four are fitted once against the published runs in
:mod:`~megatron.planner.published_runs` by ``tools/fit_planner_calibration.py`` (docs/planner.md has the table, the
errors and a leave-one-source-out check), ``GEMM_KNEE`` and ``BUS_EFFICIENCY`` are set. DeepSpeed's pipeline engine adds
``PIPELINE_LAYER_OVERHEAD_S`` per layer and micro-batch (:data:`FRAMEWORKS`: ``--framework``;
:meth:`Workload.engine_overhead_s`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron.logging.flops import FlopsConfig, flops_per_iteration
from megatron.planner.layout import GroupPlacement

# Fitted against megatron/planner/published_runs.py by tools/fit_planner_calibration.py (docs/planner.md, "Calibration").
GEMM_PEAK_FRACTION = 0.674  # fraction of the peak a wide bf16/fp16 GEMM sustains in training
GEMM_KNEE = (
    20.0  # set, not fitted (the runs do not constrain it): per-rank GEMM width (hidden / tp) at half that fraction
)
ACTIVATION_TRAFFIC = 6.38  # HBM passes over each activation byte per forward + backward (memory-bound kernels)
BUS_EFFICIENCY = 0.90  # achieved all-reduce / send bandwidth as a fraction of the link bandwidth
ZERO3_OVERLAP = 0.798  # fraction of the shorter of (compute, ZeRO-3 parameter traffic) hidden behind the longer
# Set, not fitted: PyTorch FSDP prefetches the next unit's all-gather in the forward and the backward; the published
# FSDP runs on A100 (validation_runs.FSDP_A100_RUNS, not in the fit) are predicted best with all of it hidden (a fit of
# this value to them ends at its bound, 1).
FSDP_OVERLAP = 1.0
# Seconds DeepSpeed's pipeline engine adds per transformer layer and micro-batch, whatever the micro-batch's size
# (docs/planner.md, "The pipeline engine's cost per layer"; replaces the compute-pace factor of earlier fits)
PIPELINE_LAYER_OVERHEAD_S = 0.0128

# --framework: the training framework whose engine the prediction models -> the engine its step runs on.
FRAMEWORKS = {
    "neox-forge": "deepspeed",  # the default: what a neox-forge run would get
    "gpt-neox": "deepspeed",
    "megatron-deepspeed": "deepspeed",
    "megatron-lm": "megatron-lm",
    "torchtitan": "pytorch",  # PyTorch's own loop (FSDP2): no per-layer engine cost, as Megatron-LM's
    "llm-foundry": "pytorch",  # MosaicML's Composer loop on PyTorch FSDP
}
DEFAULT_FRAMEWORK = "neox-forge"


@dataclass(frozen=True)
class Calibration:
    """The global constants (defaults: the fitted values above)."""

    gemm_peak_fraction: float = GEMM_PEAK_FRACTION
    gemm_knee: float = GEMM_KNEE
    activation_traffic: float = ACTIVATION_TRAFFIC
    bus_efficiency: float = BUS_EFFICIENCY
    zero3_overlap: float = ZERO3_OVERLAP
    fsdp_overlap: float = FSDP_OVERLAP
    pipeline_layer_overhead_s: float = PIPELINE_LAYER_OVERHEAD_S

    def overlap(self, engine: str) -> float:
        """The fraction of the shorter of (compute, ZeRO-3 traffic) that ``engine`` hides behind the longer."""
        return self.fsdp_overlap if engine == "pytorch" else self.zero3_overlap


# Workload fields that a training setup (megatron/planner/inputs.py) and a published run carry under the same name.
SHARED_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "seq_length",
    "padded_vocab_size",
    "tp",
    "dp",
    "micro_batch",
    "gas",
    "checkpoint_activations",
    "zero_stage",
)


@dataclass(frozen=True)
class Workload:
    """What the prediction reads: shape, layout and batch of one training step."""

    hidden_size: int
    num_layers: int
    num_heads: int
    seq_length: int
    padded_vocab_size: int
    tp: int
    pp: int  # pipeline stages (>= 1)
    dp: int
    micro_batch: int
    gas: int
    checkpoint_activations: bool
    zero_stage: int
    params_per_rank: int  # the busiest stage's rank
    layers_per_stage: int  # the busiest stage
    param_bytes: int = 2
    flash_attention: bool = False
    sequence_parallel: bool = False
    engine: str = (
        "deepspeed"  # "deepspeed" (GPT-NeoX, neox-forge, Megatron-DeepSpeed), "megatron-lm" or "pytorch" (FSDP)
    )
    flops_config: FlopsConfig | None = None  # a planned config: its FLOPs by megatron.logging.flops (Mamba, RWKV)
    kv_heads: int = 0  # key/value heads (GQA); 0: one per query head
    mlp_widths: tuple[int, int] = (0, 0)  # the MLP's (linear1 out, linear2 in) widths; (0, 0): plain 4h
    zero_hpz_partition_size: int = 1  # ZeRO++ hpZ: backward weight all-gathers within groups of this many DP ranks
    zero_mics_shard_size: int = 1  # MiCS: ZeRO-3 within groups of this many DP ranks, replicated across the groups
    layer_flops_delta: float = 0.0  # gMLP/sparse layers' real forward FLOPs per sample less the formula's
    pipeline_engine: bool = True  # DeepSpeed's PipelineEngine runs the step (GPT-NeoX: pipe_parallel_size >= 1)

    @classmethod
    def of(cls, source: object, **rest: Any) -> Workload:
        """The workload of ``source`` (a training setup or a published run): the :data:`SHARED_FIELDS` read from it
        under their own names, the other fields given in ``rest``."""
        return cls(**{name: getattr(source, name) for name in SHARED_FIELDS}, **rest)

    @property
    def on_deepspeed_pipeline_engine(self) -> bool:
        """DeepSpeed's PipelineEngine runs the step: the runs ``PIPELINE_LAYER_OVERHEAD_S`` is fitted to and applies
        to (DeepSpeed's plain engine, without a PipelineModule, runs the model's own forward and backward)."""
        return self.engine == "deepspeed" and self.pipeline_engine

    def engine_overhead_s(self, cal: Calibration) -> float:
        """Seconds per step the engine adds whatever the micro-batch size: ``PIPELINE_LAYER_OVERHEAD_S`` for each of
        the busiest stage's layers and micro-batches on DeepSpeed's pipeline engine, none otherwise."""
        layer_mb = self.layers_per_stage * self.gas
        return cal.pipeline_layer_overhead_s * layer_mb if self.on_deepspeed_pipeline_engine else 0.0

    @property
    def train_batch(self) -> int:
        """Samples per step."""
        return self.micro_batch * self.gas * self.dp

    def gemm_flops(self, k: int) -> float:
        """The FLOPs the step's matrix multiplies do: :meth:`flops` with each transformer layer's part scaled by
        :meth:`layer_flops_ratio` (GQA's narrower key/value projections, the MLP's real widths)."""
        logged = self.flops(k) + k * self.train_batch * self.layer_flops_delta  # gMLP/aMLP, sparse: real FLOPs
        ratio = self.layer_flops_ratio()
        kinds = set(self.flops_config.attention_config or ()) if self.flops_config is not None else set()
        if ratio == 1.0 or kinds & {"mamba", "rwkv", "gmlp", "amlp"}:
            return logged  # Mamba/RWKV/gMLP layers: their own formulas
        b, s, n, h = self.train_batch, self.seq_length, self.num_layers, self.hidden_size
        layers = k * b * s * n * (24.0 * h * h + 4.0 * s * h)  # the layer part of GPT-NeoX's formula
        return logged + layers * (ratio - 1.0)

    def layer_flops_ratio(self) -> float:
        """A transformer layer's forward FLOPs per token over the ``24·h² + 4·s·h`` GPT-NeoX's formula assumes
        (query/key/value ``2h·(h + 2h·kv/a)``, output ``2h²``, MLP ``2h·w1 + 2·w2·h``, scores ``4·s·h``)."""
        h, s = float(self.hidden_size), float(self.seq_length)
        kv = (self.kv_heads or self.num_heads) / self.num_heads
        w1, w2 = self.mlp_widths if self.mlp_widths[0] else (4 * h, 4 * h)
        actual = 2 * h * (h + 2 * h * kv) + 2 * h * h + 2 * h * w1 + 2 * w2 * h + 4 * s * h
        return actual / (24 * h * h + 4 * s * h)

    def flops(self, k: int) -> float:
        """GPT-NeoX's FLOPs per step (``k = 3`` model, ``4`` with the recomputed forward)."""
        if self.flops_config is not None:
            return flops_per_iteration(self.flops_config, k)
        b, s, n, h, v = self.train_batch, self.seq_length, self.num_layers, self.hidden_size, self.padded_vocab_size
        return 24.0 * k * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n * h))


@dataclass(frozen=True)
class Link:
    """Bandwidths (GB/s per GPU) and the accelerator's peak."""

    peak_tflops: float
    hbm_GBps: float
    intra_node_GBps: float
    inter_node_GBps: float


@dataclass(frozen=True)
class Prediction:
    """Seconds per step by part, and the figures a run logs."""

    gemm_s: float
    memory_bound_s: float
    tensor_comm_s: float
    pipe_comm_s: float
    bubble_s: float
    data_comm_s: float
    zero3_comm_s: float
    zero3_hidden_s: float  # subtracted: overlapped ZeRO-3 traffic
    gemm_efficiency: float
    hardware_flops: float
    model_flops: float
    gpus: int
    peak_tflops: float
    tokens_per_step: int
    gemm_flops: float = 0.0  # the matrix multiplies' FLOPs per step (the shape's real widths; see Workload.gemm_flops)
    engine_overhead_s: float = 0.0  # DeepSpeed's pipeline engine: its fixed cost per layer and micro-batch

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        parts = self.gemm_s + self.memory_bound_s + self.tensor_comm_s + self.pipe_comm_s + self.bubble_s
        parts += self.engine_overhead_s
        return parts + self.data_comm_s + self.zero3_comm_s - self.zero3_hidden_s

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU as GPT-NeoX logs it (``runtime/flops_per_sec_per_gpu``, with the 4/3)."""
        return self.hardware_flops / (self.step_s * self.gpus) / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (``K = 3``)."""
        return self.model_flops / (self.step_s * self.gpus * self.peak_tflops * 1e12)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation."""
        return self.tflops_per_gpu / self.peak_tflops

    @property
    def tokens_per_s(self) -> float:
        """Training throughput."""
        return self.tokens_per_step / self.step_s

    def to_dict(self) -> dict[str, float]:
        """Plain data, with the derived values."""
        derived = {"step_s": self.step_s, "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu}
        return {**asdict(self), **derived, "tokens_per_s": self.tokens_per_s}


def _ring(nbytes: float, n: int, gbps: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` ranks at ``gbps`` achieved (RS + AG: the same)."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / (gbps * 1e9)


def _activation_bytes(w: Workload) -> float:
    """Korthikanti et al.'s activation bytes of one layer and micro-batch on one TP rank (16-bit)."""
    s, b, h, a, t = w.seq_length, w.micro_batch, w.hidden_size, w.num_heads, w.tp
    scores = 0.0 if w.flash_attention else 5.0 * a * s / (h * t)
    replicated = 10.0 / t if w.sequence_parallel else 10.0
    return s * b * h * (replicated + 24.0 / t + scores) * w.param_bytes / 2


def predict(w: Workload, link: Link, placements: list[GroupPlacement], cal: Calibration | None = None) -> Prediction:
    """The calibrated step time of ``w`` on ``link`` with its groups placed as ``placements``."""
    cal = cal or Calibration()
    gpus = w.tp * w.pp * w.dp
    k = 4 if w.checkpoint_activations else 3
    hardware, model = w.flops(k), w.flops(3)  # what the run logs (GPT-NeoX's formula)
    # The busiest stage carries layers_per_stage of the layers (and its share of the logits).
    imbalance = w.layers_per_stage * w.pp / w.num_layers
    width = w.hidden_size / w.tp
    eff = cal.gemm_peak_fraction * width / (width + cal.gemm_knee)
    gemm = w.gemm_flops(k) / gpus * imbalance / (link.peak_tflops * 1e12 * eff)
    passes = k / 3.0
    layer_mb = w.layers_per_stage * w.gas  # layer x micro-batch slots on the rank per step
    memory = cal.activation_traffic * passes * _activation_bytes(w) * layer_mb / (link.hbm_GBps * 1e9)
    bw = {p.axis: link.intra_node_GBps if p.inside_node else link.inter_node_GBps for p in placements}
    bw = {axis: gbps * cal.bus_efficiency for axis, gbps in bw.items()}
    act = w.micro_batch * w.seq_length * w.hidden_size * w.param_bytes
    tensor = layer_mb * (6 if w.checkpoint_activations else 4) * _ring(act, w.tp, bw["tensor"])
    sent = act / w.tp if w.engine == "megatron-lm" else act  # Megatron-LM's scatter/gather
    pipe = 0.0 if w.pp == 1 else 2.0 * w.gas * sent / (bw["pipe"] * 1e9)
    overhead = w.engine_overhead_s(cal)
    per_micro_batch = (gemm + memory + tensor + pipe + overhead) / w.gas
    bubble = (w.pp - 1) * per_micro_batch
    grads = w.params_per_rank * w.param_bytes
    data = zero3 = hidden = 0.0
    if w.zero_stage == 3 and w.dp > 1:
        # forward, backward (+ recomputed forward; FSDP's recompute runs on the backward's gathered weights) ...
        gathers = 3 if w.checkpoint_activations and w.engine != "pytorch" else 2
        # ... each an all-gather, plus one reduce-scatter per micro-batch: (n-1)/n of the bytes each.
        full = _ring(grads, w.dp, bw["data"]) / 2
        hpz, mics = min(w.zero_hpz_partition_size, w.dp), w.zero_mics_shard_size
        if mics > 1:  # MiCS: every gather and reduce-scatter within the group; the shards all-reduced across groups
            zero3 = w.gas * (gathers + 1) * _ring(grads, mics, bw.get("zero_mics", bw["data"])) / 2
            data = _ring(grads / mics, w.dp // mics, bw.get("zero_replicas", bw["data"]))  # once per step
        elif hpz > 1:  # hpZ: the forward gathers and the reduce-scatter span DP, the later gathers the hpZ group
            zero3 = w.gas * (2 * full + (gathers - 1) * _ring(grads, hpz, bw.get("zero_hpz", bw["data"])) / 2)
        else:
            zero3 = w.gas * (gathers + 1) * full
        hidden = cal.overlap(w.engine) * min(zero3, gemm + memory)
    else:
        data = _ring(grads, w.dp, bw["data"])
    return Prediction(
        gemm_s=gemm,
        memory_bound_s=memory,
        tensor_comm_s=tensor,
        pipe_comm_s=pipe,
        bubble_s=bubble,
        data_comm_s=data,
        zero3_comm_s=zero3,
        zero3_hidden_s=hidden,
        gemm_efficiency=eff,
        hardware_flops=hardware,
        model_flops=model,
        gpus=gpus,
        peak_tflops=link.peak_tflops,
        tokens_per_step=w.train_batch * w.seq_length,
        gemm_flops=w.gemm_flops(k),
        engine_overhead_s=overhead,
    )
