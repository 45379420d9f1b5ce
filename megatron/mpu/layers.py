"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

At TP size 1 these are ordinary linear/embedding layers. Initialisation is layout-invariant: every TP rank
draws the FULL fp32 master weight with ``init_method`` from the current torch default (CPU) generator, then
keeps its own shard, so one seed gives the same full model under any TP size (GPT-NeoX's
``use_cpu_initialization`` behaviour, always on).

Sharded parameters carry ``model_parallel=True``, ``tensor_model_parallel=True``, ``partition_dim``,
``partition_stride`` and ``partition_sizes`` (DeepSpeed uses the first two to count each shard once in the
gradient norm; checkpoint tools use the rest to merge and re-split shards with
:func:`megatron.mpu.utils.merge_shards` / :func:`megatron.mpu.utils.shard_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.initialize import get_model_parallel_rank, get_model_parallel_world_size
from megatron.mpu.mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
)
from megatron.mpu.utils import VocabUtility, divide, merge_shards, shard_tensor

InitMethod = Callable[[torch.Tensor], object]


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, partition_dim: int, stride: int = 1, sizes: Sequence[int] | None = None
) -> None:
    """Mark ``param`` as a TP shard split along ``partition_dim``."""
    marked: Any = param  # the TP attributes are ad-hoc tensor attributes (GPT-NeoX/DeepSpeed read them by name)
    marked.model_parallel = True
    marked.tensor_model_parallel = True
    marked.partition_dim = partition_dim
    marked.partition_stride = stride
    marked.partition_sizes = tuple(sizes) if sizes is not None else None


def _sharded_master_weight(
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    partition_dim: int,
    params_dtype: torch.dtype,
    stride: int = 1,
    sizes: Sequence[int] | None = None,
) -> nn.Parameter:
    """Draw the full fp32 weight (same on every TP rank), keep this rank's shard, cast to ``params_dtype``."""
    master = torch.empty(full_shape, dtype=torch.float32)
    if not master.is_meta:  # on the meta device (parameter counting) there are no values to draw
        init_method(master)
    shard = shard_tensor(
        master,
        partition_dim,
        get_model_parallel_rank(),
        get_model_parallel_world_size(),
        stride=stride,
        sub_sizes=sizes,
    )
    return nn.Parameter(shard.to(params_dtype))


sharded_master_weight = _sharded_master_weight  # public name for layers outside mpu (MoE experts)


class _AddBiasOnce(torch.autograd.Function):
    """Add a replicated bias to TP partial sums so that their later sum holds it once.

    Forward adds ``bias`` on TP rank 0 only; backward gives every rank the full bias gradient (the partial
    sums' gradient is the same on every rank), so replicated biases stay identical across the TP group.
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.bias_shape = bias.shape
        return partial + bias if get_model_parallel_rank() == 0 else partial.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.reshape(-1, *ctx.bias_shape).sum(dim=0)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output (row) dimension: weight ``[out/tp, in]``.

    ``stride``/``output_sizes`` describe fused outputs. The full output dimension is the concatenation of
    sub-matrices — ``stride`` equal ones, or the sizes in ``output_sizes`` (e.g. ``[h, kv*hn, kv*hn]`` for a
    blocked GQA QKV) — and each sub-matrix is split into ``tp`` contiguous parts; rank ``r`` holds
    ``[sub_0 part r | sub_1 part r | ...]``. Example, fused gated MLP with stride 2, full weight rows
    ``[x (f) | gate (f)]``: rank r holds rows ``x[r*f/tp:(r+1)*f/tp]`` then ``gate[r*f/tp:(r+1)*f/tp]``, so a
    local ``chunk(2, -1)`` of the output yields matching x/gate slices. With ``gather_output`` the gathered
    output is put back in the full layout, so it equals the unsharded layer's output.

    forward(x) returns ``(output, bias)``; ``bias`` is None unless ``skip_bias_add`` (then not added; it is
    the full bias when ``gather_output``, else this rank's shard, matching the output). Without autograd
    (inference) a skipped bias is added inside the GEMM instead and None returned: the same sum with one op
    fewer. With ``sequence_parallel`` the input is sequence-sharded along ``seq_dim`` and all-gathered first.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = nn.init.xavier_normal_,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        stride: int = 1,
        output_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        if output_sizes is not None:
            if sum(output_sizes) != output_size:
                raise ValueError(f"output_sizes {list(output_sizes)} must add up to output_size {output_size}")
            stride = len(output_sizes)
            if any(size % world != 0 for size in output_sizes):
                raise ValueError(
                    f"ColumnParallelLinear: every entry of output_sizes {list(output_sizes)} must be divisible by "
                    f"the model parallel size ({world})"
                )
        elif stride < 1 or output_size % (stride * world) != 0:
            raise ValueError(
                f"ColumnParallelLinear: output_size {output_size} must be divisible by stride ({stride}) x "
                f"model parallel size ({world})"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, world)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        self.seq_dim = seq_dim
        self.stride = stride
        self.output_sizes = tuple(output_sizes) if output_sizes is not None else None
        self.weight = _sharded_master_weight(
            (output_size, input_size), init_method, 0, params_dtype, stride, self.output_sizes
        )
        set_tensor_model_parallel_attributes(self.weight, 0, stride, self.output_sizes)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, 0, stride, self.output_sizes)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[..., in]`` (seq-sharded on ``seq_dim`` with SP) -> ``([..., out/tp or out], bias)``."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.seq_dim)
        else:
            x = copy_to_model_parallel_region(x)
        skip = self.skip_bias_add and torch.is_grad_enabled()  # without autograd the bias goes into the GEMM
        out = F.linear(x, self.weight, None if skip else self.bias)  # [..., out/tp]
        bias: torch.Tensor | None = self.bias if skip else None
        if self.gather_output:
            out = self._gather(out)  # [..., out]
            if bias is not None:
                bias = self._gather(bias)  # returned in the same (full) layout as the output
        return out, bias

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather the last dim and restore the full layout (undo the per-sub-matrix sharding)."""
        world = get_model_parallel_world_size()
        if world == 1:
            return t
        t = gather_from_model_parallel_region(t)  # rank-major order
        if self.stride > 1:
            t = merge_shards(t.chunk(world, dim=-1), -1, stride=self.stride, sub_sizes=self.output_sizes)
        return t

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size} (per partition {self.output_size_per_partition}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, stride={self.stride}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input (column) dimension: weight ``[out, in/tp]``.

    The bias is full and replicated, added once AFTER the reduction (TP-invariant). ``input_is_parallel``:
    ``x`` is already split on its last dim (e.g. the output of a ColumnParallelLinear). ``parallel_output``:
    return the per-rank partial sums unreduced; a non-skipped bias is then included so that the caller's later
    sum over TP contains it exactly once (a skipped bias must likewise be added once, after that sum).
    ``sequence_parallel``: reduce-scatter along ``seq_dim`` instead of all-reduce (needs ``input_is_parallel``).
    forward(x) returns ``(output, bias)``; ``bias`` is None unless ``skip_bias_add`` and not (inference without
    autograd at TP size 1, where the bias goes into the GEMM).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        parallel_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
    ) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        if input_size % world != 0:
            raise ValueError(
                f"RowParallelLinear: input_size {input_size} must be divisible by the model parallel size ({world})"
            )
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // world
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.parallel_output = parallel_output
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.seq_dim = seq_dim
        self.weight = _sharded_master_weight((output_size, input_size), init_method, 1, params_dtype)
        set_tensor_model_parallel_attributes(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))  # replicated
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[..., in/tp]`` (or ``[..., in]``) -> ``([..., out], bias)`` (seq-sharded with SP)."""
        if not self.input_is_parallel:
            x = scatter_to_model_parallel_region(x)
        if self.bias is not None and not torch.is_grad_enabled() and get_model_parallel_world_size() == 1:
            # inference on one TP rank: the bias goes into the GEMM (skip_bias_add callers accept bias None)
            return F.linear(x, self.weight, self.bias), None
        partial = F.linear(x, self.weight)  # [..., out], this rank's partial sum
        if self.parallel_output:
            out = partial
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.seq_dim)
        else:
            out = reduce_from_model_parallel_region(partial)
        bias: torch.Tensor | None = self.bias
        if bias is not None and self.sequence_parallel and not self.parallel_output:
            # Each rank adds the bias to its own tokens only: sum the bias gradient over TP.
            bias = copy_to_model_parallel_region(bias)
        if self.skip_bias_add or bias is None:
            return out, bias
        if self.parallel_output and get_model_parallel_world_size() > 1:
            return _AddBiasOnce.apply(out, bias), None
        return out + bias, None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} (per partition {self.input_size_per_partition}), out={self.output_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"parallel_output={self.parallel_output}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split over TP: weight ``[V/tp, h]``, rows of this rank's range.

    Ids outside the rank's range produce zero rows; the all-reduce over TP assembles the full lookup.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod = nn.init.xavier_normal_,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        if num_embeddings % world != 0:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary size {num_embeddings} must be divisible by the model "
                f"parallel size {world} (pad the vocabulary, see make_vocab_size_divisible_by)"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_model_parallel_rank(), world
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _sharded_master_weight((num_embeddings, embedding_dim), init_method, 0, params_dtype)
        set_tensor_model_parallel_attributes(self.weight, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[...]`` -> embeddings ``[..., h]`` (full, identical on every TP rank)."""
        if get_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_model_parallel_region(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, {self.vocab_end_index})"
