"""Block-sparse causal attention over a layer's block layout (``sparse_layouts.py``): only the key blocks a query
block's layout row names are gathered and computed, so masked blocks cost nothing.

GPT-NeoX runs these layouts with DeepSpeed's Triton block-sparse kernels (``SparseSelfAttention``: scores of the
layout's blocks, a softmax over them with GPT-NeoX's causal mask added as ``-10000``, then the weighted values).
Here each query block gathers its ``M`` key blocks (``M`` = the most any row of the layout has; shorter rows are
padded and masked) into one ``[B, M * B]`` score matrix: plain PyTorch, so it runs and differentiates on CPU and GPU
alike (FlexAttention has no CPU backward in torch 2.13). Causality: blocks after the query's block are dropped
(GPT-NeoX's ``-10000`` makes their weights exactly 0 as well) and the diagonal block is causal inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron import mpu
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES, gpt_neox_layout, layout_rng


@dataclass(frozen=True)
class RowGroup:
    """Query block rows ``[start, stop)`` and the key blocks each reads: ``cols`` ``[h, rows, M]`` (padded to the
    group's fullest row), ``index`` the flat ``head * nb + col`` of every slot, ``bias`` ``[h, rows, B, M * B]`` (0
    where a query may attend, ``-inf`` elsewhere: padding, future blocks, the future inside the diagonal)."""

    start: int
    stop: int
    cols: torch.Tensor
    index: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class BlockPlan:
    """A layout's gather plan: its block rows in groups, each padded to its own fullest row (a layout whose rows
    grow, like the fixed pattern's global columns, wastes less than one padding for all)."""

    num_blocks: int
    groups: tuple[RowGroup, ...]

    @property
    def slots(self) -> int:
        """Key blocks gathered for the fullest query block."""
        return max(g.cols.shape[-1] for g in self.groups)


def block_plan(layout: torch.Tensor, block: int, row_groups: int = 4) -> BlockPlan:
    """The gather plan of a ``[h, nb, nb]`` 0/1 layout for causal attention with blocks of ``block`` tokens: one
    group of rows, or ``row_groups`` when that saves a quarter of the gathered blocks."""
    h, nb, _ = layout.shape
    rows = torch.arange(nb, device=layout.device)
    active = layout.bool() & (rows[None, :] <= rows[:, None])  # blocks after the query's block see nothing
    if not bool(active.diagonal(dim1=1, dim2=2).all()):
        raise ValueError("a sparse layout must let every block attend to itself")
    tok = torch.arange(block, device=layout.device)
    inside = tok[None, :] <= tok[:, None]  # [B(query), B(key)] causal inside the diagonal block
    fullest = active.sum(-1).amax(0)  # [nb]: the most blocks a head reads per row
    step = -(-nb // row_groups)
    grouped = sum(int(fullest[i : i + step].max()) * len(range(i, min(i + step, nb))) for i in range(0, nb, step))
    if grouped > 0.75 * nb * int(fullest.max()):  # each group costs full-size gradient buffers: worth it only if
        step = nb  # the padding it saves is large (a fixed pattern's growing rows), not for even rows
    groups = []
    for start in range(0, nb, step):
        stop = min(start + step, nb)
        part = active[:, start:stop]  # [h, rows, nb]
        counts = part.sum(-1)  # [h, rows]
        m = int(counts.max())
        cols = torch.sort(part.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :m]  # active first
        valid = torch.arange(m, device=layout.device) < counts[..., None]  # [h, rows, m]
        diagonal = cols == rows[None, start:stop, None]
        allowed = valid[..., None, None] & (~diagonal[..., None, None] | inside)  # [h, rows, m, B, B]
        allowed = allowed.permute(0, 1, 3, 2, 4).reshape(h, stop - start, block, m * block)
        bias = torch.zeros(allowed.shape, device=layout.device).masked_fill_(~allowed, float("-inf"))
        index = (torch.arange(h, device=layout.device)[:, None, None] * nb + cols).reshape(-1)
        groups.append(RowGroup(start, stop, cols, index, bias))
    return BlockPlan(nb, tuple(groups))


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float
) -> torch.Tensor:
    """Causal attention of ``q, k, v`` ``[b, h, s, d]`` restricted to ``plan``'s blocks; softmax in at least fp32."""
    b, h, s, d = q.shape
    nb = plan.num_blocks
    block = s // nb
    qb = (q * scale).reshape(b, h, nb, block, d)
    kf, vf = k.reshape(b, h * nb, block * d), v.reshape(b, h * nb, block * d)
    wide = torch.promote_types(q.dtype, torch.float32)  # half precision: softmax in fp32
    outs = []
    for g in plan.groups:
        rows, m = g.stop - g.start, g.cols.shape[-1]
        # index_select (backward: index_add) is the fast gather on CPU
        kg = kf.index_select(1, g.index).view(b, h, rows, m * block, d)  # the gathered key blocks
        vg = vf.index_select(1, g.index).view(b, h, rows, m * block, d)
        scores = torch.matmul(qb[:, :, g.start : g.stop], kg.transpose(-1, -2))  # [b, h, rows, B, M * B]
        probs = torch.softmax(scores.to(wide) + g.bias.to(wide), dim=-1).to(v.dtype)
        outs.append(torch.matmul(probs, vg))  # [b, h, rows, B, d]
    return torch.cat(outs, dim=2).reshape(b, h, s, d)


