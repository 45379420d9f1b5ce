"""Published large training runs with their full layouts and measured throughput: the planner's calibration set.

Every figure is from the cited paper, table or training script. ``published_tflops`` is the achieved hardware
TFLOP/s per GPU counted with the formula GPT-NeoX logs (``24·K·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``, ``K = 4`` with
full activation recomputation; Megatron-LM's Eq. 3 is this formula with ``K = 4``): as the source reports it for the
runs with full recomputation but Korthikanti et al.'s, whose quoted seconds per iteration are converted
(:func:`step_tflops`; their selective-recomputation runs at ``K = 3`` plus the recomputed attention core, as the
planner counts them). Hardware per run: A100 (312 TFLOP/s fp16/bf16), HBM 1555 GB/s (40 GB) or 2039 GB/s (80 GB),
NVLink 300 GB/s per direction, and the per-GPU share of the node's network cards.

:mod:`~megatron.planner.validation_runs` holds published FSDP runs the constants are not fitted to (torchtitan on H100,
MosaicML's llm-foundry on A100): the sources quote tokens/s per GPU, converted with the same formula
(:func:`neox_tflops`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.planner.calibrated import FRAMEWORKS, Calibration, Link, Prediction, Workload
from megatron.planner.knobs import predict_knobs
from megatron.planner.partition import gpt_neox_layers_per_stage

A100_40GB_HBM = 1555.0
A100_80GB_HBM = 2039.0
NVLINK = 300.0
SELENE_IB = 25.0  # 8 x 200 Gb/s HDR InfiniBand per DGX A100 node: 25 GB/s per GPU
JEAN_ZAY_OPA = 6.25  # BLOOM's nodes: 4 x 100 Gb/s Omni-Path per node of 8 GPUs

NEOX_PAPER = "Black et al. 2022, GPT-NeoX-20B (arXiv:2204.06745), §3 and §3.1 (hardware)"
MEGATRON_T1 = "Narayanan et al. 2021, Efficient Large-Scale LM Training on GPU Clusters (arXiv:2104.04473), Table 1"
MEGATRON_T2 = "Narayanan et al. 2021 (arXiv:2104.04473), Table 2 (PTD-P vs ZeRO-3, §5.2)"
MTNLG = "Smith et al. 2022, Megatron-Turing NLG 530B (arXiv:2201.11990), §2.4"
BLOOM = (
    "BigScience 2022, BLOOM (arXiv:2211.05100) §3.4 / BigScience 176B model page ('about 150 TFLOPs'); layout from "
    "bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm"
)
KORTHIKANTI = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models (arXiv:2205.05198), "
    "Tables 3 and 5, §6 and §6.3"
)
AZURE = (
    "DeepSpeed team 2022, 'Azure empowers easy-to-use, high-performance, and hyperscale model training using "
    "DeepSpeed', docs/_posts/2022-07-26-deepspeed-azure.md (deepspeedai/DeepSpeed): text and Figure 6's data labels; "
    "layout from its recipe (examples/azure/run-1t.sh: ZeRO-3, no tensor or pipeline parallelism, "
    "--no-pipeline-parallel, gradient_accumulation_steps 1, fp16, activation checkpointing, GPT-2 vocabulary)"
)


@dataclass(frozen=True)
class PublishedRun:
    """One published run: shape, layout, hardware and its measured hardware TFLOP/s per GPU."""

    name: str
    source: str
    hidden_size: int
    num_layers: int
    num_heads: int
    padded_vocab_size: int
    tp: int
    pp: int
    gpus: int
    micro_batch: int
    train_batch: int
    zero_stage: int
    published_tflops: float
    hbm_GBps: float
    inter_node_GBps: float
    framework: str  # a key of calibrated.FRAMEWORKS: gpt-neox, megatron-deepspeed, megatron-lm, torchtitan, ...
    seq_length: int = 2048
    checkpoint_activations: bool = True
    micro_batch_stated: bool = True  # False: the source leaves it open (it does not change a TP-only prediction)
    note: str = ""
    peak_tflops: float = 312.0  # dense 16-bit peak (A100; H100 SXM 989)
    nvlink_GBps: float = NVLINK
    kv_heads: int = 0  # GQA key/value heads; 0: one per query head
    mlp_widths: tuple[int, int] = (0, 0)  # (linear1 out, linear2 in); (0, 0): plain 4h (SwiGLU: (2f, f))
    untied_embedding: bool = False  # separate output layer (Llama): twice the embedding's parameters
    pipeline_engine: bool = True  # DeepSpeed's PipelineEngine (False: Megatron-DeepSpeed's --no-pipeline-parallel)
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states on the CPU (memory only; not in the step time)
    checkpoint_in_cpu: bool = False  # activation checkpoints kept in host memory (memory only)
    flash_attention: bool = False
    # Layout knobs (megatron/planner/knobs.py; the names TrainingSetup reads them under)
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # "selective": Megatron-LM's selective recomputation
    num_layers_per_virtual_pipeline_stage: int | None = None  # interleaved 1F1B schedule
    context_parallel_size: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.gpus // (self.tp * self.pp)

    @property
    def gas(self) -> int:
        """Micro-batches per step per pipeline."""
        return self.train_batch // (self.micro_batch * self.dp)

    def workload(self) -> Workload:
        """The run as the predictor reads it (parameters per rank from the shape: 12·h² per layer + embedding)."""
        # GPT-NeoX's default partition can put a layer more on one stage; the others split layers evenly.
        even = math.ceil(self.num_layers / self.pp)
        layers = gpt_neox_layers_per_stage(self.num_layers, self.pp) if self.framework == "gpt-neox" else even
        h = self.hidden_size
        w1, w2 = self.mlp_widths if self.mlp_widths[0] else (4 * h, 4 * h)
        per_layer = 2 * h * h + 2 * h * h * (self.kv_heads or self.num_heads) // self.num_heads + h * (w1 + w2)
        embedding = self.padded_vocab_size * h * (2 if self.untied_embedding else 1)
        params = (per_layer * layers + embedding) // self.tp
        return Workload.of(
            self,
            pp=self.pp,
            params_per_rank=params,
            layers_per_stage=layers,
            engine=FRAMEWORKS[self.framework],
            kv_heads=self.kv_heads,
            mlp_widths=self.mlp_widths,
            flash_attention=self.flash_attention,
            sequence_parallel=self.sequence_parallel,
            pipeline_engine=self.pipeline_engine,
        )

    def predict(self, cal: Calibration | None = None) -> Prediction:
        """The planner's prediction for this run (with its layout knobs; without, :func:`calibrated.predict`'s)."""
        link = Link(self.peak_tflops, self.hbm_GBps, self.nvlink_GBps, self.inter_node_GBps)
        return predict_knobs(self.workload(), link, self, 8, cal)


def _megatron_t1(
    name: str, h: int, layers: int, heads: int, tp: int, gpus: int, batch: int, tflops: float
) -> PublishedRun:
    return PublishedRun(
        name,
        MEGATRON_T1,
        h,
        layers,
        heads,
        51200,
        tp,
        1,
        gpus,
        1,
        batch,
        0,
        tflops,
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-lm",
        micro_batch_stated=False,
    )


def _megatron_t2(
    name: str,
    shape: tuple[int, int, int],
    tp_pp: tuple[int, int],
    gpus: int,
    mb: int,
    batch: int,
    zero: int,
    tflops: float,
) -> PublishedRun:
    h, layers, heads = shape
    return PublishedRun(
        name,
        MEGATRON_T2,
        h,
        layers,
        heads,
        51200,
        tp_pp[0],
        tp_pp[1],
        gpus,
        mb,
        batch,
        zero,
        tflops,
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-lm",
    )


GPT3 = (12288, 96, 96)
MT530 = (20480, 105, 128)
K22B, K1T = (6144, 48, 64), (25600, 128, 160)
AZURE_SHAPES = {"175B": GPT3, "530B": MT530, "1T": K1T, "2T": (32768, 160, 128)}  # the post's Table 2


def _azure(model: str, gpus: int, micro: int, seq: int, tflops: float) -> PublishedRun:
    # NDm A100 v4: 8 A100 80GB per VM, one 200 Gb/s HDR InfiniBand link per GPU (25 GB/s). The quoted TFLOP/s use
    # Megatron-LM's formula with K = 4, as here. The optimizer states and activation checkpoints are offloaded to the
    # CPU: the plan counts them in host memory; the step time leaves out the CPU optimizer step, a small share of
    # these minutes-long steps.
    h, layers, heads = AZURE_SHAPES[model]
    return PublishedRun(
        f"Azure ZeRO-3 {model} {gpus}",
        AZURE,
        h,
        layers,
        heads,
        50304,
        1,
        1,
        gpus,
        micro,
        micro * gpus,
        3,
        tflops,
        A100_80GB_HBM,
        25.0,
        "megatron-deepspeed",
        seq_length=seq,
        note=f"quoted {tflops} TFLOPs/GPU, micro-batch {micro}, sequence {seq}; ZeRO-3 + CPU optimizer offload",
        pipeline_engine=False,
        offload_optimizer=True,
        checkpoint_in_cpu=True,
    )


def neox_tflops(tokens_per_s_per_gpu: float, shape: tuple[int, int, int], seq: int, k: int) -> float:
    """TFLOP/s per GPU under GPT-NeoX's formula (hidden, layers, vocabulary ``shape``; ``k`` 3, or 4 with full
    recomputation) of a throughput quoted in tokens/s per GPU."""
    h, layers, vocab = shape
    per_token = 24.0 * k * layers * h * h * (1.0 + seq / (6.0 * h) + vocab / (16.0 * layers * h))
    return tokens_per_s_per_gpu * per_token / 1e12


def step_tflops(seconds: float, shape: tuple[int, int, int], gpus: int, batch: int, selective: bool) -> float:
    """TFLOP/s per GPU of a run quoted as seconds per iteration, counted as the planner logs it (hidden, layers,
    vocabulary ``shape``; ``s`` 2048): GPT-NeoX's formula with ``K = 4`` (full recomputation) or ``K = 3`` plus the
    recomputed attention core ``4·B·s²·h·l`` (selective recomputation, :mod:`~megatron.planner.knobs`)."""
    h, layers, vocab = shape
    s, k = 2048.0, 3 if selective else 4
    flops = 24.0 * k * batch * s * layers * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * layers * h))
    flops += 4.0 * batch * s * s * h * layers if selective else 0.0
    return flops / (seconds * gpus) / 1e12


def _korthikanti(
    name: str,
    shape: tuple[int, int, int],
    tp_pp_gpus: tuple[int, int, int],
    batch: tuple[int, int],
    layers_per_chunk: int | None,
    seconds: float,
    selective: bool,
) -> PublishedRun:
    # Table 5 compares "Present Work" (sequence parallelism + selective recomputation) with "Full Recompute"
    # (§6.3: "full recomputation without sequence parallelism"); Table 3's layouts, Megatron-LM, Selene.
    (h, layers, heads), (tp, pp, gpus), (micro, global_batch) = shape, tp_pp_gpus, batch
    return PublishedRun(
        name,
        KORTHIKANTI,
        h,
        layers,
        heads,
        51200,
        tp,
        pp,
        gpus,
        micro,
        global_batch,
        0,
        step_tflops(seconds, (h, layers, 51200), gpus, global_batch, selective),
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-lm",
        checkpoint_activations=not selective,
        note=f"quoted {seconds} s per iteration, " + ("SP + selective" if selective else "full recomputation, no SP"),
        sequence_parallel=selective,
        recompute_granularity="selective" if selective else None,
        num_layers_per_virtual_pipeline_stage=layers_per_chunk,
    )


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "GPT-NeoX-20B",
        NEOX_PAPER,
        6144,
        44,
        64,
        50432,
        2,
        4,
        96,
        4,
        1536,
        1,
        117.0,
        A100_40GB_HBM,
        12.5,
        "gpt-neox",
        note="12 nodes of 8 A100-SXM4-40GB, 4 ConnectX-6 HDR cards per node (12.5 GB/s per GPU); fp16",
    ),
    _megatron_t1("Megatron 1.7B", 2304, 24, 24, 1, 32, 512, 137.0),
    _megatron_t1("Megatron 3.6B", 3072, 30, 32, 2, 64, 512, 138.0),
    _megatron_t1("Megatron 7.5B", 4096, 36, 32, 4, 128, 512, 142.0),
    _megatron_t1("Megatron 18.4B", 6144, 40, 48, 8, 256, 1024, 135.0),
    _megatron_t2("Megatron 175B PTD-P 384", GPT3, (8, 12), 384, 1, 1536, 0, 153.0),
    _megatron_t2("Megatron 175B PTD-P 768", GPT3, (8, 12), 768, 1, 1536, 0, 149.0),
    _megatron_t2("Megatron 175B PTD-P 1536", GPT3, (8, 12), 1536, 1, 1536, 0, 141.0),
    _megatron_t2("Megatron 530B PTD-P 560", MT530, (8, 35), 560, 1, 2240, 0, 171.0),
    _megatron_t2("Megatron 530B PTD-P 1120", MT530, (8, 35), 1120, 1, 2240, 0, 167.0),
    _megatron_t2("Megatron 530B PTD-P 2240", MT530, (8, 35), 2240, 1, 2240, 0, 159.0),
    _megatron_t2("ZeRO-3 175B 384", GPT3, (1, 1), 384, 4, 1536, 3, 144.0),
    _megatron_t2("ZeRO-3 175B 768", GPT3, (1, 1), 768, 2, 1536, 3, 88.0),
    _megatron_t2("ZeRO-3 175B 1536", GPT3, (1, 1), 1536, 1, 1536, 3, 44.0),
    _megatron_t2("ZeRO-3 530B 640", MT530, (1, 1), 640, 4, 2560, 3, 138.0),
    _megatron_t2("ZeRO-3 530B 1280", MT530, (1, 1), 1280, 2, 2560, 3, 98.0),
    _megatron_t2("ZeRO-3 530B 2560", MT530, (1, 1), 2560, 1, 2560, 3, 48.0),
    PublishedRun(
        "MT-NLG 530B 2240",
        MTNLG,
        20480,
        105,
        128,
        51200,
        8,
        35,
        2240,
        1,
        1920,
        1,
        126.0,
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-deepspeed",
    ),
    PublishedRun(
        "MT-NLG 530B 2800",
        MTNLG,
        20480,
        105,
        128,
        51200,
        8,
        35,
        2800,
        1,
        1920,
        1,
        121.0,
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-deepspeed",
    ),
    PublishedRun(
        "MT-NLG 530B 3360",
        MTNLG,
        20480,
        105,
        128,
        51200,
        8,
        35,
        3360,
        1,
        1920,
        1,
        113.0,
        A100_80GB_HBM,
        SELENE_IB,
        "megatron-deepspeed",
    ),
    PublishedRun(
        "BLOOM-176B",
        BLOOM,
        14336,
        70,
        112,
        250880,
        4,
        12,
        384,
        2,
        2048,
        1,
        150.0,
        A100_80GB_HBM,
        JEAN_ZAY_OPA,
        "megatron-deepspeed",
        note="Jean Zay: 4 x 100 Gb/s Omni-Path per node (6.25 GB/s per GPU); bf16 (DeepSpeed's BF16 optimizer = ZeRO-1)",
    ),
    # Korthikanti et al. 2022 (docs/planner.md, "Runs with layout knobs"): data-parallel size 1 but the last row;
    # 3 interleaved stages ("m = 3") for 175B and 530B: 4 and 1 layers per model chunk.
    _korthikanti("Korthikanti 22B SP+selective", K22B, (8, 1, 8), (4, 4), None, 1.10, True),
    _korthikanti("Korthikanti 22B full", K22B, (8, 1, 8), (4, 4), None, 1.42, False),
    _korthikanti("Korthikanti 175B SP+selective", GPT3, (8, 8, 64), (1, 64), 4, 13.75, True),
    _korthikanti("Korthikanti 175B full", GPT3, (8, 8, 64), (1, 64), 4, 18.13, False),
    _korthikanti("Korthikanti 530B SP+selective", MT530, (8, 35, 280), (1, 280), 1, 37.83, True),
    _korthikanti("Korthikanti 530B full", MT530, (8, 35, 280), (1, 280), 1, 49.05, False),
    _korthikanti("Korthikanti 1T SP+selective", K1T, (8, 64, 512), (1, 512), None, 71.49, True),
    _korthikanti("Korthikanti 1T full", K1T, (8, 64, 512), (1, 512), None, 94.42, False),
    _korthikanti("Korthikanti 530B SP+selective DP 8", MT530, (8, 35, 2240), (1, 2240), 1, 39.15, True),
    _azure("175B", 256, 32, 512, 204.49),
    _azure("530B", 512, 8, 1024, 170.42),
    _azure("530B", 1024, 8, 1024, 171.37),
    _azure("1T", 1024, 8, 1024, 165.36),
    _azure("2T", 1024, 8, 1024, 157.0),
)
