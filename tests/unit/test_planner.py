"""``deepy.py --plan``: the GPT-NeoX-20B numbers, the memory/layout models, warnings and bad input."""

from __future__ import annotations

import json

import pytest

import deepy
from megatron.logging.flops import FlopsConfig, flops_per_iteration
from megatron.neox_arguments import NeoXArgs
from megatron.planner import TrainingSetup, parse_bytes
from megatron.planner.layout import group_placements
from megatron.planner.memory import bytes_per_param

TINY = ["configs/cpu/tiny.yml", "--vocab-size", "512"]


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_20b_plan_matches_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_json(capsys, "configs/20B.yml", "--gpus", "96")
    assert round(plan["parameters"]["total"] / 1e9, 2) == 20.55
    mem = plan["memory"]
    assert mem["training_state_bytes"] == pytest.approx(320e9, rel=0.05)  # 16 bytes per parameter
    assert round(mem["weights_16bit_bytes"] / 1e9) == 41
    assert mem["kv_cache"]["batch"] == 1 and mem["kv_cache"]["tokens"] == 2048
    assert mem["kv_cache"]["bytes"] == pytest.approx(2.2e9, rel=0.05)
    layout = plan["layout"]
    assert (layout["tensor_parallel"], layout["pipeline_stages"], layout["data_parallel"]) == (2, 4, 12)
    assert layout["zero_stage"] == 1 and layout["gpus"] == 96 and layout["train_batch_size"] == 1536
    groups = {g["axis"]: g for g in layout["groups"]}
    assert groups["tensor"]["inside_node"] and groups["pipe"]["nodes_spanned"] == 4
    # Per rank: an eighth of the model (TP 2 x PP 4), ZeRO-1 shards master weights and Adam over 12 ranks.
    ranks = mem["per_rank"]
    assert sum(plan["parameters"]["per_rank_by_stage"]) * 2 == pytest.approx(20.55e9, rel=0.01)
    for rank, params in zip(ranks, plan["parameters"]["per_rank_by_stage"], strict=True):
        assert rank["parameters"] == rank["gradients"] == 2 * params
        assert rank["optimizer_states"] == 2 * rank["master_weights"] == 8 * -(-params // 12)
    assert [r["micro_batches_in_flight"] for r in ranks] == [4, 3, 2, 1]
    assert mem["fits"] and max(r["total"] for r in ranks) < 40e9
    # FLOPs: the training loop's own formula.
    args = NeoXArgs.from_ymls(["configs/20B.yml"], {"global_num_gpus": 96})
    args.update_value("padded_vocab_size", 50432)
    assert plan["throughput"]["model_flops"] == flops_per_iteration(FlopsConfig.from_neox_args(args), 3)
    assert plan["throughput"]["hardware_flops"] == flops_per_iteration(FlopsConfig.from_neox_args(args), 4)
    assert 0.3 < plan["throughput"]["mfu"] < 0.75
    assert any("tokenizer not readable" in w for w in plan["warnings"])
    assert any("pipeline groups span 4 nodes" in w for w in plan["warnings"])
    # The table says the same.
    assert deepy.main(["--plan", "train.py", "configs/20B.yml", "--gpus", "96"]) == 0
    table = capsys.readouterr().out
    for fragment in ("20.55B", "ZeRO-1 over 12 DP ranks", "TP 2 x PP 4 x DP 12", "KV cache            2.21 GB"):
        assert fragment in table, table


def test_bytes_per_param_follow_deepspeed() -> None:
    args = NeoXArgs.from_ymls(["configs/cpu/tiny.yml"], {"global_num_gpus": 2})
    args.update_value("padded_vocab_size", 512)
    base = TrainingSetup.from_neox_args(args)

    def layout(**kw: object) -> tuple:
        b = bytes_per_param(base.__class__(**{**base.__dict__, **kw}))
        return (b.weights, b.grads, b.master, b.states, b.grads_sharded, b.master_sharded)

    assert layout(precision="fp32", zero_stage=0) == (4, 4, 0, 8, False, False)
    assert layout(precision="fp32", zero_stage=1) == (4, 4, 4, 8, False, True)  # ZeRO-1/2 copy the partition
    # ZeRO-3 steps the fp32 parameter partition itself (megatron/training/deepspeed_adapter.py, item 7)
    assert layout(precision="fp32", zero_stage=3) == (4, 4, 0, 8, True, True)
    assert layout(precision="fp16", zero_stage=0) == (2, 2, 4, 8, False, False)
    assert layout(precision="fp16", zero_stage=2) == (2, 2, 4, 8, True, True)
    assert layout(precision="bfloat16", zero_stage=0) == (2, 2, 4, 8, False, False)  # DeepSpeed's fp16 wrapper
    assert layout(precision="bfloat16", zero_stage=1, grad_accum_fp32=True) == (2, 4, 4, 8, False, True)
    assert layout(precision="bfloat16", zero_stage=0, pp=2) == (2, 4, 4, 8, False, True)  # BF16_Optimizer
    assert layout(precision="fp32", zero_stage=0, optimizer_type="sgd") == (4, 4, 0, 4, False, False)


def test_group_placements() -> None:
    tensor, pipe, data = group_placements(tp=2, pp=4, dp=12, gpus_per_node=8)
    assert (tensor.inside_node, pipe.nodes_spanned, pipe.stride, data.nodes_spanned) == (True, 4, 24, 3)
    tensor, pipe, data = group_placements(tp=16, pp=1, dp=2, gpus_per_node=8)
    assert (tensor.nodes_spanned, pipe.inside_node, data.nodes_spanned) == (2, True, 2)
    assert [p.inside_node for p in group_placements(tp=1, pp=2, dp=4, gpus_per_node=8)] == [True] * 3


def test_warnings_for_a_plan_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--gpus", "2", "--gpus-per-node", "1", "--gpu-memory", "1MiB", "--pipe_parallel_size", "2"]
    plan = _plan_json(capsys, *argv, "--gradient_accumulation_steps", "2")
    warnings = "\n".join(plan["warnings"])
    assert not plan["memory"]["fits"] and "does not fit: a stage-" in warnings and "but the GPU has 0.0 GB" in warnings
    assert "pipeline groups span 2 nodes" in warnings
    assert "pipeline bubble: 2 micro-batches over 2 stages idle 50%" in warnings
    assert plan["memory"]["gpu_memory_bytes"] == 2**20
    assert plan["throughput"]["bubble_s"] == pytest.approx(plan["throughput"]["compute_s"] / 2)


def test_offload_warning_and_sequence_parallel_activations(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--model_parallel_size", "2", "--num_gpus", "2", "--checkpoint_activations", "false"]
    plain = _plan_json(capsys, *argv)
    zero = '{"stage": 2, "offload_optimizer": {"device": "cpu"}}'
    sp = _plan_json(capsys, *argv, "--sequence_parallel", "true", "--zero_optimization", zero)
    assert "--gpus not given: planning for 2 GPUs" in plain["warnings"]
    assert any("offload_optimizer: the offloaded tensors are counted in host memory" in w for w in sp["warnings"])
    key = "no_checkpointing_kept"
    plain_mb, sp_mb = (p["memory"]["per_rank"][0]["activations_per_micro_batch"][key] for p in (plain, sp))
    s, b, h = 64, 2, 64  # configs/cpu/tiny.yml; sequence parallelism halves the 10·s·b·h part at TP 2 (fp32: x2)
    assert plain_mb - sp_mb == 2 * 2 * 5 * s * b * h


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["configs/20B.yml", "--gpus", "12"],
            "world size 12 is not divisible by max(pipe_parallel_size, 1) x model_parallel_size = 8",
        ),
        ([*TINY, "--gpu-memory", "lots"], "--gpu-memory 'lots': expected a size between 1 byte and 1 PiB"),
        ([*TINY, "--gpus-per-node", "0"], "--gpus-per-node '0': must be an integer between 1 and 1024"),
        ([*TINY, "--vocab-size", "0"], "--vocab-size '0': must be an integer between 1 and 2147483647"),
        ([*TINY, "--hidden_sise", "64"], "unknown key '--hidden_sise'"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("deepy.py: error: ") and message in err and "Traceback" not in err and out == ""


def test_parse_bytes() -> None:
    assert parse_bytes("40GB") == 40 * 10**9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512") == 512


def test_planner_flags_are_checked_before_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, "--gpus", "abc"]) == 2
    assert "--gpus 'abc': must be an integer between 1 and 1048576" in capsys.readouterr().err
