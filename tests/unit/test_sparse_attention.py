"""Block-sparse attention (``megatron/model/sparse_attention.py``) equals dense attention masked with the same
layout at token level (the reference, built here), forward and backward, for every sparse type; the model's sparse
layers run it, and the layers' dense fallback (KV cache) agrees with it."""

from __future__ import annotations

import random

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.sparse_attention import SparseAttention, block_plan, block_sparse_attention
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES, gpt_neox_layout

SPARSITY = {
    "block": 4,
    "num_local_blocks": 2,
    "num_random_blocks": 1,
    "different_layout_per_head": True,
    "num_different_global_patterns": 2,
    "num_sliding_window_blocks": 3,
    "local_window_blocks": [1, 2],
    "global_block_indices": [1],
}


def dense_reference(q, k, v, layout, block, scale):
    """Plain attention with GPT-NeoX's mask: causal, plus -inf outside the layout's blocks."""
    s = q.shape[2]
    pos = torch.arange(s)
    allowed = layout.bool()[:, pos[:, None] // block, pos[None, :] // block] & (pos[None, :] <= pos[:, None])
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def layout_of(kind: str, sparsity: dict, heads: int, s: int, seed: int) -> tuple[int, torch.Tensor]:
    block, layout = gpt_neox_layout(kind, sparsity, heads, s, random.Random(seed))
    return block, torch.tensor(layout)


def _sparsity_for(kind: str) -> dict:
    if kind == "sparse_fixed":  # variable's local_window_blocks would be ignored; fixed needs num_local_blocks even
        return {**SPARSITY, "num_local_blocks": 4}
    return SPARSITY


@pytest.mark.parametrize("kind", SPARSE_TYPES)
def test_kernel_equals_dense_masked_attention_forward_and_backward(kind: str) -> None:
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 32, 8
    block, layout = layout_of(kind, _sparsity_for(kind), h, s, 3)
    assert 0 < layout.tril().sum() < h * (s // block) * (s // block + 1) // 2  # sparse, not empty
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d, dtype=torch.float64)
    ours = block_sparse_attention(q, k, v, block_plan(layout, block), 0.3)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref = dense_reference(q, k, v, layout, block, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_kernel_reads_only_the_layouts_blocks() -> None:
    """Each query block gathers exactly its layout row's blocks up to itself (padding masked): nothing else."""
    block, layout = layout_of("sparse_fixed", {"block": 4, "num_local_blocks": 2}, 2, 64, 0)
    plan = block_plan(layout, block)
    nb = layout.shape[-1]
    assert [(g.start, g.stop) for g in plan.groups] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    fullest = layout.tril().sum(-1)  # [h, nb]
    assert plan.slots == int(fullest.max()) < nb  # slots: the fullest row's blocks
    for g in plan.groups:
        assert g.cols.shape[-1] == int(fullest[:, g.start : g.stop].max())  # each group padded to its own rows
        for h in range(2):
            for i, row in enumerate(range(g.start, g.stop)):
                read = g.bias[h, i, -1].view(-1, block)[:, 0] == 0  # the block's last query, key 0 of each slot
                assert sorted(g.cols[h, i][read].tolist()) == [c for c in range(row + 1) if layout[h, row, c]]
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grouped = block_sparse_attention(q, k, v, plan, 0.5)  # 4 row groups, each padded to its own rows
    assert len(block_plan(layout, block, row_groups=1).groups) == 1
    torch.testing.assert_close(grouped, dense_reference(q, k, v, layout, block, 0.5), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(grouped)
    ours, ref = (
        torch.autograd.grad(out, (q, k, v), g) for out in (grouped, dense_reference(q, k, v, layout, block, 0.5))
    )
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_sequences_shorter_than_seq_length_use_the_layouts_corner() -> None:
    sparse = SparseAttention("bigbird", {"block": 4}, 2, 32, seed=5, layer_index=1)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    assert sparse.kernel_applies(16) and not sparse.kernel_applies(18) and not sparse.kernel_applies(36)
    ref = dense_reference(q, k, v, sparse.layout[:, :4, :4], 4, 0.5)
    torch.testing.assert_close(sparse(q, k, v, 0.5), ref)
    with pytest.raises(ValueError, match="covers the 32 positions"):
        sparse.allowed(torch.arange(30, 33), torch.arange(33))


def _cfg(kind: str, **kw) -> GPTModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        sparse_layout_tokens=32,
        max_position_embeddings=32,
        padded_vocab_size=64,
        pos_emb="rotary",
        init_method_std=0.2,
        attention_config=[[["global", kind], 1]],
        sparsity_config=_sparsity_for(kind),
    )
    return GPTModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["local", "sparse_variable"])  # the kernel test above covers every type
def test_model_sparse_layer_equals_its_dense_masked_fallback(kind: str) -> None:
    """The model's sparse layer (block-sparse kernel) gives the logits and gradients of the same layer forced onto
    the dense path with the layout as a token mask (a mask tensor that is not plain causal switches the path)."""
    torch.manual_seed(0)
    model = build_sequential_model(_cfg(kind)).double()
    calls = []
    for module in model.modules():
        if isinstance(module, SparseAttention):
            module.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 64, (2, 32))
    sparse_logits = model(ids)
    assert len(calls) == 1  # the one sparse layer ran the kernel
    sparse_grads = torch.autograd.grad(sparse_logits.square().sum(), list(model.parameters()))
    causal = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1).expand(2, 1, 32, 32)  # batch 2: dense path
    dense_logits = model(ids, attention_mask=causal)
    assert len(calls) == 1  # ... and this time the dense path
    dense_grads = torch.autograd.grad(dense_logits.square().sum(), list(model.parameters()))
    torch.testing.assert_close(sparse_logits, dense_logits, rtol=1e-10, atol=1e-10)
    for a, r in zip(sparse_grads, dense_grads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    global_logits = build_sequential_model(_cfg("global", sparsity_config=None)).double()
    global_logits.load_state_dict(model.state_dict())
    assert not torch.allclose(global_logits(ids), sparse_logits)  # the layout changes the result


def test_gqa_sparse_layers_repeat_the_kv_heads() -> None:
    torch.manual_seed(0)
    model = build_sequential_model(_cfg("bslongformer", num_kv_heads=2)).double()
    ids = torch.randint(0, 64, (2, 32))
    causal = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1).expand(2, 1, 32, 32)
    torch.testing.assert_close(model(ids), model(ids, attention_mask=causal), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos_emb", ["alibi", "rpe"])
def test_position_biases_apply_to_sparse_layers_with_the_layout(pos_emb: str) -> None:
    """GPT-NeoX's sparse path leaves ALiBi out; here a one-layer sparse model with ALiBi (or RPE) equals the global
    model given the layout as its attention mask (the same layout for every head: different_layout_per_head false)."""
    torch.manual_seed(0)
    sparsity = {"block": 4, "num_sliding_window_blocks": 3, "num_random_blocks": 1}
    one: dict = dict(num_layers=1, pos_emb=pos_emb, rpe_num_buckets=8, rpe_max_distance=16)
    sparse = build_sequential_model(
        _cfg("bigbird", **one, attention_config=[[["bigbird"], 1]], sparsity_config=sparsity)
    )
    dense = build_sequential_model(_cfg("global", **one, attention_config=[[["global"], 1]], sparsity_config=None))
    sparse, dense = sparse.double(), dense.double()
    dense.load_state_dict(sparse.state_dict())
    layout = next(m for m in sparse.modules() if isinstance(m, SparseAttention)).layout[0]
    pos = torch.arange(32)
    masked = ~(layout[pos[:, None] // 4, pos[None, :] // 4] & (pos[None, :] <= pos[:, None]))
    assert masked.sum() > torch.triu(torch.ones(32, 32), 1).sum()  # the layout masks more than causality
    ids = torch.randint(0, 64, (2, 32))
    torch.testing.assert_close(sparse(ids), dense(ids, attention_mask=masked.expand(2, 1, 32, 32)))
    assert not torch.allclose(sparse(ids), dense(ids))


def test_layouts_are_not_in_the_state_dict() -> None:
    model = build_sequential_model(_cfg("sparse_fixed"))
    assert not [k for k in model.state_dict() if "layout" in k]
    assert any(isinstance(m, SparseAttention) for m in model.modules())


def test_hf_export_refuses_sparse_layers() -> None:
    """Hugging Face models have no block-sparse attention: exporting one would silently make its layers dense."""
    from megatron.model.hf_mapping import neox_to_hf_config

    with pytest.raises(ValueError, match="attention_config 'bigbird' layers"):
        neox_to_hf_config(_cfg("bigbird"))
