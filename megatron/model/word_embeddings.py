"""Input embedding (GPT-NeoX ``Embedding`` / ``EmbeddingPipe``): vocab-parallel word embeddings plus learned or
sinusoidal positions, embedding dropout, and the sequence-parallel scatter."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.positional_embeddings import SinusoidalPositionalEmbedding
from megatron.model.seeding import seeded


class LearnedPositionEmbedding(nn.Module):
    """Replicated learned position table ``weight`` ``[max_position_embeddings, h]`` (drawn in fp32, then cast;
    the parameter is created in ``__init__`` so DeepSpeed ``zero.Init`` can partition it)."""

    def __init__(self, cfg: GPTModelConfig, init_method: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        master = torch.empty(cfg.max_position_embeddings, cfg.hidden_size, dtype=torch.float32)
        init_method(master)
        self.weight = nn.Parameter(master.to(cfg.params_dtype))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` rows for integer ``positions``."""
        return F.embedding(positions, self.weight)


class Embedding(nn.Module):
    """``word_embeddings`` (``[V/tp, h]``) + optional ``position_embeddings``; output ``[b, s, h]``."""

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        init_method, _ = init_methods(cfg)
        self.word_embeddings = mpu.VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, init_method=init_method, params_dtype=cfg.params_dtype
        )
        self.position_embeddings: LearnedPositionEmbedding | SinusoidalPositionalEmbedding
        if cfg.pos_emb == "learned":
            self.position_embeddings = LearnedPositionEmbedding(cfg, init_method)
        elif cfg.pos_emb == "sinusoidal":
            self.position_embeddings = SinusoidalPositionalEmbedding(cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids`` [b, s] → ``[b, s(/tp with SP), h]``."""
        emb = self.word_embeddings(input_ids)
        if self.cfg.pos_emb == "learned":
            positions = position_ids + self.cfg.opt_pos_emb_offset
            if positions.numel() and int(positions.max()) >= self.cfg.max_position_embeddings:
                raise ValueError(
                    f"position {int(positions.max())} is beyond max_position_embeddings="
                    f"{self.cfg.max_position_embeddings} (learned position embeddings)"
                )
            emb = emb + self.position_embeddings(positions)
        elif self.cfg.pos_emb == "sinusoidal":
            emb = emb + self.position_embeddings(position_ids, emb.dtype)
        emb = self.embedding_dropout(emb)
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
