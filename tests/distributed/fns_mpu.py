"""Tensor-parallel layer cases, run both on TP ranks (spawned) and in the test process (TP size 1).

``run_case`` builds one layer from a fixed seed, runs forward and backward on fixed inputs and returns FULL
(unsharded) tensors: output, input gradient, weight, weight gradient, bias gradient. The same function at
TP size 1 is the unsharded reference, so comparing the two checks values, gradients and init invariance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron import mpu

S, B, H = 8, 2, 16  # sequence, batch, hidden: [s, b, h] activations
V = 32  # vocabulary
SEED = 1234


def _tp() -> tuple[int, int]:
    return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    world = _tp()[1]
    if world == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=mpu.get_model_parallel_group())
    return parts


def _sum_tp(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if _tp()[1] > 1:
        dist.all_reduce(t, group=mpu.get_model_parallel_group())
    return t


def full_param(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rebuild the full tensor of ``t`` (a param or its grad) using the partition attributes of ``like``."""
    if not getattr(like, "tensor_model_parallel", False) or _tp()[1] == 1:
        return t.detach().clone()
    return mpu.merge_shards(
        _all_gather(t.detach()), like.partition_dim, stride=like.partition_stride, sub_sizes=like.partition_sizes
    )


def _shard(full: torch.Tensor, dim: int, **kw: Any) -> torch.Tensor:
    rank, world = _tp()
    return mpu.shard_tensor(full, dim, rank, world, **kw)


