"""Small model configs shared by the unit tests that build real layers on the CPU."""

from __future__ import annotations

from megatron.model import GPTModelConfig


def tiny_gpt_config(**overrides: object) -> GPTModelConfig:
    """2 layers, hidden 32, 4 heads, vocab 128, sequence up to 64, no position embedding, seed 3; ``overrides`` win."""
    base: dict[str, object] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=128,
        max_position_embeddings=64,
        pos_emb="none",
        seed=3,
    )
    return GPTModelConfig(**{**base, **overrides})  # type: ignore[arg-type]
