"""The planner's layout knobs (megatron/planner/knobs.py, docs/planner.md#layout-knobs): hand-computed memory and
time terms per knob, the launch refusing what neox-forge cannot run, and the plan saying so."""

from __future__ import annotations

import json

import pytest

import deepy
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.planner.calibrated import (
    ACTIVATION_TRAFFIC,
    BUS_EFFICIENCY,
    GEMM_KNEE,
    GEMM_PEAK_FRACTION,
)

TINY = ["configs/cpu/tiny.yml", "--vocab-size", "512", "--checkpoint_activations", "false"]
# configs/20B.yml: h 6144, a 64, s 2048, micro-batch 4, TP 2, PP 4, fp16; 48 layers so that stages split in chunks
B20 = ["configs/20B.yml", "--vocab-size", "50277", "--num_layers", "48", "--checkpoint_activations", "false"]
S, H, A, B, T, L = 2048, 6144, 64, 4, 2, 48


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _predicted(plan: dict) -> dict:
    return plan["throughput"]["predicted"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("recompute_granularity", "selective"),
        ("num_layers_per_virtual_pipeline_stage", 1),
        ("context_parallel_size", 2),
    ],
)
def test_launch_refuses_plan_only_keys_and_the_plan_names_them(
    key: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=f"not supported yet: {key}={value!r}"):
        NeoXArgs.from_ymls(["configs/cpu/tiny.yml"], {key: value})
    assert deepy.main(["train.py", "configs/cpu/tiny.yml", f"--{key}", str(value)]) == 2  # a launch: one line
    out, err = capsys.readouterr()
    assert err.startswith(f"deepy.py: error: not supported yet: {key}=") and err.count("\n") == 1 and out == ""
    argv = [*TINY, "--num_gpus", "4", "--pipe_parallel_size", "2", f"--{key}", str(value)]
    plan = _plan(capsys, *argv)
    assert plan["knobs"]["not_runnable_by_neox_forge"] == [key]
    assert any(w.startswith(f"neox-forge cannot run {key} yet: planned only") for w in plan["warnings"])
    assert deepy.main(["--plan", "train.py", *argv]) == 0
    table = capsys.readouterr().out
    assert "(planned only: neox-forge cannot run it yet)" in table and f"layout knobs        {key} {value}" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recompute_granularity", "full"], "recompute_granularity='full': must be one of 'selective'"),
        (["--context_parallel_size", "0"], "context_parallel_size=0: must be >= 1"),
        (["--context_parallel_size", "3"], "--gpus 4 is not divisible by context_parallel_size 3"),
        (["--context_parallel_size", "4", "--seq_length", "36"], "seq_length 36 must divide into 2 x 4 chunks"),
        (["--num_layers_per_virtual_pipeline_stage", "1"], "needs pipe_parallel_size >= 2"),
        (["--pipe_parallel_size", "2", "--num_layers_per_virtual_pipeline_stage", "2"], "must divide the layers"),
        (
            ["--recompute_granularity", "selective", "--checkpoint_activations", "true"],
            "cannot be combined with checkpoint_activations: true",
        ),
        (["--context_parallel_size", "2", "--seq_length", "6", "--search"], "seq_length 6 must divide into 2 x 2"),
    ],
)
def test_bad_knobs_are_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, "--gpus", "4", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("deepy.py: error: ") and message in err and "Traceback" not in err and out == ""


