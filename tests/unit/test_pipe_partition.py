"""Pipeline stage split: the real ``PipelineModule`` partition, the planner's, and the even default (issue 37)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

import deepy
from megatron import mpu
from megatron.checkpoint import stage_bounds
from megatron.model.config import GPTModelConfig
from megatron.model.pipe_partition import DEFAULT_PARTITION, GPT_NEOX_PARTITION, resolve_partition_method
from megatron.planner.params import count_params
from megatron.planner.partition import (
    default_partition_method,
    even_split_method,
    gpt_neox_layers_per_stage,
    layers_by_stage,
    uneven_split_warning,
)
from tests.harness import run_distributed

DEFAULT = "type:transformerlayer|mlp"


def _cfg(num_layers: int, **kw: object) -> GPTModelConfig:
    base: dict = dict(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=128,
        max_position_embeddings=32,
        pos_emb="rotary",
    )
    return GPTModelConfig(**{**base, **kw})


def pipe_parts_fn(cases: list[tuple[int, str]]) -> list[list[int]]:
    """``PipelineModule.parts`` of a ``num_layers`` model on this world's stages, per (num_layers, method)."""
    from megatron.model import GPT2ModelPipe

    mpu.initialize_model_parallel(1, pipe_parallel_size=mpu_world())
    out = []
    for num_layers, method in cases:
        cfg = _cfg(num_layers, pipe_partition_method=method)
        out.append([int(b) for b in GPT2ModelPipe(cfg, mpu.get_topology()).parts])
    return out


def mpu_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_real_pipeline_module_splits_evenly_by_default_and_the_planner_agrees() -> None:
    """6 layers on 3 stages: the default gives 2/2/2; GPT-NeoX's ``type:transformer|mlp`` (which also weighs
    ``_pre/_post_transformer_block``) 2/3/1. The planner's split is DeepSpeed's for both."""
    assert default_partition_method() == DEFAULT
    cases = [(6, DEFAULT), (6, GPT_NEOX_PARTITION), (2, DEFAULT), (2, GPT_NEOX_PARTITION)]
    parts = run_distributed(pipe_parts_fn, 3, cases, timeout=240)[0]
    for (layers, method), bounds in zip(cases, parts, strict=True):
        assert bounds == stage_bounds(_cfg(layers), 3, method), (layers, method)  # the checkpoint code's split
    expected = [[2, 2, 2], [2, 3, 1]]
    for (layers, method), bounds, want in zip(cases, parts, expected, strict=False):
        real = [sum(1 for i in range(lo, hi) if 2 <= i < 2 + layers) for lo, hi in pairwise(bounds)]
        assert real == want, (method, bounds)
        assert layers_by_stage(_cfg(layers), 3, method) == real
        assert [s.num_layers for s in count_params(_cfg(layers), 1, 3, method).stages] == real
    assert gpt_neox_layers_per_stage(6, 3) == 3
    # Fewer layers than stages: the default runs GPT-NeoX's split, whose last stage holds the post function, the
    # norm and the head together (DeepSpeed's engine sends a GPT2ModelPipe's activations as tuples).
    assert parts[2] == parts[3] and parts[2][-2] <= 2 + 2


@pytest.mark.parametrize(("layers", "stages", "gpt_neox_busiest"), [(44, 4, 12), (105, 35, 4), (96, 12, 9)])
def test_large_shapes_split_evenly_by_default(layers: int, stages: int, gpt_neox_busiest: int) -> None:
    cfg = _cfg(layers)
    assert layers_by_stage(cfg, stages) == [layers // stages] * stages
    assert max(layers_by_stage(cfg, stages, GPT_NEOX_PARTITION)) == gpt_neox_busiest
    assert gpt_neox_layers_per_stage(layers, stages) == gpt_neox_busiest
    warning = uneven_split_warning(cfg, stages, GPT_NEOX_PARTITION)
    assert (
        warning and f"puts {gpt_neox_busiest} layers on a stage" in warning and f"at most {layers // stages}" in warning
    )
    assert uneven_split_warning(cfg, stages, DEFAULT) is None


def test_default_falls_back_to_gpt_neox_split_where_it_cannot_run() -> None:
    assert DEFAULT_PARTITION == DEFAULT == default_partition_method()
    assert resolve_partition_method(_cfg(4), 4) == DEFAULT
    assert resolve_partition_method(_cfg(3), 4) == GPT_NEOX_PARTITION  # fewer layers than stages
    mixed = _cfg(4, attention_config=[[["mamba", "global"], 2]])  # Mamba layers: the default does not weigh them
    assert resolve_partition_method(mixed, 2) == GPT_NEOX_PARTITION
    assert resolve_partition_method(_cfg(3), 4, "uniform") == "uniform"


def test_even_split_method_keeps_other_methods() -> None:
    cfg = _cfg(4)
    assert even_split_method(cfg, GPT_NEOX_PARTITION) == DEFAULT
    for method in ("uniform", "parameters", "type:transformerlayer", DEFAULT):
        assert even_split_method(cfg, method) == method
    mamba = _cfg(4, attention_config=[[["mamba"], 4]])  # the default does not weigh Mamba layers: keep the regex
    assert even_split_method(mamba, "type:transformer|mlp|mamba") == "type:transformer|mlp|mamba"


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", "configs/20B.yml", "--gpus", "96", "--vocab-size", "50277", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_and_search_use_the_even_split(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, "--json")
    assert plan["parameters"]["layers_by_stage"] == [11, 11, 11, 11]
    assert not any("pipe_partition_method" in w for w in plan["warnings"])
    neox = _plan(capsys, "--json", "--pipe_partition_method", GPT_NEOX_PARTITION)
    assert max(neox["parameters"]["layers_by_stage"]) == 12
    assert any("puts 12 layers on a stage" in w for w in neox["warnings"])
    slower = neox["throughput"]["predicted"]["step_s"] / plan["throughput"]["predicted"]["step_s"]
    assert 1.05 < slower < 12 / 11 + 0.01  # the busiest stage (12 layers, not 11) sets the pace
    search = _plan(
        capsys, "--json", "--search", "--search-seconds", "20", "--pipe_partition_method", GPT_NEOX_PARTITION
    )
    assert search["pipe_partition_method"] == DEFAULT and "even split" in search["pipe_partition_note"]
