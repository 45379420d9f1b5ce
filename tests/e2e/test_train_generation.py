"""The sampling API: filters, greedy/temperature decoding, stop rules, KV cache vs recompute on a real model."""

from __future__ import annotations

import pytest
import torch

from megatron.generation.sampling import SamplingConfig, filter_logits, generate_tokens, sample_next
from megatron.neox_arguments import neox_namespace


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, top_k=2)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = filter_logits(logits, top_p=0.6)  # 0.5 < 0.6 → the token crossing the threshold (0.3) is kept
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p = filter_logits(logits, top_p=0.4)
    assert torch.isfinite(p[0, 0]) and torch.isinf(p[0, 1:]).all()
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isinf(filter_logits(shuffled, top_p=0.6)[0]).tolist() == [True, False, True, False]


def test_sample_next_modes() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_next(logits, SamplingConfig(seq_length=64)).tolist() == [1, 0]  # greedy
    g = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [sample_next(logits, SamplingConfig(top_k=1, temperature=1.0, seq_length=64), g) for _ in range(20)]
    )
    assert (draws == torch.tensor([1, 0])).all()
    cfg = SamplingConfig(temperature=100.0, seq_length=64)
    draws = torch.stack([sample_next(logits, cfg, g) for _ in range(200)])
    assert len(set(draws[:, 0].tolist())) == 3  # near-uniform at high temperature
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5, seq_length=64).validate()


class CountingLM(torch.nn.Module):
    """A deterministic causal scorer: each position predicts (token + 1) mod V; records input lengths."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.calls: list[int] = []

    def forward(self, tokens: torch.Tensor, kv_cache=None) -> torch.Tensor:
        self.calls.append(tokens.shape[1])
        nxt = (tokens + 1) % self.vocab
        return torch.nn.functional.one_hot(nxt, self.vocab).float() * 10.0


def test_generate_tokens_stops_and_budget() -> None:
    model = CountingLM()
    fwd = lambda t, c: model(t, kv_cache=c)  # noqa: E731
    new, finished = generate_tokens(fwd, [3], SamplingConfig(maximum_tokens=4, seq_length=64), eod_token=15)
    assert new == [4, 5, 6, 7] and not finished
    assert model.calls == [1, 1, 1, 1]  # KV cache: one new token per step after the prompt
    new, finished = generate_tokens(fwd, [12], SamplingConfig(maximum_tokens=10, seq_length=64), eod_token=15)
    assert new == [13, 14] and finished  # stopped at EOD
    new, _ = generate_tokens(fwd, [1], SamplingConfig(maximum_tokens=10, seq_length=4, stop_tokens=[9]), eod_token=15)
    assert new == [2, 3, 4]  # context limit seq_length
    model.calls.clear()
    generate_tokens(fwd, [1, 2], SamplingConfig(maximum_tokens=3, seq_length=64, recompute=True), eod_token=15)
    assert model.calls == [2, 3, 4]  # recompute feeds the whole context
    with pytest.raises(ValueError, match="no room"):
        generate_tokens(fwd, [1, 2, 3], SamplingConfig(seq_length=3), eod_token=15)
    new, _ = generate_tokens(fwd, [3], SamplingConfig(maximum_tokens=3, seq_length=64), eod_token=15, vocab_size=5)
    assert new == [4, 0, 1]  # id 5 (>= vocab_size) is masked, so argmax falls back to id 0


def test_kv_cache_matches_recompute_on_the_real_model() -> None:
    from megatron.generation.sampling import kv_cache_forward
    from megatron.model import GPTModelConfig, KVCache, build_sequential_model

    args = neox_namespace(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=32,
        max_position_embeddings=32,
        padded_vocab_size=64,
        pos_emb="rotary",
        init_method_std=0.3,
    )
    torch.manual_seed(0)
    model = build_sequential_model(GPTModelConfig.from_neox_args(args)).eval()
    tokens = torch.randint(0, 64, (1, 12))
    cache = KVCache()
    with torch.no_grad():
        cached = [model(tokens[:, :5], kv_cache=cache)[:, -1]]
        cached += [model(tokens[:, i : i + 1], kv_cache=cache)[:, -1] for i in range(5, 12)]
        full = model(tokens)[0, 4:]
    assert torch.allclose(torch.cat(cached), full, atol=1e-5)
    fwd = kv_cache_forward(model)
    cfg = dict(temperature=1.0, top_k=20, maximum_tokens=16, seq_length=32)
    a = generate_tokens(fwd, [5, 6], SamplingConfig(**cfg), eod_token=63, generator=torch.Generator().manual_seed(1))
    b = generate_tokens(
        fwd, [5, 6], SamplingConfig(recompute=True, **cfg), eod_token=63, generator=torch.Generator().manual_seed(1)
    )
    assert a == b and len(set(a[0])) > 1
