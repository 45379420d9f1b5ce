"""Inference-side behaviour of the model: masks and positions, packed documents, padded batches, KV cache."""

from __future__ import annotations

import pytest
import torch

from megatron.model import KVCache, build_sequential_model, get_ltor_masks_and_position_ids
from tests.unit.test_model import V, tiny

# ----------------------------------------------------------------------------------------------------------------
# masks, positions, packed documents


def test_ltor_masks_and_positions() -> None:
    eod = 0
    data = torch.tensor([[5, 6, eod, 7, 8, 9], [1, 2, 3, 4, 5, 6]])
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(data, eod)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))
    assert torch.equal(pos, torch.arange(6).expand(2, 6)) and loss_mask.sum() == 12
    _, loss_mask, _ = get_ltor_masks_and_position_ids(data, eod, eod_mask_loss=True)
    assert loss_mask[0, 2] == 0 and loss_mask.sum() == 11
    mask, _, _ = get_ltor_masks_and_position_ids(data, eod, sliding_window_width=2)
    allowed = ~mask[0, 0]
    assert allowed[5].tolist() == [False, False, False, True, True, True]
    mask, _, pos = get_ltor_masks_and_position_ids(data, eod, reset_position_ids=True, reset_attention_mask=True)
    assert mask.shape == (2, 1, 6, 6)
    assert pos[0].tolist() == [0, 1, 2, 0, 1, 2] and pos[1].tolist() == list(range(6))
    assert (~mask[0, 0, 4]).tolist() == [False, False, False, True, True, False]
    assert (~mask[0, 0, 2]).tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("pos_emb", ["rotary", "learned", "alibi"])
def test_packed_documents_with_resets_equal_separate_documents(pos_emb: str) -> None:
    eod = 0
    model = build_sequential_model(tiny(pos_emb=pos_emb)).eval()
    doc1, doc2 = torch.tensor([[3, 4, 5, eod]]), torch.tensor([[7, 8, 9, 10, 11]])
    packed = torch.cat((doc1, doc2), dim=1)
    mask, _, pos = get_ltor_masks_and_position_ids(packed, eod, reset_position_ids=True, reset_attention_mask=True)
    with torch.no_grad():
        together = model(packed, pos, mask)
        assert (together[:, :4] - model(doc1)).abs().max() <= 1e-5
        assert (together[:, 4:] - model(doc2)).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize(
    "changes",
    [
        dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm"),
        dict(pos_emb="learned", gpt_j_residual=True),
        dict(pos_emb="alibi"),
        dict(pos_emb="rpe", rpe_num_buckets=8, rpe_max_distance=16),
        dict(
            sliding_window_width=3,
            attention_config=[[["global", "local"], "all"]],
            sparsity_config={"block": 4},
            seq_length=64,
        ),
        # block-sparse layers: lengths that are multiples of the block run the kernel, the cache the token mask
        dict(
            attention_config=[[["sparse_fixed", "bigbird"], "all"]],
            sparsity_config={"block": 4, "num_local_blocks": 2},
            seq_length=64,
        ),
        dict(params_dtype=torch.bfloat16, attention_softmax_in_fp32=True),
        dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk", activation="swiglu"),  # MoE: token-wise
        dict(moe_num_experts=4, moe_expert_interval=2, gpt_j_residual=True),  # Sinkhorn router in eval: top-k
    ],
)
def test_cached_greedy_decode_equals_uncached(changes: dict) -> None:
    cfg = tiny(**changes)
    model = build_sequential_model(cfg).eval()
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    steps = 8
    with torch.no_grad():
        tokens = prompt
        for _ in range(steps):  # uncached: recompute everything
            tokens = torch.cat((tokens, model(tokens)[:, -1:].argmax(-1)), dim=1)
        cache = KVCache()
        logits = model(prompt, kv_cache=cache)
        cached = prompt
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            cached = torch.cat((cached, nxt), dim=1)
            logits = model(nxt, kv_cache=cache)
        full = model(cached)
    assert torch.equal(cached, tokens)
    assert cache.seq_len == prompt.shape[1] + steps
    tol = 1e-5 if cfg.params_dtype == torch.float32 else 5e-2
    assert (logits[:, -1] - full[:, -1]).abs().max() <= tol


