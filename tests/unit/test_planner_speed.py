"""The planner's fast paths predict exactly what the paths they replace predicted.

The fast paths: the balanced stage partition computed row by row (``megatron/checkpoint/partition.py``) and memoised
(``stage_bounds``), and every stage's parameter names from one pass (``stage_param_names``). The reference runs
the same planner with DeepSpeed's own ``partition_balanced``, no memo, and main's per-stage ``slice_param_names``
(``benchmarks/planner_reference.py``, the baseline ``benchmarks/bench_planner.py`` times): plans and searches must
come out identical to the last byte and second, the 1T / 3,072-GPU plan (Megatron-LM's 1T run, ``configs/1T.yml``:
64 stages) included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import deepy
from benchmarks.planner_reference import main_slice_param_names, reference_paths
from megatron.checkpoint import layout as checkpoint_layout
from megatron.checkpoint import stage_param_names
from megatron.checkpoint.optimizer_state import model_param_names
from megatron.model.config import GPTModelConfig

ONE_T = ["configs/1T.yml", "--gpus", "3072", "--gpu-type", "A100-80GB", "--vocab-size", "51200"]
CASES = {
    "20B": ["configs/20B.yml", "--gpus", "96"],
    "20B_parameters_split": ["configs/20B.yml", "--gpus", "88", "--pipe_parallel_size", "11",
                             "--model_parallel_size", "1", "--pipe_partition_method", "parameters"],
    "20B_uniform_split": ["configs/20B.yml", "--gpus", "96", "--pipe_partition_method", "uniform"],
    "175B_tp8_pp12": ["configs/175B.yml", "--gpus", "1536", "--pipe_parallel_size", "12", "--model_parallel_size",
                      "8", "--train_batch_size", "1536", "--vocab-size", "50277"],
    "175B_zero3_no_pipe": ["configs/175B.yml", "--gpus", "64", "--pipe_parallel_size", "0", "--model_parallel_size",
                           "8", "--zero_optimization", '{"stage": 3}', "--vocab-size", "50277"],
    "tiny_pp2": ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "2", "--pipe_parallel_size", "2"],
    "tiny_tied_pp2": ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "4", "--pipe_parallel_size", "2",
                      "--no_weight_tying", "false"],
    "tiny_shared_pp2": ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "2", "--pipe_parallel_size", "2",
                        "--num_layers", "4", "--num_unique_layers", "2"],
    "llama2_7B_tp2_pp4": ["configs/llama2/7B.yml", "configs/llama/train_config.yml", "--vocab-size", "32000",
                          "--gpus", "64", "--pipe_parallel_size", "4", "--model_parallel_size", "2"],
    "pythia_410M_pp2": ["configs/pythia/410M.yml", "--vocab-size", "50277", "--gpus", "16", "--pipe_parallel_size",
                        "2"],
    "rwkv_170M": ["configs/rwkv/170M.yml", "--vocab-size", "50277", "--gpus", "8"],
}  # fmt: skip


@pytest.fixture
def fresh_bounds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(checkpoint_layout, "_BOUNDS", {})
    yield


def _plan(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_equals_the_reference_paths(name: str, capsys: pytest.CaptureFixture[str], fresh_bounds: None) -> None:
    fast = _plan(capsys, CASES[name])
    with reference_paths(
        memo=not name.startswith("tiny")
    ):  # memo off: tiny cases, the search (test_stage_partition.py)
        slow = _plan(capsys, CASES[name])
    assert fast == slow
    assert fast["throughput"]["predicted"]["step_s"] > 0 and fast["parameters"]["per_rank_by_stage"]


def test_1t_plan_on_3072_gpus_completes_and_equals_the_reference(
    capsys: pytest.CaptureFixture[str], fresh_bounds: None
) -> None:
    fast = _plan(capsys, ONE_T)
    assert round(fast["parameters"]["total"] / 1e12, 2) == 1.01  # Megatron-LM's "1008B"
    layout = fast["layout"]
    assert (layout["tensor_parallel"], layout["pipeline_stages"], layout["data_parallel"]) == (8, 64, 6)
    assert len(fast["memory"]["per_rank"]) == len(fast["parameters"]["per_rank_by_stage"]) == 64
    assert fast["memory"]["fits"] and fast["throughput"]["predicted"]["tflops_per_gpu"] > 0
    with reference_paths(memo=True):  # DeepSpeed's partition once (0.5 s), not once per stage (40 s)
        slow = _plan(capsys, ONE_T)
    assert fast == slow


def test_search_equals_the_reference_paths(capsys: pytest.CaptureFixture[str], fresh_bounds: None) -> None:
    argv = ["configs/20B.yml", "--gpus", "96", "--search", "--top", "1000", "--search-seconds", "86400"]
    fast = _plan(capsys, argv)
    with reference_paths(memo=False):
        slow = _plan(capsys, argv)
    assert fast == slow
    assert not fast["cut_short"] and fast["layouts_that_fit"] >= 5 and len(fast["layouts"]) == fast["layouts_that_fit"]


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"no_weight_tying": False},
        {"num_unique_layers": 3, "param_sharing_style": "spaced"},
        {"num_unique_layers": 2, "no_weight_tying": False},
        {"activation": "swiglu", "num_kv_heads": 2},
    ],
)
def test_stage_param_names_are_the_per_stage_slices(shape: dict[str, Any], fresh_bounds: None) -> None:
    cfg = GPTModelConfig(
        num_layers=6, hidden_size=64, num_attention_heads=4, padded_vocab_size=512, max_position_embeddings=64, **shape
    )
    for pp in (0, 1, 2, 3, 4, 6, 8):
        for method in ("type:transformer|mlp", "uniform", "parameters"):
            every = stage_param_names(cfg, pp, method)
            assert every == [main_slice_param_names(cfg, pp, s, method) for s in range(max(pp, 1))], (pp, method)
    assert sum(len(names) for names in stage_param_names(cfg, 3)) >= len(model_param_names(cfg))
