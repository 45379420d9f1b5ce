"""The GPT model family (GPT-NeoX/Pythia, Llama/Mistral) behind the ``megatron.mpu`` layer API.

Public API: :class:`GPTModelConfig`, :func:`build_layer_specs`, :func:`build_sequential_model`,
:class:`GPT2ModelPipe` / :func:`build_pipeline_model`, :func:`cross_entropy`,
:func:`get_ltor_masks_and_position_ids`, :class:`KVCache`; weight mapping in :mod:`megatron.model.hf_mapping`.
"""

from megatron.model.config import GPTModelConfig, pad_vocab_size
from megatron.model.gpt2_model import (
    GPT2ModelPipe,
    GPTSequential,
    build_layer_specs,
    build_pipeline_model,
    build_sequential_model,
    cross_entropy,
)
from megatron.model.kv_cache import KVCache
from megatron.model.utils import get_ltor_masks_and_position_ids

__all__ = [
    "GPT2ModelPipe",
    "GPTModelConfig",
    "GPTSequential",
    "KVCache",
    "build_layer_specs",
    "build_pipeline_model",
    "build_sequential_model",
    "cross_entropy",
    "get_ltor_masks_and_position_ids",
    "pad_vocab_size",
]
