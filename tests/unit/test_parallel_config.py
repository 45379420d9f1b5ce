"""``ParallelConfig.apply``: what the layout requires of the DeepSpeed config."""

from __future__ import annotations

import logging

import pytest

from megatron.neox_arguments import neox_namespace
from megatron.parallel_config import ParallelConfig


def layout(**kw: object) -> ParallelConfig:
    return ParallelConfig.from_neox_args(neox_namespace(**kw))


@pytest.mark.parametrize(("pp", "kept"), [(0, True), (1, True), (2, False), (4, False)])
def test_deepspeed_wall_clock_breakdown_is_off_with_several_pipeline_stages(
    pp: int, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed 0.19's pipeline engine starts its backward timers twice on every stage but the last: with more than
    one stage its own breakdown is off (one warning naming the cause); the user's config dict is not changed."""
    ds = {"wall_clock_breakdown": True, "train_batch_size": 8}
    with caplog.at_level(logging.WARNING, logger="megatron.parallel_config"):
        out = layout(pipe_parallel_size=pp).apply(ds)
    assert out["wall_clock_breakdown"] is kept and ds["wall_clock_breakdown"] is True
    assert ("starts its backward timer twice" in caplog.text) is (not kept)
    assert layout(pipe_parallel_size=pp).apply({"train_batch_size": 8}).get("wall_clock_breakdown") is None
