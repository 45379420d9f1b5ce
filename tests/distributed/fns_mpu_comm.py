"""Rank functions for the mpu group, mapping, broadcast, fp32-all-reduce and RNG tests (4 ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _groups(mp: int, pp: int) -> dict[str, Any]:
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(mp, pp)
    mpu.initialize_model_parallel(mp, pp)  # idempotent
    info = {
        "model": _ranks(mpu.get_model_parallel_group()),
        "data": _ranks(mpu.get_data_parallel_group()),
        "pipe": _ranks(mpu.get_pipe_parallel_group()),
        "io": _ranks(mpu.get_io_parallel_group()),
        "data_ranks": mpu.get_data_parallel_group_ranks(),
        "coord": (mpu.get_pipe_parallel_rank(), mpu.get_data_parallel_rank(), mpu.get_model_parallel_rank()),
        "sizes": (
            mpu.get_pipe_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
            mpu.get_model_parallel_world_size(),
        ),
        "src": mpu.get_model_parallel_src_rank(),
    }
    try:
        mpu.initialize_model_parallel(*((1, 1) if (mp, pp) != (1, 1) else (2, 1)))  # another valid layout
        info["reinit_error"] = None
    except ValueError as err:
        info["reinit_error"] = str(err)
    return info


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _mapping_errors() -> dict[str, float]:
    """TP must span the whole world here. Every input is known on every rank, so each rank checks itself."""
    rank, world = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    gen = torch.Generator().manual_seed(3)
    s, b, h = 2 * world, 2, 3 * world
    x_full = torch.randn(s, b, h, generator=gen)
    g_all = [torch.randn(s, b, h, generator=gen) for _ in range(world)]  # a different upstream grad per rank
    g_sum = sum(g_all)
    chunk = s // world
    own = slice(rank * chunk, (rank + 1) * chunk)
    cols = slice(rank * (h // world), (rank + 1) * (h // world))
    errors: dict[str, float] = {}

    x = x_full.clone().requires_grad_()
    y = mpu.scatter_to_sequence_parallel_region(x, 0)
    y.backward(g_all[0][own])  # every rank passes ITS chunk of g_all[0]: backward all-gathers them
    errors["scatter_seq_fwd"] = _err(y, x_full[own])
    errors["scatter_seq_bwd"] = _err(x.grad, g_all[0])

    x = x_full[own].clone().requires_grad_()
    y = mpu.gather_from_sequence_parallel_region(x, 0)
    y.backward(g_all[rank])  # partial grads: backward reduce-scatters them
    errors["gather_seq_fwd"] = _err(y, x_full)
    errors["gather_seq_bwd"] = _err(x.grad, g_sum[own])

    x = x_full[own].clone().requires_grad_()
    y = mpu.gather_from_sequence_parallel_region(x, 0, tensor_parallel_output_grad=False)
    y.backward(g_all[0])  # complete grads: backward keeps the own chunk
    errors["gather_seq_nosum_bwd"] = _err(x.grad, g_all[0][own])

    x = (x_full * (rank + 1)).requires_grad_()
    y = mpu.reduce_scatter_to_sequence_parallel_region(x, 0)
    y.backward(g_all[0][own])
    total = x_full * sum(range(1, world + 1))
    errors["reduce_scatter_seq_fwd"] = _err(y, total[own])
    errors["reduce_scatter_seq_bwd"] = _err(x.grad, g_all[0])

    x = x_full.clone().requires_grad_()
    y = mpu.copy_to_model_parallel_region(x)
    y.backward(g_all[rank])
    errors["copy_fwd"] = _err(y, x_full)
    errors["copy_bwd"] = _err(x.grad, g_sum)

    x = (x_full * (rank + 1)).requires_grad_()
    y = mpu.reduce_from_model_parallel_region(x)
    y.backward(g_all[0])
    errors["reduce_fwd"] = _err(y, total)
    errors["reduce_bwd"] = _err(x.grad, g_all[0])

    x = x_full.clone().requires_grad_()
    y = mpu.scatter_to_model_parallel_region(x)
    y.backward(g_all[0][..., cols])
    errors["scatter_last_fwd"] = _err(y, x_full[..., cols])
    errors["scatter_last_bwd"] = _err(x.grad, g_all[0])

    x = x_full[..., cols].clone().requires_grad_()
    y = mpu.gather_from_model_parallel_region(x)
    y.backward(g_all[0])
    errors["gather_last_fwd"] = _err(y, x_full)
    errors["gather_last_bwd"] = _err(x.grad, g_all[0][..., cols])
    return errors


def _fp32_allreduce_sums() -> dict[str, float]:
    """bf16 sum of [1, 2^-8, 2^-8, 2^-8]: exact in fp32 (then rounded once), lossy when summed in bf16."""
    rank = mpu.get_model_parallel_rank()
    value = torch.tensor([1.0 if rank == 0 else 2.0**-8], dtype=torch.bfloat16)
    out: dict[str, float] = {}
    for flag in (False, True):
        mpu.set_fp32_allreduce(flag)
        y = mpu.reduce_from_model_parallel_region(value)
        assert y.dtype == torch.bfloat16
        out[f"fp32={flag}"] = y.float().item()
    mpu.set_fp32_allreduce(False)
    return out


def _rng() -> dict[str, list[float]]:
    mpu.model_parallel_cuda_manual_seed(1000)
    default = torch.rand(3)
    with mpu.get_cuda_rng_tracker().fork():
        tp = torch.rand(3)
    torch.manual_seed(1000 + 2718 + mpu.get_model_parallel_rank())
    return {"default": default.tolist(), "tp": tp.tolist(), "tp_expected": torch.rand(3).tolist()}


def _broadcast() -> dict[str, Any]:
    dp = mpu.get_data_parallel_rank()
    data = None
    if mpu.get_model_parallel_rank() == 0:
        data = {
            "text": torch.arange(10, dtype=torch.int64).view(2, 5) + 100 * dp,
            "mask": torch.tensor([dp, 7, 9], dtype=torch.int64),
            "scalar": torch.tensor(5 + dp, dtype=torch.int64),
        }
    out = mpu.broadcast_data(["text", "mask", "scalar"], data, torch.int64)
    return {key: (tuple(t.shape), t.tolist()) for key, t in out.items()}


def _collectives() -> dict[str, Any]:
    """mpu's collectives at TP 2 x DP 2 (rank = data * 2 + model): world and named groups."""
    r = mpu.world_rank()
    mpu.barrier()
    mpu.barrier("io")
    return {
        "ranks": (mpu.is_distributed(), r, mpu.world_size(), mpu.group_rank("model"), mpu.group_size("data")),
        "sum_model": mpu.all_reduce_sum(torch.tensor([r + 1.0]), group="model").item(),
        "max_data": mpu.all_reduce_max(torch.tensor([float(r)]), group="data").item(),
        "min_world": mpu.all_reduce(torch.tensor([float(r)]), "min").item(),
        "gather_data": [t.tolist() for t in mpu.all_gather_tensors(torch.tensor([r, 10 * r]), group="data")],
        "gather_objects_model": mpu.all_gather_objects({"rank": r}, group="model"),
        "broadcast": mpu.broadcast_object(f"from {r}", src=3),
    }


