"""megatron.mpu in a single process: rank arithmetic, utilities, TP-1 layers vs. plain torch ops, RNG."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu


@pytest.fixture(autouse=True)
def _fresh_mpu():
    mpu.destroy_model_parallel()
    yield
    mpu.destroy_model_parallel()


# ---- topology -------------------------------------------------------------------------------------------------


def test_reference_16_rank_layout_pipe_data_model() -> None:
    layout = mpu.build_layout(16, model_parallel_size=2, pipe_parallel_size=2)
    assert (layout.pipe, layout.data, layout.model) == (2, 4, 2)
    assert layout.model_groups() == [[2 * i, 2 * i + 1] for i in range(8)]
    assert layout.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.pipe_groups() == [[i, i + 8] for i in range(8)]
    # IO group: TP rank 0 of the first and last stage.
    assert layout.io_groups() == [[0, 2, 4, 6, 8, 10, 12, 14]]
    for rank in range(16):
        pipe, data, model = layout.coord(rank)
        assert rank == pipe * (4 * 2) + data * 2 + model


def test_layout_without_pipeline_uses_data_groups_for_io() -> None:
    layout = mpu.build_layout(4, model_parallel_size=2, pipe_parallel_size=0)
    assert layout.pipe == 1 and layout.data == 2
    assert layout.io_groups() == layout.data_groups() == [[0, 2], [1, 3]]
    assert layout.topology.get_axis_names() == ["pipe", "data", "model"]


@pytest.mark.parametrize(
    ("world", "mp", "pp", "match"),
    [
        (6, 4, 1, "not divisible"),
        (8, 3, 1, "not divisible"),
        (4, 0, 1, "model_parallel_size must be >= 1"),
        (4, 2, -1, "pipe_parallel_size must be a non-negative integer"),
        (4, 1.5, 1, "model_parallel_size must be a non-negative integer"),
    ],
)
def test_bad_parallel_sizes_are_rejected(world: int, mp, pp, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mpu.build_layout(world, mp, pp)


def test_getters_answer_as_single_process_before_init() -> None:
    assert not mpu.model_parallel_is_initialized()
    assert mpu.get_topology() is None
    for getter in (mpu.get_model_parallel_rank, mpu.get_data_parallel_rank, mpu.get_pipe_parallel_rank):
        assert getter() == 0
    for getter in (
        mpu.get_model_parallel_world_size,
        mpu.get_data_parallel_world_size,
        mpu.get_pipe_parallel_world_size,
        mpu.get_tensor_model_parallel_world_size,
    ):
        assert getter() == 1
    for getter in (mpu.get_model_parallel_group, mpu.get_data_parallel_group, mpu.get_pipe_parallel_group):
        assert getter() is None
    assert mpu.get_io_parallel_group() is None
    assert mpu.get_model_parallel_src_rank() == 0


def test_initialize_without_torch_distributed() -> None:
    mpu.initialize_model_parallel(1, 1)
    assert mpu.model_parallel_is_initialized()
    assert mpu.get_topology().world_size() == 1
    mpu.initialize_model_parallel(1, 0)  # same layout again: no-op
    mpu.destroy_model_parallel()
    with pytest.raises(ValueError, match="not divisible"):
        mpu.initialize_model_parallel(2, 1)
    assert not mpu.model_parallel_is_initialized()


def test_deepspeed_mpu_is_the_module() -> None:
    ds_mpu = mpu  # deepspeed.initialize(mpu=mpu), as pretrain passes it
    for name in (
        "get_model_parallel_rank",
        "get_model_parallel_group",
        "get_model_parallel_world_size",
        "get_data_parallel_rank",
        "get_data_parallel_group",
        "get_data_parallel_world_size",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_src_rank",
        "get_pipeline_model_parallel_rank",
        "get_data_parallel_group_ranks",
    ):
        assert callable(getattr(ds_mpu, name)), name
    # DeepSpeed treats an mpu with these as Ulysses sequence parallelism: we must not have them.
    assert not hasattr(ds_mpu, "get_sequence_parallel_world_size")
    assert not hasattr(ds_mpu, "initialize_sequence_parallel")


# ---- utilities ------------------------------------------------------------------------------------------------


def test_divide_and_split() -> None:
    assert mpu.divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        mpu.divide(10, 4)
    chunks = mpu.split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3, contiguous_split_chunks=True)
    assert [c.tolist() for c in chunks] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert all(c.is_contiguous() for c in chunks)
    with pytest.raises(ValueError):
        mpu.split_tensor_along_last_dim(torch.zeros(2, 5), 2)


def test_vocab_ranges() -> None:
    assert mpu.VocabUtility.vocab_range_from_global_vocab_size(100, 0, 4) == (0, 25)
    assert mpu.VocabUtility.vocab_range_from_global_vocab_size(100, 3, 4) == (75, 100)
    with pytest.raises(ValueError):
        mpu.VocabUtility.vocab_range_from_global_vocab_size(30, 0, 4)


def test_shard_layout_with_stride_and_sizes() -> None:
    full = torch.arange(8).view(8, 1)  # gated MLP, stride 2: rows [x0 x1 x2 x3 | g0 g1 g2 g3]
    assert mpu.shard_tensor(full, 0, 0, 2, stride=2).flatten().tolist() == [0, 1, 4, 5]
    assert mpu.shard_tensor(full, 0, 1, 2, stride=2).flatten().tolist() == [2, 3, 6, 7]
    # Blocked GQA QKV: q (4 rows) | k (2) | v (2); rank r keeps q_r | k_r | v_r.
    assert mpu.shard_tensor(full, 0, 1, 2, sub_sizes=[4, 2, 2]).flatten().tolist() == [2, 3, 5, 7]
    for kw in ({}, {"stride": 2}, {"stride": 4}, {"sub_sizes": [4, 2, 2]}):
        shards = [mpu.shard_tensor(full, 0, r, 2, **kw) for r in range(2)]
        assert torch.equal(mpu.merge_shards(shards, 0, **kw), full), kw
    with pytest.raises(ValueError, match="add up to 8"):
        mpu.shard_tensor(full, 0, 0, 2, sub_sizes=[4, 2])


# ---- layers at TP size 1 ----------------------------------------------------------------------------------------


def _drawn(shape: tuple[int, ...], seed: int, init=nn.init.xavier_normal_) -> torch.Tensor:
    torch.manual_seed(seed)
    weight = torch.empty(shape)
    init(weight)
    return weight


def test_tp1_column_is_a_plain_linear() -> None:
    torch.manual_seed(3)
    layer = mpu.ColumnParallelLinear(8, 12, stride=3)
    assert torch.equal(layer.weight, _drawn((12, 8), 3))
    assert layer.weight.model_parallel and layer.weight.tensor_model_parallel
    assert (layer.weight.partition_dim, layer.weight.partition_stride) == (0, 3)
    x = torch.randn(4, 2, 8)
    with torch.no_grad():
        layer.bias.uniform_()
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
    skip = mpu.ColumnParallelLinear(8, 12, skip_bias_add=True, bias=True)
    out, bias = skip(x)
    assert bias is skip.bias
    torch.testing.assert_close(out, F.linear(x, skip.weight))
    assert mpu.ColumnParallelLinear(8, 12, bias=False).bias is None


def test_tp1_row_and_embedding_are_plain_layers() -> None:
    row = mpu.RowParallelLinear(8, 4, init_method=nn.init.zeros_, params_dtype=torch.bfloat16)
    assert row.weight.dtype == torch.bfloat16 and row.weight.shape == (4, 8) and row.weight.partition_dim == 1
    assert not getattr(row.bias, "model_parallel", False)  # replicated
    torch.manual_seed(4)
    row = mpu.RowParallelLinear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        row.bias.uniform_()
    out, bias = row(x)
    assert bias is None
    torch.testing.assert_close(out, F.linear(x, row.weight, row.bias))
    torch.manual_seed(5)
    emb = mpu.VocabParallelEmbedding(20, 6, init_method=nn.init.normal_)
    assert torch.equal(emb.weight, _drawn((20, 6), 5, nn.init.normal_))
    ids = torch.tensor([[0, 19, 3]])
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))


def test_row_sequence_parallel_needs_parallel_input_only_when_tp_is_used() -> None:
    mpu.RowParallelLinear(8, 4, sequence_parallel=True)  # TP 1: sequence parallelism has no effect


def test_tp1_mappings_are_identities() -> None:
    x = torch.randn(4, 6)
    for fn in (
        mpu.copy_to_model_parallel_region,
        mpu.reduce_from_model_parallel_region,
        mpu.scatter_to_model_parallel_region,
        mpu.gather_from_model_parallel_region,
    ):
        assert fn(x) is x
    for fn in (
        mpu.scatter_to_sequence_parallel_region,
        mpu.gather_from_sequence_parallel_region,
        mpu.reduce_scatter_to_sequence_parallel_region,
    ):
        assert fn(x, 0) is x


def test_tp1_cross_entropy_matches_torch() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(5, 3, 11) * 4).requires_grad_()
    target = torch.randint(0, 11, (5, 3))
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 11), target.view(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(loss, ref)
    weights = torch.rand(5, 3)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    with pytest.raises(ValueError, match="target shape"):
        mpu.vocab_parallel_cross_entropy(logits, target[:, :2])


def test_tp1_broadcast_data_checks_input() -> None:
    data = {"text": torch.arange(6).view(2, 3)}
    out = mpu.broadcast_data(["text"], data, torch.int64)
    assert torch.equal(out["text"], data["text"])
    with pytest.raises(ValueError, match="'labels' missing"):
        mpu.broadcast_data(["labels"], data, torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        mpu.broadcast_data(["text"], data, torch.float32)
    with pytest.raises(ValueError, match="must provide the data"):
        mpu.broadcast_data(["text"], None, torch.int64)


# ---- RNG ----------------------------------------------------------------------------------------------------------


def test_rng_tracker_streams() -> None:
    mpu.model_parallel_cuda_manual_seed(1234)
    default_a = torch.rand(4)
    with mpu.get_cuda_rng_tracker().fork():
        tp_a = torch.rand(4)
    default_b = torch.rand(4)
    torch.manual_seed(1234)
    expected_default = torch.rand(8)
    torch.manual_seed(1234 + 2718)  # TP rank 0
    expected_tp = torch.rand(4)
    assert torch.equal(torch.cat([default_a, default_b]), expected_default)  # the fork does not disturb it
    assert torch.equal(tp_a, expected_tp)
    with pytest.raises(ValueError):
        mpu.model_parallel_cuda_manual_seed("1")


def test_checkpoint_replays_both_rng_streams() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(lin(x), p=0.5, training=True)  # default stream
        with mpu.get_cuda_rng_tracker().fork():
            h = F.dropout(h, p=0.5, training=True)  # TP stream
        return h.tanh()

    x = torch.randn(4, 8)

    def run(use_checkpoint: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mpu.model_parallel_cuda_manual_seed(77)
        lin.zero_grad()
        inp = x.clone().requires_grad_()
        out = mpu.checkpoint(block, inp) if use_checkpoint else block(inp)
        out.sum().backward()
        return out.detach(), inp.grad, lin.weight.grad.clone()

    plain, ckpt = run(False), run(True)
    assert (plain[0] == 0).any() and (plain[0] != 0).any()  # dropout really acted
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_fp32_allreduce_flag_selects_the_reduction_dtype() -> None:
    from megatron.mpu.mappings import _reduce_dtype

    half, full = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float32)
    assert _reduce_dtype(half) == torch.bfloat16
    mpu.set_fp32_allreduce(True)
    assert mpu.get_fp32_allreduce()
    assert _reduce_dtype(half) == torch.float32 and _reduce_dtype(full) == torch.float32
    assert _reduce_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float32
    mpu.destroy_model_parallel()
    assert not mpu.get_fp32_allreduce()


def test_column_rejects_inconsistent_fused_sizes() -> None:
    with pytest.raises(ValueError, match="must add up to output_size 12"):
        mpu.ColumnParallelLinear(8, 12, output_sizes=[8, 2])
    with pytest.raises(ValueError, match="divisible by stride"):
        mpu.ColumnParallelLinear(8, 12, stride=5)
    layer = mpu.ColumnParallelLinear(8, 12, output_sizes=[8, 2, 2])
    assert layer.stride == 3 and layer.weight.partition_sizes == (8, 2, 2)
