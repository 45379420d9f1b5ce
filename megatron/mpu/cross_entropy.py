"""Cross entropy over logits whose vocabulary dimension is split across the tensor-parallel group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.mpu.initialize import (
    get_fp32_allreduce,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
)
from megatron.mpu.utils import VocabUtility


def _tp_all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if get_model_parallel_world_size() == 1:
        return x
    half = x.dtype in (torch.float16, torch.bfloat16)
    out = x.float() if get_fp32_allreduce() and half and op == dist.ReduceOp.SUM else x.clone()
    dist.all_reduce(out, op=op, group=get_model_parallel_group())
    return out.to(x.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # logits [..., V/tp], target [...]
        logits_max = _tp_all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)  # not in place: the caller may still use the logits
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), get_model_parallel_rank(), get_model_parallel_world_size()
        )
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _tp_all_reduce(predicted)
        exp = shifted.exp()
        sum_exp = _tp_all_reduce(exp.sum(dim=-1))
        loss = torch.log(sum_exp) - predicted  # [...]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target); the one-hot lives on the rank that owns the target.
        grad = softmax.clone()
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad * grad_loss.unsqueeze(-1), None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``log(sum(exp(logits))) - logits[target]`` for logits ``[..., V/tp]`` and ids ``[...]``.

    No ignore-index and no reduction: mask and average with the loss mask outside. Computed in the logits'
    dtype (pass ``logits.float()`` for fp32 loss).
    """
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits shape "
            f"without its last (vocab) dim {tuple(vocab_parallel_logits.shape[:-1])}"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
