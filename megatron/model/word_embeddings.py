"""Input embedding (GPT-NeoX ``Embedding`` / ``EmbeddingPipe``): vocab-parallel word embeddings plus learned or
sinusoidal positions, embedding dropout, and the sequence-parallel scatter."""

from __future__ import annotations

import torch
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.positional_embeddings import POSITION_EMBEDDINGS
from megatron.model.seeding import seeded


class Embedding(nn.Module):
    """``word_embeddings`` (``[V/tp, h]``) + optional ``position_embeddings``; output ``[b, s, h]``.

    ``mup_output_mult``: the readout multiplier when this embedding is tied with the output layer (set by
    ``megatron.model.mup.apply_mup``; 1 without muP).
    """

    mup_output_mult: float = 1.0

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        init_method, _ = init_methods(cfg)
        self.word_embeddings = mpu.VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, init_method=init_method, params_dtype=cfg.params_dtype
        )
        build_position = POSITION_EMBEDDINGS.get(cfg.pos_emb).embedding
        self.position_embeddings = build_position(cfg, init_method) if build_position is not None else None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids`` [b, s] → ``[b, s(/tp with SP), h]``."""
        emb = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            position = self.position_embeddings(position_ids, emb.dtype)
            if self.cfg.mup_rp_embedding_mult != 1.0:
                position = position * self.cfg.mup_rp_embedding_mult
            emb = emb + position
        emb = self.embedding_dropout(emb)
        if self.cfg.use_mup and self.cfg.mup_embedding_mult != 1.0:
            emb = emb * self.cfg.mup_embedding_mult
        if self.cfg.sequence_parallel and mpu.get_model_parallel_world_size() > 1:
            emb = mpu.scatter_to_sequence_parallel_region(emb, 1)
        return emb


class EmbeddingPipe(Embedding):
    """Pipeline stage 0: ``(input_ids, position_ids, attention_mask)`` → ``(hidden [b,s,h], position_ids, mask)``.

    Built under ``seed + spec_index`` (restoring the global RNG afterwards) so weights do not depend on the
    pipeline partition. ``word_embeddings_weight`` is the attribute tied with the output layer.
    """

    def __init__(self, cfg: GPTModelConfig, spec_index: int = 0) -> None:
        with seeded(cfg.seed + spec_index):
            super().__init__(cfg)

    @property
    def word_embeddings_weight(self) -> nn.Parameter:
        """The (vocab-parallel) word embedding matrix, tied with the output layer when weights are tied."""
        return self.word_embeddings.weight

    def forward(self, args: tuple) -> tuple:  # type: ignore[override]
        """Embed a ``(input_ids, position_ids, attention_mask)`` tuple."""
        input_ids, position_ids, attention_mask = args
        return super().forward(input_ids, position_ids), position_ids, attention_mask
