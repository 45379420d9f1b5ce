"""``deepy.py --plan --framework``: whose engine the calibrated prediction applies (issue 37)."""

from __future__ import annotations

import json
import math

import pytest

import deepy
from megatron.planner.calibrated import DEFAULT_FRAMEWORK, FRAMEWORKS, Calibration
from megatron.planner.published_runs import PUBLISHED_RUNS

NEOX_20B = ["configs/20B.yml", "--gpus", "96", "--vocab-size", "50277", "--inter-node-GBps", "12.5"]


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *NEOX_20B, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_is_neox_forge_and_other_engines_also_give_neox_forges_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert DEFAULT_FRAMEWORK == "neox-forge" and FRAMEWORKS[DEFAULT_FRAMEWORK] == "deepspeed"
    ours = _plan(capsys)["throughput"]
    assert ours["predicted"]["framework"] == "neox-forge" and "predicted_neox_forge" not in ours
    megatron = _plan(capsys, "--framework", "megatron-lm")["throughput"]
    assert megatron["predicted"]["framework"] == "megatron-lm"
    same = {k: v for k, v in ours["predicted"].items() if k != "framework"}
    assert megatron["predicted_neox_forge"] == same  # neox-forge on the same layout, unchanged
    # Megatron-LM's loop: no per-layer engine cost, scatter/gather pipeline sends (1/TP of the bytes).
    per_layer = Calibration().pipeline_layer_overhead_s
    assert ours["predicted"]["engine_overhead_s"] == pytest.approx(
        per_layer * 11 * 32
    )  # 44 layers / 4 stages, 32 micro-batches
    assert megatron["predicted"]["engine_overhead_s"] == 0.0
    assert megatron["predicted"]["gemm_s"] == pytest.approx(ours["predicted"]["gemm_s"])
    assert megatron["predicted"]["pipe_comm_s"] == pytest.approx(ours["predicted"]["pipe_comm_s"] / 2)
    assert megatron["predicted"]["tflops_per_gpu"] > ours["predicted"]["tflops_per_gpu"]
    table = capsys_table(capsys, "--framework", "megatron-lm")
    assert "(calibrated, megatron-lm's engine)" in table and "neox-forge          " in table


def capsys_table(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert deepy.main(["--plan", "train.py", *NEOX_20B, *argv]) == 0
    return capsys.readouterr().out


def test_gpt_neox_framework_reproduces_the_published_20b_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner on configs/20B.yml with GPT-NeoX's engine and partition predicts what the calibration row does
    (the row counts parameters as 12·h² per layer + embedding, the plan exactly: within 1 %)."""
    row = next(r for r in PUBLISHED_RUNS if r.name == "GPT-NeoX-20B")
    assert row.framework == "gpt-neox" and row.workload().layers_per_stage == 12  # GPT-NeoX's split of 44 over 4
    plan = _plan(capsys, "--framework", "gpt-neox", "--pipe_partition_method", "type:transformer|mlp")
    assert plan["parameters"]["layers_by_stage"] == [11, 12, 11, 10]
    assert plan["throughput"]["predicted"]["tflops_per_gpu"] == pytest.approx(row.predict().tflops_per_gpu, rel=0.01)


def test_every_published_run_names_a_known_framework() -> None:
    assert {r.framework for r in PUBLISHED_RUNS} <= set(FRAMEWORKS) - {DEFAULT_FRAMEWORK}


def test_unknown_framework_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        deepy.main(["--plan", "train.py", *NEOX_20B, "--framework", "fsdp2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--framework: invalid choice: 'fsdp2'" in err and "megatron-lm" in err


@pytest.mark.parametrize(
    "shape",
    [
        {},  # plain GeLU 4h MLP, one key/value head per query head: GPT-NeoX's formula exactly
        {"activation": "swiglu", "intermediate_size": 512},
        {"num_kv_heads": 2},
        {"activation": "swiglu", "num_kv_heads": 2, "intermediate_size": 384, "mlp_multiple_of": 32},
    ],
    ids=["plain", "swiglu", "gqa", "swiglu-gqa"],
)
def test_gemm_flops_count_the_real_mlp_width_and_kv_heads(shape: dict) -> None:
    """The layer ratio equals the model's own matmul weights counted on the meta device: forward FLOPs per token
    = 2 × (weights of the layer's linear maps) + 4·s·h for the attention scores."""
    from megatron.model.config import GPTModelConfig
    from megatron.model.meta import meta_param_shapes
    from megatron.planner.calibrated import Workload

    h, s, a = 64, 128, 8
    cfg = GPTModelConfig(
        **{"num_layers": 2, "hidden_size": h, "num_attention_heads": a, "padded_vocab_size": 128, **shape},
        max_position_embeddings=s,
        pos_emb="rotary",
    )
    weights = sum(
        math.prod(dims)
        for name, dims in meta_param_shapes(cfg).items()
        if name.startswith("sequential.2.") and name.endswith(".weight") and len(dims) == 2
    )
    common = dict(num_layers=2, seq_length=s, padded_vocab_size=128, tp=1, pp=1, dp=1, micro_batch=1, gas=1)
    w = Workload(
        hidden_size=h,
        num_heads=a,
        **common,
        checkpoint_activations=True,
        zero_stage=0,
        params_per_rank=1,
        layers_per_stage=2,
        kv_heads=cfg.num_kv_heads or a,
        mlp_widths=cfg.mlp_sizes,
    )
    assert w.layer_flops_ratio() == pytest.approx((2 * weights + 4 * s * h) / (24 * h * h + 4 * s * h), rel=1e-12)
    layer_part = 4 * s * 2 * (24 * h * h + 4 * s * h)  # K = 4, b·s = s, 2 layers
    assert w.gemm_flops(4) == pytest.approx(w.flops(4) + layer_part * (w.layer_flops_ratio() - 1), rel=1e-12)
    if not shape:
        assert w.layer_flops_ratio() == pytest.approx(1.0) and w.gemm_flops(4) == w.flops(4)


def test_plan_of_a_gqa_swiglu_config_times_its_real_gemms(capsys: pytest.CaptureFixture[str]) -> None:
    """configs/mistral/7B.yml (8 of 32 key/value heads, a SwiGLU MLP GPT-NeoX sizes at 2/3 of intermediate_size):
    fewer GEMM FLOPs than the logged formula, so the logged TFLOP/s is above the real one."""
    argv = ["configs/mistral/7B.yml", "--gpus", "8", "--vocab-size", "32000", "--train_micro_batch_size_per_gpu", "4"]
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["throughput"]["predicted"]
    assert 0.3 < p["gemm_flops"] / p["hardware_flops"] < 0.9
    real = p["gemm_flops"] / (p["step_s"] * 8) / 1e12
    assert real < p["tflops_per_gpu"] < 312
