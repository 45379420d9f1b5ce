"""mpu's collectives in a plain process (no process group): the single-process answers every caller relies on.

The same helpers on 4 gloo ranks: tests/distributed/test_mpu_comm.py::test_collectives_over_world_and_named_groups.
"""

from __future__ import annotations

import pytest
import torch

from megatron import mpu


def test_plain_process_answers_as_rank_zero_of_one() -> None:
    assert not mpu.is_distributed()
    assert (mpu.world_rank(), mpu.world_size()) == (0, 1)
    assert (mpu.group_rank("data"), mpu.group_size("model")) == (0, 1)
    mpu.barrier()
    mpu.barrier("pipe")


def test_plain_process_reductions_and_gathers_return_the_local_value() -> None:
    t = torch.tensor([1.5, -2.0])
    assert mpu.all_reduce_sum(t) is t and t.tolist() == [1.5, -2.0]
    assert mpu.all_reduce_max(t, group="data") is t and t.tolist() == [1.5, -2.0]
    assert mpu.all_reduce(t, "min").tolist() == [1.5, -2.0]
    assert [x.tolist() for x in mpu.all_gather_tensors(t, group="model")] == [[1.5, -2.0]]
    assert mpu.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert mpu.broadcast_object(["x"], src=0) == ["x"]


def test_unknown_group_name_and_reduction_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown process group name 'tensor'; valid: model, data, pipe, io"):
        mpu.resolve_group("tensor")
    with pytest.raises(ValueError, match=r"unknown reduction 'mean'; valid: sum, max, min"):
        mpu.all_reduce(torch.zeros(1), "mean")  # type: ignore[arg-type]


def test_named_groups_resolve_to_the_mpu_getters() -> None:
    # before initialize_model_parallel every getter answers None (the world group)
    assert [mpu.resolve_group(n) for n in ("model", "data", "pipe", "io")] == [None] * 4
    sentinel = object()
    assert mpu.resolve_group(sentinel) is sentinel and mpu.resolve_group(None) is None
