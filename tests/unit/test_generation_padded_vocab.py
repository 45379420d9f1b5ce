"""Generation never emits a padding id of the output layer (ids >= the tokenizer's vocabulary): GPT-NeoX samples over
the whole padded vocabulary; we mask the padding rows (docs/gpt-neox-differences.md)."""

from __future__ import annotations

import torch

from megatron.generation.sampling import SamplingConfig, generate_tokens

VOCAB, PADDED = 10, 16


def _forward(tokens: torch.Tensor, cache: object) -> torch.Tensor:
    """Logits that prefer padding id 13, then id 4."""
    logits = torch.zeros(*tokens.shape, PADDED)
    logits[..., 13] = 5.0
    logits[..., 4] = 3.0
    return logits


def test_padding_ids_are_never_generated() -> None:
    cfg = SamplingConfig(maximum_tokens=3, seq_length=16, recompute=True)
    assert generate_tokens(_forward, [1, 2], cfg, eod_token=0)[0] == [13, 13, 13]  # no vocab size given: unmasked
    assert generate_tokens(_forward, [1, 2], cfg, eod_token=0, vocab_size=VOCAB)[0] == [4, 4, 4]
