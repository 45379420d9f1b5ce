"""Tokenizers of every GPT-NeoX ``tokenizer_type``, loaded from local files, and ``padded_vocab_size``."""

from typing import Any

from megatron.neox_arguments.derive import padded_vocab_size
from megatron.neox_arguments.gpt_neox_api import TOKENIZER_BUILDER
from megatron.tokenizer.tokenizer import (
    EOD_TOKEN,
    PAD_TOKEN,
    TOKENIZER_TYPES,
    AbstractTokenizer,
    CharLevelTokenizer,
    GPT2BPETokenizer,
    HFGPT2Tokenizer,
    HFTokenizer,
    SPMTokenizer,
    TiktokenTokenizer,
    TokenizerConfig,
    build_tokenizer,
)


def build_neox_args_tokenizer(args: Any) -> AbstractTokenizer:
    """GPT-NeoX's ``neox_args.build_tokenizer()``: build, attach as ``args.tokenizer``, set ``padded_vocab_size``."""
    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
    padded = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
    args.update_value("padded_vocab_size", padded)
    args.update_value("tokenizer", tokenizer)
    return tokenizer


TOKENIZER_BUILDER.provide(build_neox_args_tokenizer)  # NeoXArgs.build_tokenizer() (the config layer is below this one)

__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "TOKENIZER_TYPES",
    "AbstractTokenizer",
    "CharLevelTokenizer",
    "GPT2BPETokenizer",
    "HFGPT2Tokenizer",
    "HFTokenizer",
    "SPMTokenizer",
    "TiktokenTokenizer",
    "TokenizerConfig",
    "build_neox_args_tokenizer",
    "build_tokenizer",
    "padded_vocab_size",
]