def test_kv_cache_with_explicit_full_mask_is_sliced() -> None:
    model = build_sequential_model(tiny()).eval()
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(6))
    mask, _, pos = get_ltor_masks_and_position_ids(ids, eod_token=-1)
    with torch.no_grad():
        full = model(ids, pos, mask)
        cache = KVCache()
        model(ids[:, :6], pos[:, :6], mask, kv_cache=cache)
        step = model(ids[:, 6:], pos[:, 6:], mask, kv_cache=cache)
    assert (step - full[:, 6:]).abs().max() <= 1e-5


@pytest.mark.parametrize("pos_emb", ["rotary", "alibi"])
def test_left_padded_batch_equals_unpadded_sequences(pos_emb: str) -> None:
    """Batched prompts of different lengths: left padding + mask + position ids reproduce the unpadded logits."""
    model = build_sequential_model(tiny(pos_emb=pos_emb, num_kv_heads=2)).eval()
    short, long = torch.tensor([[5, 6, 7]]), torch.tensor([[9, 8, 7, 6, 5, 4]])
    pad = 3
    batch = torch.cat((torch.cat((torch.zeros(1, pad, dtype=torch.long), short), 1), long))
    valid = torch.ones(batch.shape, dtype=torch.bool)
    valid[0, :pad] = False
    position_ids = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal_masked = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    mask = (causal_masked[None] | ~valid[:, None, :]).unsqueeze(1)  # [b, 1, s, s], pad keys masked
    with torch.no_grad():
        logits = model(batch, position_ids, mask)
        assert torch.isfinite(logits).all()
        assert (logits[0, pad:] - model(short)[0]).abs().max() <= 1e-5
        assert (logits[1] - model(long)[0]).abs().max() <= 1e-5


def test_kv_cache_storage_grows_and_returns_the_concatenation() -> None:
    cache = KVCache()
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(2, 3, n, 4, generator=g) for n in (5, 1, 12, 1, 1, 30, 2)]
    for i, chunk in enumerate(chunks):
        k, v = cache.update(7, chunk, -chunk)
        expected = torch.cat(chunks[: i + 1], dim=2)
        assert torch.equal(k, expected) and torch.equal(v, -expected)
        assert cache.past_length(7) == expected.shape[2]
    assert cache.past_length(0) == 0
    cache.reset()
    assert cache.past_length(7) == 0 and cache.seq_len == 0


def test_rotate_in_place_is_bitwise_apply_rotary() -> None:
    from megatron.model.positional_embeddings import RotaryEmbedding, apply_rotary, rotate_in_place

    rope = RotaryEmbedding(8)
    pos = torch.arange(3, 8)[None].expand(2, 5)
    x = torch.randn(5, 2, 4, 12, generator=torch.Generator().manual_seed(0))  # [s, b, heads, hn]
    cos, sin = rope(pos, x.dtype)  # [b, s, rot]
    with torch.no_grad():
        scos, ssin = rope.signed_tables(pos, x.dtype)  # [s, b, 1, rot]
    want = apply_rotary(x, cos.transpose(0, 1)[:, :, None], sin.transpose(0, 1)[:, :, None])
    got = x.clone()
    rotate_in_place(got, scos, ssin)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)


@pytest.mark.parametrize(
    "changes",
    [
        dict(rotary_pct=0.25, gpt_j_residual=True),  # MHA: q and k rotated together inside the QKV output
        dict(num_kv_heads=2),  # GQA: q and k rotated separately
        dict(use_qk_layernorm=True),  # QK norm before the rotation
        dict(params_dtype=torch.bfloat16, rotary_pct=0.5),
    ],
)
def test_inference_forward_equals_the_autograd_forward(changes: dict) -> None:
    """No-grad forwards rotate q/k in place, skip copies and put biases into the GEMMs: same logits up to rounding."""
    model = build_sequential_model(tiny(**changes)).eval()
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.enable_grad():
        reference = model(ids).detach()
    with torch.no_grad():
        plain = model(ids)
        cache = KVCache()
        model(ids[:, :5], kv_cache=cache)
        step = model(ids[:, 5:6], kv_cache=cache)
    tol = 1e-5 if changes.get("params_dtype") is None else 5e-2
    assert (plain - reference).abs().max() <= tol
    assert (step - reference[:, 5:6]).abs().max() <= tol
    assert plain.argmax(-1).equal(reference.argmax(-1))