def test_selective_recomputation_memory_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*B20, "--gpus", "96", "--sequence_parallel", "true"]
    full, sel = _plan(capsys, *argv), _plan(capsys, *argv, "--recompute_granularity", "selective")
    kept = [p["memory"]["per_rank"][0]["activations_per_micro_batch"]["no_checkpointing_kept"] for p in (full, sel)]
    layers = 12
    # Korthikanti et al.: s·b·h·(10/t + 24/t + 5·a·s/(h·t)) per layer with SP; selective keeps s·b·h·34/t
    assert kept[0] == pytest.approx(layers * S * B * H * (34 / T + 5 * A * S / (H * T)), abs=1)
    assert kept[1] == pytest.approx(layers * S * B * H * 34 / T, abs=1)
    p0, p1 = _predicted(full), _predicted(sel)
    assert p0["selective_recompute_s"] == 0.0
    # the attention core's forward again (4·s²·h FLOPs per layer and sample) at the GEMM pace ...
    core = 4 * S * S * H * L * 1536
    eff = GEMM_PEAK_FRACTION * (H / T) / (H / T + GEMM_KNEE)
    gemm = core / 96 / (312e12 * eff)
    # ... and a third (one forward) of the memory-bound traffic over the scores, 5·a·s²·b/t bytes per layer
    memory = ACTIVATION_TRAFFIC / 3 * 5 * A * S * S * B / T * layers * 32 / 1555e9
    assert p1["selective_recompute_s"] == pytest.approx(gemm + memory, rel=1e-12)
    assert p1["hardware_flops"] == pytest.approx(p0["hardware_flops"] + core, rel=1e-12)
    assert p1["model_flops"] == p0["model_flops"]
    up0, up1 = full["throughput"], sel["throughput"]  # the upper bound counts the same FLOPs at the peak
    assert up1["hardware_flops"] == pytest.approx(up0["hardware_flops"] + core, rel=1e-12)
    assert up1["compute_s"] == pytest.approx(up1["hardware_flops"] / (96 * 312e12), rel=1e-12)
    assert "4·B·s²·h·l" in sel["formulas"]["flops"] and "selective" in sel["formulas"]["activations_per_layer"]
    for part in ("gemm_s", "memory_bound_s", "tensor_comm_s", "pipe_comm_s", "data_comm_s"):
        assert p1[part] == p0[part]
    # the bubble: 3 of 32 micro-batch slots of everything the stage does, the recomputation included
    stage = ("gemm_s", "memory_bound_s", "tensor_comm_s", "pipe_comm_s", "engine_overhead_s")
    per_mb = sum(p1[k] for k in stage) + gemm + memory
    assert p1["bubble_s"] == pytest.approx(3 * per_mb / 32, rel=1e-12)


def test_sequence_parallelism_divides_the_norm_and_dropout_traffic_not_the_bytes_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = _predicted(_plan(capsys, *B20, "--gpus", "96"))
    sp = _predicted(_plan(capsys, *B20, "--gpus", "96", "--sequence_parallel", "true"))
    scores = 5 * A * S / (H * T)
    assert sp["memory_bound_s"] / plain["memory_bound_s"] == pytest.approx((34 / T + scores) / (10 + 24 / T + scores))
    assert sp["tensor_comm_s"] == plain["tensor_comm_s"]  # reduce-scatter + all-gather: the all-reduce's bytes


def test_interleaved_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    base = _plan(capsys, *B20, "--gpus", "96")
    inter = _plan(capsys, *B20, "--gpus", "96", "--num_layers_per_virtual_pipeline_stage", "6")  # 12 / 6: v = 2
    assert inter["layout"]["virtual_stages"] == 2
    # Megatron-LM's warm-up: 2·(p − i − 1) + (v − 1)·p chunks, + 1 in its backward; v·m at most
    assert [r["micro_batches_in_flight"] for r in inter["memory"]["per_rank"]] == [11, 9, 7, 5]
    r0, b0 = inter["memory"]["per_rank"][0], base["memory"]["per_rank"][0]
    kept = r0["activations_per_micro_batch"]["no_checkpointing_kept"]
    assert r0["activations"] == round(11 * kept / 2)  # stage 0: L·(1 + (p − 1)/(p·v)) layers' worth
    assert r0["activations"] == pytest.approx(b0["activations"] * (1 + 3 / 8), rel=1e-9)
    p0, p1 = _predicted(base), _predicted(inter)
    assert p1["pipe_comm_s"] == pytest.approx(2 * p0["pipe_comm_s"], rel=1e-12)
    u0, u1 = base["throughput"], inter["throughput"]
    assert u1["bubble_s"] == pytest.approx(u0["bubble_s"] / 2, rel=1e-12)
    stage = ("gemm_s", "memory_bound_s", "tensor_comm_s", "pipe_comm_s", "engine_overhead_s")
    per_mb = sum(p1[k] for k in stage) / 32
    assert p1["bubble_s"] == pytest.approx(3 * per_mb / 2, rel=1e-12)
    assert any("planned only" in w for w in inter["warnings"])