def _sp_norm_grads() -> dict[str, float]:
    """LayerNorm on this rank's sequence chunk: marked grads must equal the full-sequence grads."""
    world = mpu.get_model_parallel_world_size()
    gen = torch.Generator().manual_seed(11)
    s, b, h = 4 * world, 2, 6
    x_full, g_full = torch.randn(s, b, h, generator=gen), torch.randn(s, b, h, generator=gen)
    reference = torch.nn.LayerNorm(h)
    sharded = torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, h))
    sharded.add_module("q_norm", torch.nn.LayerNorm(h))  # excluded by name
    with torch.no_grad():
        for norm in (reference, sharded[0]):
            norm.weight.copy_(torch.randn(h, generator=gen))
            norm.bias.copy_(torch.randn(h, generator=gen))
    (reference(x_full) * g_full).sum().backward()
    marked = mpu.mark_norms_for_sequence_parallel_grad_sync(sharded)
    marked_again = mpu.mark_norms_for_sequence_parallel_grad_sync(sharded)
    x = mpu.scatter_to_sequence_parallel_region(x_full, 0)
    g = mpu.scatter_to_sequence_parallel_region(g_full, 0)
    (sharded[0](x) * g).sum().backward()
    return {
        "marked": marked,
        "marked_again": marked_again,
        "linear_marked": int(getattr(sharded[1].weight, "sequence_parallel_grad_sync", False)),
        "q_norm_marked": int(getattr(sharded.q_norm.weight, "sequence_parallel_grad_sync", False)),
        "weight_err": _err(sharded[0].weight.grad, reference.weight.grad),
        "bias_err": _err(sharded[0].bias.grad, reference.bias.grad),
    }


def _layer_errors() -> list[str]:
    """Layer shapes that TP 2 cannot split must be refused with a message naming the layer."""
    messages = []
    for build in (
        lambda: mpu.RowParallelLinear(5, 4),
        lambda: mpu.VocabParallelEmbedding(31, 4),
        lambda: mpu.ColumnParallelLinear(4, 6, output_sizes=[3, 3]),
        lambda: mpu.ColumnParallelLinear(4, 7),
        lambda: mpu.RowParallelLinear(4, 4, input_is_parallel=False, sequence_parallel=True),
    ):
        try:
            build()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def comm_checks() -> dict[str, Any]:
    """Run on 4 ranks: groups for several layouts, then mappings/fp32 at TP 4, broadcast/RNG at TP 2 x DP 2."""
    result: dict[str, Any] = {
        "groups": {f"mp{mp}_pp{pp}": _groups(mp, pp) for mp, pp in ((2, 1), (2, 2), (1, 1), (4, 1), (1, 4))}
    }
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(4)
    result["mappings"] = _mapping_errors()
    result["fp32_allreduce"] = _fp32_allreduce_sums()
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2)
    result["broadcast"] = _broadcast()
    result["collectives"] = _collectives()
    result["rng"] = _rng()
    result["sp_norm"] = _sp_norm_grads()
    result["layer_errors"] = _layer_errors()
    mpu.destroy_model_parallel()
    return result
