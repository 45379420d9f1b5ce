"""The row-vectorised balanced partition gives DeepSpeed's own boundaries, and stage_bounds memoises them."""

from __future__ import annotations

import random
import re

import pytest
from deepspeed.runtime import utils as ds_utils

from megatron.checkpoint import layout as checkpoint_layout
from megatron.checkpoint.layout import _spec_names, stage_bounds
from megatron.checkpoint.partition import partition_balanced
from megatron.model.config import GPTModelConfig


def _deepspeed(weights: list[int], parts: int) -> list[int]:
    return [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=parts)]


def test_random_weights_give_deepspeeds_boundaries() -> None:
    rng = random.Random(37)
    cases = 0
    for _ in range(150):
        n = rng.randint(1, 30)
        parts = rng.randint(1, 12)
        kind = rng.random()
        if kind < 0.4:  # 0/1 weights (type: partitioning): many ties, the tie rule decides
            weights = [rng.randint(0, 1) for _ in range(n)]
        elif kind < 0.7:  # small integers: ties too
            weights = [rng.randint(0, 5) for _ in range(n)]
        else:  # parameter counts: large, rarely tied
            weights = [rng.randint(0, 10**9) for _ in range(n)]
        assert partition_balanced(weights, parts) == _deepspeed(weights, parts), (weights, parts)
        cases += 1
    assert cases == 150
    for weights, parts in (([0] * 7, 3), ([5], 4), ([1, 0, 0, 0, 1], 5), ([0, 0, 1, 1, 1, 1, 0, 0, 0], 4)):
        assert partition_balanced(weights, parts) == _deepspeed(weights, parts)


def test_1t_layer_specs_give_deepspeeds_boundaries() -> None:
    """The 1T model (128 layers, 133 specs) in 64 stages, by GPT-NeoX's default ``type:transformer|mlp`` (uneven)
    and neox-forge's ``type:transformerlayer|mlp``: the case that took DeepSpeed's loop 0.5 s per call."""
    cfg = _tiny(128)
    for method in ("type:transformer|mlp", "type:transformerlayer|mlp"):
        regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)  # stage_bounds' rule for type:<regex>
        weights = [1 if name and regex.search(name) else 0 for name, _ in _spec_names(cfg)]
        assert len(weights) == 133 and sum(weights) >= 128
        assert partition_balanced(weights, 64) == _deepspeed(weights, 64) == stage_bounds(cfg, 64, method), method


def _tiny(layers: int) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, padded_vocab_size=512, max_position_embeddings=64
    )


def test_stage_bounds_are_memoised_per_config_stages_and_method(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, str]] = []
    real = checkpoint_layout._stage_bounds

    def counted(cfg: GPTModelConfig, pp: int, method: str) -> list[int]:
        calls.append((pp, method))
        return real(cfg, pp, method)

    monkeypatch.setattr(checkpoint_layout, "_BOUNDS", {})
    monkeypatch.setattr(checkpoint_layout, "_stage_bounds", counted)
    cfg = _tiny(8)
    first = stage_bounds(cfg, 4)
    first.append(-1)  # callers get their own list
    assert stage_bounds(cfg, 4) == stage_bounds(cfg, 4, cfg.pipe_partition_method) != first
    assert len(calls) == 1
    stage_bounds(cfg, 2)
    stage_bounds(cfg, 4, "uniform")
    wider = stage_bounds(_tiny(12), 4)
    assert len(calls) == 4 and wider[-1] > first[-2]