def test_context_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    one = _plan(capsys, *B20, "--gpus", "96")
    two = _plan(capsys, *B20, "--gpus", "192", "--context_parallel_size", "2")
    assert (two["layout"]["data_parallel"], two["layout"]["train_batch_size"]) == (12, 1536)
    groups = {g["axis"]: (g["size"], g["stride"]) for g in two["layout"]["groups"]}
    assert groups == {"tensor": (2, 1), "context": (2, 2), "pipe": (4, 48), "data": (12, 4)}
    m1, m2 = (p["memory"]["per_rank"][3]["activations_per_micro_batch"] for p in (one, two))
    for key, value in m1.items():  # every activation (and the logits) split over the 2 context ranks
        assert m2[key] == pytest.approx(value / 2, abs=1)
    r1, r2 = one["memory"]["per_rank"][0], two["memory"]["per_rank"][0]
    assert r2["optimizer_states"] == 8 * -(-r1["parameters"] // 2 // 24)  # ZeRO-1 over DP x CP = 24 ranks
    p1, p2 = _predicted(one), _predicted(two)
    for part in ("gemm_s", "memory_bound_s", "tensor_comm_s", "pipe_comm_s"):
        assert p2[part] == pytest.approx(p1[part] / 2, rel=1e-12)
    assert p2["engine_overhead_s"] == p1["engine_overhead_s"] > 0  # per layer and micro-batch, whatever the tokens
    assert p2["model_flops"] == p1["model_flops"] and p2["tokens_per_s"] > p1["tokens_per_s"]
    u1, u2 = one["throughput"], two["throughput"]
    assert u2["compute_s"] == pytest.approx(u1["compute_s"] / 2, rel=1e-12)
    assert u2["tensor_comm_s"] == pytest.approx(u1["tensor_comm_s"] / 2, rel=1e-12)
    # ring attention: each rank's K and V chunk (2·b·(s/c)·h/t elements, 16-bit) passes c − 1 times forward,
    # K/V and their gradients c − 1 times each backward, for 12 layers x 32 micro-batches, inside a node
    chunk = 2 * B * (S / 2) * H / T * 2
    assert p2["context_comm_s"] == pytest.approx(12 * 32 * 3 * 1 * chunk / (300e9 * BUS_EFFICIENCY), rel=1e-12)
    # the gradients (the busiest stage's rank) are reduced over DP x CP = 24 ranks 2 apart (across nodes)
    grads = max(one["parameters"]["per_rank_by_stage"]) * 2
    assert p2["data_comm_s"] == pytest.approx(2 * 23 / 24 * grads / (25e9 * BUS_EFFICIENCY), rel=1e-12)


def test_without_knobs_the_prediction_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.planner.calibrated import Link, Workload, predict
    from megatron.planner.knobs import predict_knobs, predict_placements
    from megatron.planner.plan import PlanInputs, workload

    args = NeoXArgs.from_ymls(["configs/20B.yml"], {"global_num_gpus": 96})
    setup = PlanInputs.from_neox_args(args, 50432).setup
    w: Workload = workload(setup, 2_500_000_000, 11)
    link = Link(312.0, 1555.0, 300.0, 25.0)
    plain = predict(w, link, predict_placements(2, 4, 12, 1, 8))
    knobs = predict_knobs(w, link, setup, 8)
    for key, value in plain.to_dict().items():
        assert knobs.to_dict()[key] == value, key
