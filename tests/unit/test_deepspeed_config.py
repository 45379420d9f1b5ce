"""The DeepSpeed config built from NeoXArgs carries every DeepSpeed key's resolved value, and DeepSpeed reads it so."""

from __future__ import annotations

import dataclasses

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from megatron.neox_arguments import LaunchEnv, NeoXArgs
from megatron.neox_arguments.sections.deepspeed import DeepspeedConfigArgs

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "max_position_embeddings": 32}
NOT_DEEPSPEED = {"deepspeed", "deepspeed_extra_args", "curriculum_learning", "curriculum_seqlen", "load_universal"}
REMOVED_FROM_DEEPSPEED = {"sparse_gradients", "amp", "compression_training", "elasticity", "sparse_attention"}
DEEPERSPEED_ONLY = {"fp16", "type"}


def build(**overrides) -> NeoXArgs:
    return NeoXArgs(
        {**TINY, "train_micro_batch_size_per_gpu": 2, **overrides}, env=LaunchEnv(world_size=1, on_cpu=True)
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # every DeepSpeed key at its default: the case that crashed real configs
        {"steps_per_print": 7, "wall_clock_breakdown": True, "gradient_clipping": 0.5, "pipe_parallel_size": 1},
        {"fp16": {"fp16": True, "type": "fp16", "enabled": True, "loss_scale": 0}, "zero_optimization": {"stage": 1}},
        {"bf16": {"enabled": True}, "prescale_gradients": True, "gradient_predivide_factor": 2.0},
    ],
)
def test_every_deepspeed_key_reaches_deepspeed_with_its_resolved_value(overrides):
    args = build(**overrides)
    ds = args.deepspeed_config
    for f in dataclasses.fields(DeepspeedConfigArgs):
        value = getattr(args, f.name)
        if f.name in NOT_DEEPSPEED or f.name in REMOVED_FROM_DEEPSPEED:
            assert f.name not in ds, f.name
        elif value is None:
            assert f.name not in ds, f"{f.name}: None must leave DeepSpeed's default"
        elif f.name in ("fp16", "bf16"):
            assert ds[f.name] == {k: v for k, v in value.items() if k not in DEEPERSPEED_ONLY}
        else:
            assert ds[f.name] == value, f.name
    # DeepSpeed itself parses the dict and sees our values, not its own defaults (steps_per_print None, clipping 0)
    parsed = DeepSpeedConfig(dict(ds))
    assert parsed.steps_per_print == args.steps_per_print
    assert parsed.gradient_clipping == args.gradient_clipping
    assert parsed.wall_clock_breakdown == args.wall_clock_breakdown
    assert parsed.train_micro_batch_size_per_gpu == args.train_micro_batch_size_per_gpu
    assert parsed.prescale_gradients == args.prescale_gradients
    assert parsed.gradient_predivide_factor == args.gradient_predivide_factor


def test_changing_a_resolved_value_changes_the_deepspeed_config_and_does_not_leak():
    args = build()
    ds = args.deepspeed_config
    ds["zero_optimization"]["stage"] = 3  # a caller mutating the dict must not change the args
    assert args.deepspeed_config["zero_optimization"]["stage"] == 0
    assert build(steps_per_print=3).deepspeed_config["steps_per_print"] == 3


@pytest.mark.parametrize("key,value", [("sparse_gradients", True), ("amp", {"enabled": True}), ("elasticity", {})])
def test_keys_deepspeed_removed_are_refused_before_launch(key, value):
    from megatron.neox_arguments import ConfigError

    with pytest.raises(ConfigError, match=f"not supported yet: {key}="):
        build(**{key: value})


def test_onebitadam_says_that_its_schedule_is_not_gpt_neoxs(caplog: pytest.LogCaptureFixture) -> None:
    """GPT-NeoX swaps in DeepSpeed's WarmupDecayLR for onebitadam; we keep our schedule and say so."""
    with caplog.at_level("WARNING", logger="megatron.neox_arguments.neox_args"):
        build(optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3}})
    assert any("onebitadam" in r.message and "WarmupDecayLR" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron.neox_arguments.neox_args"):
        build(optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    assert not any("WarmupDecayLR" in r.message for r in caplog.records)