class SparseAttention(nn.Module):
    """A sparse layer's layout (this TP rank's heads) and its two executions: the block-sparse kernel, and the
    equivalent token mask for what the kernel does not cover (a KV cache, a bias, another mask, lengths that are no
    multiple of the block).

    The layout is made for all ``num_attention_heads`` at ``seq_length`` (GPT-NeoX's ``max_seq_length``), random
    blocks drawn from ``layout_rng(seed, layer)``, then sliced to this rank's heads: the same model at any TP.
    Not part of the state dict (rebuilt from the config).
    """

    def __init__(
        self, kind: str, sparsity: dict | None, num_heads: int, seq_length: int, seed: int, layer_index: int
    ) -> None:
        super().__init__()
        assert kind in SPARSE_TYPES, kind
        self.block, full = gpt_neox_layout(kind, sparsity, num_heads, seq_length, layout_rng(seed, layer_index))
        tp, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        per_rank = num_heads // tp
        self.layout: torch.Tensor  # bool [heads/tp, nb, nb]
        grids = full[rank * per_rank : (rank + 1) * per_rank]
        if all(g is grids[0] for g in grids):  # one layout for every head: one tensor, expanded
            mine = torch.tensor(grids[0], dtype=torch.bool).expand(per_rank, -1, -1)
        else:
            mine = torch.tensor(grids, dtype=torch.bool)
        self.register_buffer("layout", mine, persistent=False)
        self._plans: dict[tuple[int, torch.device], BlockPlan] = {}

    @property
    def max_tokens(self) -> int:
        return self.layout.shape[-1] * self.block

    def kernel_applies(self, s: int) -> bool:
        """Whether ``s`` tokens (no cache) run on the block-sparse kernel."""
        return s % self.block == 0 and s <= self.max_tokens

    def plan(self, nb: int, device: torch.device) -> BlockPlan:
        key = (nb, device)
        if key not in self._plans:
            self._plans[key] = block_plan(self.layout[:, :nb, :nb].to(device), self.block)
        return self._plans[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Block-sparse causal attention of ``[b, heads/tp, s, hn]`` tensors (``kernel_applies(s)``)."""
        return block_sparse_attention(q, k, v, self.plan(q.shape[2] // self.block, q.device), scale)

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[heads/tp, sq, sk]``: the layout at token level (causality is the caller's)."""
        last = int(max(q_pos.max(), k_pos.max()))
        if last >= self.max_tokens:
            raise ValueError(
                f"sparse attention covers the {self.max_tokens} positions of seq_length (its layout's size); "
                f"got position {last}"
            )
        layout = self.layout.to(q_pos.device)
        return layout[:, (q_pos // self.block)[:, None], (k_pos // self.block)[None, :]]
