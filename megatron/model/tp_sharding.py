"""How every tensor of the model is split across tensor-parallel ranks (for checkpoint tools and tests).

The *full* tensor is the one a tp=1 model holds (GPT-NeoX's tp=1 checkpoint layout). A TP rank's shard:

* contiguous split along ``dim`` (embeddings, MHA query_key_value, dense/linear2 inputs, output layer);
* for a dimension made of sub-matrices (GQA ``query_key_value`` = ``[Q | K | V]`` with sizes
  ``(h, kv·hn, kv·hn)``; gated ``mlp.linear1`` = ``[up | gate]``), every sub-matrix is split and the rank keeps
  ``[Q_r | K_r | V_r]`` / ``[up_r | gate_r]`` — exactly GPT-NeoX's per-rank layout;
* Mamba mixers: ``in_proj`` per half (``[x_r | z_r]``), conv1d, dt_proj, A_log and D along the inner dimension,
  ``x_proj``/``out_proj`` weights along their input;
* replicated (norms, row-parallel biases, learned position embeddings, rotary buffers);
* gMLP blocks (``input_linear``, ``output_linear``, ``sgu.``): GPT-NeoX's per-rank layout (a contiguous split of
  ``input_linear``'s outputs, ``output_linear``'s inputs, and every rank's own gating unit, of which the ``ff`` /
  ``2·ff`` dims are split here only to count each rank's share). Such a block is a different function at another TP
  size, so these tensors are never merged or split across TP ranks (:func:`check_reshardable`).

Row-parallel biases are TP-invariant in neox-forge (added once after the reduction), so no bias scaling applies.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from megatron.model.config import GPTModelConfig
from megatron.model.mamba.sizes import mamba_inner_size

GMLP_TENSOR = re.compile(r"(^|\.)(input_linear|output_linear|sgu)\.")


def check_reshardable(name: str, tp: int) -> None:
    """Raise for a gMLP tensor split over (or merged from) more than one TP rank."""
    if tp > 1 and GMLP_TENSOR.search(name):
        raise ValueError(
            f"{name}: gmlp/amlp layers cannot change tensor parallel size (GPT-NeoX's gMLP normalises, mixes and "
            f"attends within each TP rank's slice, so the same weights compute another function at another size); "
            f"keep model_parallel_size as the checkpoint has it"
        )


def partition_spec(name: str, cfg: GPTModelConfig) -> tuple[int | None, tuple[int, ...] | None]:
    """``(partition dim or None if replicated, sub-matrix sizes along it or None)`` for a parameter name.

    ``name`` may carry any prefix (``sequential.2.``, ``2.``); only its suffix matters.
    """
    if name.endswith("word_embeddings.weight") or name.endswith("final_linear.weight"):
        return 0, None
    if "attention.query_key_value." in name:
        if cfg.is_gqa:
            kv = cfg.kv_heads * cfg.head_dim
            return 0, (cfg.hidden_size, kv, kv)
        return 0, None
    if name.endswith(("attention.dense.weight", "mlp.linear2.weight", "rm_linear.weight")):
        return 1, None
    if re.search(r"mlp\.experts\.mlp\.w[123]$", name):  # MoE experts: whole experts per TP rank
        return 0, None
    if "mlp.linear1." in name:
        return 0, ((cfg.mlp_sizes[0] // 2,) * 2 if cfg.is_gated else None)
    if ".mixer." in name:  # Mamba: the inner dimension is split (in_proj per half, [x_r | z_r])
        if re.search(r"mixer\.in_proj\.(weight|bias)$", name):
            inner = mamba_inner_size(cfg)
            return 0, (inner, inner)
        if re.search(r"mixer\.(conv1d\.(weight|bias)|dt_proj\.(weight|bias)|A_log|D)$", name):
            return 0, None
        if re.search(r"mixer\.(x_proj|out_proj)\.weight$", name):
            return 1, None
        return None, None
    if GMLP_TENSOR.search(name):  # see the module docstring: per-rank shares, never resharded
        if name.endswith(("output_linear.weight", "sgu.attn.proj_qkv.weight")):
            return 1, None
        if re.search(r"(input_linear|sgu\.norm|sgu\.attn\.proj_ffn)\.", name):
            return 0, None
        return None, None
    if name.endswith("attention.rpe.weight"):
        return 1, None
    if re.search(r"attention\.(qk|k)_layernorm\.(weight|bias|scale)$", name):
        return 0, None
    return None, None


def shard(full: torch.Tensor, dim: int, rank: int, world: int, sub_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's shard of ``full`` along ``dim`` (each sub-matrix split separately)."""
    sizes = list(sub_sizes) if sub_sizes else [full.size(dim)]
    parts = []
    for block in torch.split(full, sizes, dim=dim):
        if block.size(dim) % world:
            raise ValueError(f"size {block.size(dim)} along dim {dim} is not divisible by the TP size {world}")
        piece = block.size(dim) // world
        parts.append(block.narrow(dim, rank * piece, piece))
    return torch.cat(parts, dim=dim).contiguous()


def merge(shards: Sequence[torch.Tensor], dim: int, sub_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of ``shard`` over all ranks."""
    world = len(shards)
    sizes = [s // world for s in sub_sizes] if sub_sizes else [shards[0].size(dim)]
    per_rank = [torch.split(s, sizes, dim=dim) for s in shards]
    blocks = [torch.cat([per_rank[r][i] for r in range(world)], dim=dim) for i in range(len(sizes))]
    return torch.cat(blocks, dim=dim)


def shard_state_dict(full: dict[str, torch.Tensor], cfg: GPTModelConfig, rank: int, world: int) -> dict:
    """Shard a whole tp=1 state dict for ``rank`` of ``world``."""
    out = {}
    for name, tensor in full.items():
        check_reshardable(name, world)
        dim, subs = partition_spec(name, cfg)
        out[name] = tensor.clone() if dim is None or world == 1 else shard(tensor, dim, rank, world, subs)
    return out


def merge_state_dicts(shards: Sequence[dict[str, torch.Tensor]], cfg: GPTModelConfig) -> dict[str, torch.Tensor]:
    """Merge per-rank state dicts back to the tp=1 layout (replicated tensors are taken from rank 0)."""
    out = {}
    for name, tensor in shards[0].items():
        check_reshardable(name, len(shards))
        dim, subs = partition_spec(name, cfg)
        out[name] = tensor.clone() if dim is None or len(shards) == 1 else merge([s[name] for s in shards], dim, subs)
    return out


def rank_blocked_order(full: torch.Tensor, dim: int, world: int, sub_sizes: Sequence[int]) -> torch.Tensor:
    """Reorder ``full`` so that a plain contiguous split yields the sub-matrix-aware shards."""
    return torch.cat([shard(full, dim, r, world, sub_sizes) for r in range(world)], dim=dim)
