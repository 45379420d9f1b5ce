"""Published runs the planner's constants are NOT fitted to, predicted out of sample (docs/planner.md, "FSDP on H100,
out of sample", "FSDP on A100, out of sample" and "The pipeline engine's cost per layer"): torchtitan on H100,
MosaicML's llm-foundry on A100 and H100 (tokens/s per GPU, converted with GPT-NeoX's formula,
:func:`~megatron.planner.published_runs.neox_tflops`), and BigScience's layout-sizing runs for BLOOM on DeepSpeed's
pipeline engine (TFLOP/s as logged)."""

from __future__ import annotations

from megatron.planner.published_runs import (
    A100_40GB_HBM,
    A100_80GB_HBM,
    JEAN_ZAY_OPA,
    NVLINK,
    PublishedRun,
    neox_tflops,
)

TORCHTITAN = (
    "torchtitan team, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan), Tables 1 and 3 (FSDP, eager, "
    "bf16); seq_len 8192 and selective_ac_option 'op' from train_configs/llama3_8b.toml at the commit it names, 9dec370"
)
LLM_FOUNDRY = (
    "MosaicML, llm-foundry scripts/train/benchmarking/README.md at 061f2c7 (mosaicml/llm-foundry), tables 'A100 40GB "
    "with 1600 Gbps node-node interconnect (RoCE)' and 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)': "
    "PyTorch FSDP FULL_SHARD, bf16, Throughput (T/s/GPU)"
)
BLOOM_SIZING = (
    "BigScience, train/tr11-176B-ml/chronicles-prequel.md at 9dcfdde (bigscience-workshop/bigscience): the tables of "
    "'48 node contenders' and 'Final round comparison' (02-21 to 02-23) with NHEADS 64 ('all NHEADS=64 (above too)'), "
    "TP 8, GBS 2048, sequence 2048, Megatron-DeepSpeed's TFLOPs after its formula fix (PR 251: Megatron-LM's, K = 4), "
    "second iteration"
)
H100_HBM = 3350.0  # H100 SXM 80 GB
GRAND_TETON_HBM = 2400.0  # torchtitan's H100: 96 GB HBM2e, 2.4 TB/s (its benchmark's hardware section)
H100_NVLINK = 450.0


LLAMA3_8B = (4096, 32, 128256)  # torchtitan's "8B" flavour: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336


def _torchtitan_8b(name: str, gpus: int, global_batch: int, tokens_per_s_per_gpu: float) -> PublishedRun:
    # Selective (op) recomputation saves every matmul output but every second one and recomputes the rest in the
    # backward: no full recomputed forward, so K = 3 here (the planner does not model the partial recompute).
    return PublishedRun(
        name,
        TORCHTITAN,
        4096,
        32,
        32,
        128256,
        1,
        1,
        gpus,
        2,
        global_batch,
        3,
        neox_tflops(tokens_per_s_per_gpu, LLAMA3_8B, 8192, 3),
        GRAND_TETON_HBM,
        50.0,
        "torchtitan",
        seq_length=8192,
        checkpoint_activations=False,
        note=f"quoted {tokens_per_s_per_gpu:,.0f} TPS/GPU; H100 96GB HBM2e at 500 W, 400 Gb/s RDMA per GPU (50 GB/s)",
        peak_tflops=989.0,
        nvlink_GBps=H100_NVLINK,
        kv_heads=8,
        mlp_widths=(2 * 14336, 14336),
        untied_embedding=True,
        flash_attention=True,
    )


