"""mpu process groups, mappings, fp32 all-reduce, broadcast_data and RNG on 4 gloo ranks."""

from __future__ import annotations

import pytest

from megatron import mpu
from tests.distributed import fns_mpu_comm
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(fns_mpu_comm.comm_checks, 4, timeout=240)


@pytest.mark.parametrize(("mp", "pp"), [(2, 1), (2, 2), (1, 1), (4, 1), (1, 4)])
def test_groups_follow_the_pipe_data_model_topology(results, mp: int, pp: int) -> None:
    layout = mpu.build_layout(4, mp, pp)
    for rank, result in enumerate(results):
        info = result["groups"][f"mp{mp}_pp{pp}"]

        def member(groups: list[list[int]], rank: int = rank) -> list[int]:
            return next(g for g in groups if rank in g)

        assert info["model"] == member(layout.model_groups())
        assert info["data"] == info["data_ranks"] == member(layout.data_groups())
        assert info["pipe"] == member(layout.pipe_groups())
        assert tuple(info["coord"]) == layout.coord(rank)
        assert tuple(info["sizes"]) == (layout.pipe, layout.data, layout.model)
        assert info["src"] == info["model"][0]
        io = layout.io_groups()
        if pp > 1:
            assert info["io"] == (io[0] if rank in io[0] else None)
        else:
            assert info["io"] == info["data"]
        assert "destroy_model_parallel" in info["reinit_error"]


def test_tp2_pp2_groups_match_hand_computed_ranks(results) -> None:
    # rank = pipe*2 + model (dp = 1): TP [0,1],[2,3]; PP [0,2],[1,3]; IO = model-0 ranks of both stages.
    got = [r["groups"]["mp2_pp2"] for r in results]
    assert [g["model"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["pipe"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["io"] for g in got] == [[0, 2], None, [0, 2], None]


def test_mappings_values_and_gradients(results) -> None:
    for rank, result in enumerate(results):
        for name, err in result["mappings"].items():
            assert err < 1e-5, (rank, name, err)
        assert len(result["mappings"]) == 15


def test_fp32_allreduce_sums_half_precision_in_fp32(results) -> None:
    for result in results:
        sums = result["fp32_allreduce"]
        # 1 + 3 * 2^-8 = 1.01171875, rounded once to bf16: 1.015625. (gloo itself accumulates bf16 in float,
        # so the plain path may agree here; NCCL would not.)
        assert sums["fp32=True"] == 1.015625
        assert abs(sums["fp32=False"] - 1.01171875) < 2**-6


def test_broadcast_data_from_first_tp_rank(results) -> None:
    for rank, result in enumerate(results):
        dp = rank // 2
        out = result["broadcast"]
        assert out["text"] == ((2, 5), [[100 * dp + i for i in range(5)], [100 * dp + i for i in range(5, 10)]])
        assert out["mask"] == ((3,), [dp, 7, 9])
        assert out["scalar"] == ((), 5 + dp)


def test_rng_default_stream_shared_and_tp_stream_per_rank(results) -> None:
    rng = [r["rng"] for r in results]
    assert all(r["default"] == rng[0]["default"] for r in rng)
    for r in rng:
        assert r["tp"] == r["tp_expected"]
    assert rng[0]["tp"] != rng[1]["tp"]  # TP ranks 0 and 1 draw differently
    assert rng[0]["tp"] == rng[2]["tp"]  # same TP rank in another DP group draws the same


def test_sequence_parallel_norm_grads_are_summed_over_tp(results) -> None:
    for result in results:
        sp = result["sp_norm"]
        assert (sp["marked"], sp["marked_again"], sp["linear_marked"], sp["q_norm_marked"]) == (2, 0, 0, 0)
        assert sp["weight_err"] < 1e-5 and sp["bias_err"] < 1e-5, sp


def test_unsplittable_layer_shapes_are_refused(results) -> None:
    row, vocab, sizes, column, sp = results[0]["layer_errors"]
    assert "RowParallelLinear: input_size 5 must be divisible by the model parallel size (2)" in row
    assert "vocabulary size 31 must be divisible" in vocab
    assert "output_sizes [3, 3]" in sizes
    assert "output_size 7 must be divisible" in column
    assert "sequence_parallel=True requires input_is_parallel=True" in sp


def test_collectives_over_world_and_named_groups(results) -> None:
    # TP 2 x DP 2: model groups [0, 1], [2, 3]; data groups [0, 2], [1, 3]
    for rank, result in enumerate(results):
        got = result["collectives"]
        model, data = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert tuple(got["ranks"]) == (True, rank, 4, rank % 2, 2)
        assert got["sum_model"] == sum(r + 1.0 for r in model)
        assert got["max_data"] == float(max(data))
        assert got["min_world"] == 0.0
        assert got["gather_data"] == [[r, 10 * r] for r in data]
        assert got["gather_objects_model"] == [{"rank": r} for r in model]
        assert got["broadcast"] == "from 3"
