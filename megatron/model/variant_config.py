"""What a registered model variant reads of the model configuration.

The registries of activations (``activations.py``), norms (``norms.py``) and position embeddings
(``positional_embeddings.py``) build their modules from a model config, and ``GPTModelConfig`` (``config.py``)
reads those registries (gating, a norm's epsilon, validation of the names). So that neither side imports the
other, the entries take these protocols, which ``GPTModelConfig`` satisfies; ``tests/unit/test_import_graph.py``
fails on an import cycle, type-only imports included.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ActivationConfig(Protocol):
    """The keys an activation entry reads."""

    @property
    def activation(self) -> str: ...
    @property
    def bias_gelu_fusion(self) -> bool: ...
    @property
    def onnx_safe(self) -> bool: ...


class NormConfig(Protocol):
    """The keys a norm entry reads."""

    @property
    def norm(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def params_dtype(self) -> torch.dtype: ...
    @property
    def use_bias_in_norms(self) -> bool: ...


class PositionEmbeddingConfig(Protocol):
    """The keys (and derived sizes) a position-embedding entry reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def params_dtype(self) -> torch.dtype: ...
    @property
    def opt_pos_emb_offset(self) -> int: ...
    @property
    def rotary_emb_base(self) -> int: ...
    @property
    def rotary_ndims(self) -> int: ...
    @property
    def rotary_save_freqs_buffer(self) -> bool: ...
    @property
    def rpe_num_buckets(self) -> int: ...
    @property
    def rpe_max_distance(self) -> int: ...