MPT_VOCAB = 50368  # llm-foundry's MPT configs: vocab_size 50368, expansion_ratio 4, learned positions, biases
MPT_SHAPES = {"7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 56), "70b": (8192, 80, 64)}
ROCE_1600 = 25.0  # 1600 Gb/s per node of 8 GPUs: 25 GB/s per GPU


def _mpt(
    model: str,
    gpus: int,
    micro_accum: tuple[int, int],
    tokens_per_s_per_gpu: float,
    hbm: float,
    checkpoint: bool = True,
) -> PublishedRun:
    # The table's rows: sequence 2048, FULL_SHARD, flash attention (triton); K = 4 with activation checkpointing.
    # H100 rows: the table's "H100 80GB BF16" (989 TFLOP/s, HBM 3350 GB/s, NVLink 450 GB/s); single-node rows only,
    # so the network (which that table does not state) does not enter.
    (h, layers, heads), (micro, accum) = MPT_SHAPES[model], micro_accum
    h100 = hbm == H100_HBM  # the HBM bandwidth names the GPU
    gpu = "H100" if h100 else ("40 GB" if hbm == A100_40GB_HBM else "80 GB")
    return PublishedRun(
        f"MPT {model} FSDP {gpus} ({gpu})",
        LLM_FOUNDRY,
        h,
        layers,
        heads,
        MPT_VOCAB,
        1,
        1,
        gpus,
        micro,
        micro * accum * gpus,
        3,
        neox_tflops(tokens_per_s_per_gpu, (h, layers, MPT_VOCAB), 2048, 4 if checkpoint else 3),
        hbm,
        ROCE_1600,
        "llm-foundry",
        checkpoint_activations=checkpoint,
        note=f"quoted {tokens_per_s_per_gpu:,.0f} T/s/GPU, micro-batch {micro} x {accum} accumulated",
        peak_tflops=989.0 if h100 else 312.0,
        nvlink_GBps=H100_NVLINK if h100 else NVLINK,
        flash_attention=True,
    )


# Published FSDP runs that the constants are NOT fitted to: predicted out of sample (docs/planner.md,
# "Calibration"). On H100 the A100-fitted GEMM pace over-predicts them (the source cannot state its GPUs' peak).
TORCHTITAN_RUNS: tuple[PublishedRun, ...] = (
    _torchtitan_8b("torchtitan Llama 3 8B FSDP 8", 8, 16, 5762.0),
    _torchtitan_8b("torchtitan Llama 3 8B FSDP 128", 128, 256, 5605.0),
)
# llm-foundry's A100 rows of models of 7B parameters and more on 16 GPUs or more (more than one node), sequence 2048.
FSDP_A100_RUNS: tuple[PublishedRun, ...] = (
    _mpt("70b", 128, (4, 1), 376.0, A100_40GB_HBM),
    _mpt("70b", 64, (2, 1), 276.0, A100_40GB_HBM),
    _mpt("30b", 128, (6, 1), 865.0, A100_40GB_HBM),
    _mpt("30b", 32, (4, 1), 857.0, A100_40GB_HBM),
    _mpt("13b", 128, (16, 1), 1972.0, A100_40GB_HBM),
    _mpt("13b", 64, (16, 1), 1976.0, A100_40GB_HBM),
    _mpt("13b", 32, (14, 1), 1998.0, A100_40GB_HBM),
    _mpt("13b", 16, (10, 1), 1993.0, A100_40GB_HBM),
    _mpt("7b", 128, (18, 1), 3623.0, A100_40GB_HBM),
    _mpt("7b", 64, (18, 1), 3665.0, A100_40GB_HBM),
    _mpt("7b", 32, (18, 1), 3725.0, A100_40GB_HBM),
    _mpt("7b", 16, (16, 1), 3645.0, A100_40GB_HBM),
    _mpt("70b", 64, (8, 4), 410.0, A100_80GB_HBM),
    _mpt("70b", 32, (2, 16), 373.0, A100_80GB_HBM),
)
# Single-node rows (8 GPUs, NVLink only) of the same tables at sequence 2048: the compute pace on A100 and on H100.
FSDP_NODE_RUNS: tuple[PublishedRun, ...] = (
    _mpt("30b", 8, (3, 21), 916.0, A100_80GB_HBM),
    _mpt("13b", 8, (2, 3), 2262.0, A100_80GB_HBM, checkpoint=False),
    _mpt("7b", 8, (6, 2), 4641.0, A100_80GB_HBM, checkpoint=False),
    _mpt("30b", 8, (3, 21), 2002.0, H100_HBM),
    _mpt("13b", 8, (2, 1), 4792.0, H100_HBM, checkpoint=False),
    _mpt("7b", 8, (6, 1), 10643.0, H100_HBM, checkpoint=False),
)


def _bloom_sizing(shape: tuple[int, int], dp: int, pp: int, micro: int, tflops: float) -> PublishedRun:
    # BLOOM's hardware (Jean Zay, nodes of 8 A100 80GB) and stack (Megatron-DeepSpeed, DeepSpeed's pipeline engine,
    # ZeRO-1), layers split evenly; vocabulary 250,680 padded to a multiple of 128 x TP: 250,880.
    hidden, layers = shape
    return PublishedRun(
        f"BLOOM sizing h {hidden} L {layers} PP {pp} DP {dp} micro-batch {micro}",
        BLOOM_SIZING,
        hidden,
        layers,
        64,
        250880,
        8,
        pp,
        8 * pp * dp,
        micro,
        2048,
        1,
        tflops,
        A100_80GB_HBM,
        JEAN_ZAY_OPA,
        "megatron-deepspeed",
        note=f"quoted {tflops} TFLOPs",
    )


# BigScience's sweep to choose BLOOM's layout, on its nodes and stack (docs/planner.md, "The pipeline engine's cost per
# layer"): BLOOM's shape at micro-batch 1 to 8 (02-21), then other hidden sizes of about the same model size (02-21,
# 02-23; their repeats of BLOOM's shape left out). Not used: the 02-20 tables (hidden size 14400, before the TFLOPs
# formula fix), the head-count tables (kernel selection, which the model does not see) and the 40-node row of 02-21,
# whose DP 8 x TP 8 x PP 10 is 80 nodes (its text says 320 GPUs: DP 4).
BLOOM_SHAPE = (14336, 72)
BLOOM_SIZING_RUNS: tuple[PublishedRun, ...] = (
    _bloom_sizing(BLOOM_SHAPE, 4, 12, 1, 112.49),
    _bloom_sizing(BLOOM_SHAPE, 4, 12, 2, 120.29),
    _bloom_sizing(BLOOM_SHAPE, 4, 12, 4, 130.34),
    _bloom_sizing(BLOOM_SHAPE, 4, 12, 8, 124.72),
    _bloom_sizing(BLOOM_SHAPE, 8, 6, 1, 115.31),
    _bloom_sizing(BLOOM_SHAPE, 8, 6, 2, 123.05),
    _bloom_sizing(BLOOM_SHAPE, 8, 6, 4, 132.71),
    _bloom_sizing((13824, 84), 4, 12, 2, 121.45),
    _bloom_sizing((13824, 84), 4, 12, 4, 131.27),
    _bloom_sizing((13824, 84), 8, 6, 2, 123.58),
    _bloom_sizing((13824, 84), 8, 6, 4, 134.11),
    _bloom_sizing((12288, 96), 8, 6, 2, 115.73),
    _bloom_sizing((12288, 96), 8, 6, 4, 128.69),
    _bloom_sizing((13312, 84), 4, 12, 4, 129.29),
    _bloom_sizing((13312, 84), 8, 6, 2, 119.72),
    _bloom_sizing((13312, 84), 8, 6, 4, 132.00),
    _bloom_sizing((13824, 78), 8, 6, 4, 133.93),
)
VALIDATION_RUNS: tuple[PublishedRun, ...] = TORCHTITAN_RUNS + FSDP_A100_RUNS + FSDP_NODE_RUNS + BLOOM_SIZING_RUNS