def _inputs(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _init(t: torch.Tensor) -> None:
    nn.init.normal_(t, std=0.5)


def _column(case: dict) -> dict[str, torch.Tensor]:
    out_size, stride, sizes = case.get("out", 24), case.get("stride", 1), case.get("sizes")
    gather, sp, skip = case.get("gather_output", True), case.get("sp", False), case.get("skip_bias_add", False)
    torch.manual_seed(SEED)
    layer = mpu.ColumnParallelLinear(
        H,
        out_size,
        gather_output=gather,
        init_method=_init,
        skip_bias_add=skip,
        sequence_parallel=sp,
        seq_dim=0,
        stride=stride,
        output_sizes=sizes,
    )
    x_full, g_full, bias_full = _inputs((S, B, H), (S, B, out_size), (out_size,))
    with torch.no_grad():
        layer.bias.copy_(_shard(bias_full, 0, stride=stride, sub_sizes=sizes))
    x = x_full.clone().requires_grad_()
    x_in = _shard(x, 0) if sp and _tp()[1] > 1 else x  # differentiable narrow: this rank's sequence chunk
    out, bias = layer(x_in)
    if skip:
        out = out + bias
    g = g_full if gather else _shard(g_full, -1, stride=stride, sub_sizes=sizes)
    (out * g).sum().backward()
    if gather:
        full_out = out.detach()
    else:
        full_out = mpu.merge_shards(_all_gather(out.detach()), -1, stride=stride, sub_sizes=sizes)
    x_grad = _sum_tp(x.grad) if sp else x.grad
    return {
        "out": full_out,
        "x_grad": x_grad,
        "weight": full_param(layer.weight, layer.weight),
        "weight_grad": full_param(layer.weight.grad, layer.weight),
        "bias_grad": full_param(layer.bias.grad, layer.bias),
    }


def _row(case: dict) -> dict[str, torch.Tensor]:
    out_size = case.get("out", 12)
    parallel_in, parallel_out = case.get("input_is_parallel", False), case.get("parallel_output", False)
    sp, skip = case.get("sp", False), case.get("skip_bias_add", False)
    torch.manual_seed(SEED)
    layer = mpu.RowParallelLinear(
        H,
        out_size,
        input_is_parallel=parallel_in,
        init_method=_init,
        skip_bias_add=skip,
        parallel_output=parallel_out,
        sequence_parallel=sp,
        seq_dim=0,
    )
    x_full, g_full, bias_full = _inputs((S, B, H), (S, B, out_size), (out_size,))
    with torch.no_grad():
        layer.bias.copy_(bias_full)
    x = x_full.clone().requires_grad_()
    x_in = _shard(x, -1) if parallel_in else x
    out, bias = layer(x_in)
    tp_sp = sp and _tp()[1] > 1
    if skip:
        out = out + bias
    g = _shard(g_full, 0) if tp_sp else g_full
    (out * g).sum().backward()
    if parallel_out:
        full_out = _sum_tp(out.detach())
    elif tp_sp:
        full_out = torch.cat(_all_gather(out.detach()), dim=0)
    else:
        full_out = out.detach()
    return {
        "out": full_out,
        "x_grad": _sum_tp(x.grad) if parallel_in else x.grad,
        "weight": full_param(layer.weight, layer.weight),
        "weight_grad": full_param(layer.weight.grad, layer.weight),
        "bias_grad": layer.bias.grad.clone(),  # replicated: every rank must hold the full gradient
    }


def _embedding(case: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    layer = mpu.VocabParallelEmbedding(V, H, init_method=_init)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    ids[0, :4] = torch.tensor([0, V - 1, 7, 7])  # range edges and a repeated id
    (g,) = _inputs((B, S, H))
    out = layer(ids)
    (out * g).sum().backward()
    return {
        "out": out.detach(),
        "weight": full_param(layer.weight, layer.weight),
        "weight_grad": full_param(layer.weight.grad, layer.weight),
    }


def _cross_entropy(case: dict) -> dict[str, torch.Tensor]:
    logits_full, g = _inputs((S, B, V), (S, B))
    logits_full = logits_full * 3
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(6))
    target[0] = torch.tensor([0, V - 1])
    logits = _shard(logits_full, -1).requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    (loss * g).sum().backward()
    return {"loss": loss.detach(), "logits_grad": torch.cat(_all_gather(logits.grad), dim=-1)}


CASES: dict[str, dict] = {
    "column_gather": {"kind": "column"},
    "column_parallel_out": {"kind": "column", "gather_output": False},
    "column_stride2": {"kind": "column", "stride": 2},
    "column_stride3_parallel_out": {"kind": "column", "stride": 3, "gather_output": False},
    "column_gqa_sizes": {"kind": "column", "out": 32, "sizes": [16, 8, 8]},
    "column_skip_bias": {"kind": "column", "gather_output": False, "skip_bias_add": True},
    "column_gather_skip_bias_stride2": {"kind": "column", "stride": 2, "skip_bias_add": True},
    "column_sp": {"kind": "column", "gather_output": False, "sp": True},
    "row": {"kind": "row"},
    "row_input_parallel": {"kind": "row", "input_is_parallel": True},
    "row_parallel_output": {"kind": "row", "input_is_parallel": True, "parallel_output": True},
    "row_skip_bias": {"kind": "row", "input_is_parallel": True, "skip_bias_add": True},
    "row_sp": {"kind": "row", "input_is_parallel": True, "sp": True},
    "row_sp_skip_bias": {"kind": "row", "input_is_parallel": True, "sp": True, "skip_bias_add": True},
    "embedding": {"kind": "embedding"},
    "cross_entropy": {"kind": "cross_entropy"},
}


def run_case(name: str) -> dict[str, torch.Tensor]:
    """Run one case by name at the current TP size; return full tensors."""
    case = CASES[name]
    fn = {"column": _column, "row": _row, "embedding": _embedding, "cross_entropy": _cross_entropy}[case["kind"]]
    return fn(case)


def to_numpy(tree: Any) -> Any:
    """Tensors -> numpy arrays, recursively (torch tensors sent through a multiprocessing queue live in shared
    memory that vanishes when the rank exits)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().float().numpy().copy() if tree.is_floating_point() else tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_numpy(v) for v in tree)
    return tree


def run_all_cases(tp: int) -> dict[str, dict[str, Any]]:
    """On spawned ranks: initialise TP of size ``tp`` and run every case (results as numpy arrays)."""
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp)
    try:
        return to_numpy({name: run_case(name) for name in CASES})
    finally:
        mpu.destroy_model_parallel()
