"""Tokenizers of every GPT-NeoX ``tokenizer_type``, loaded from local files, and ``padded_vocab_size``."""

from megatron.neox_arguments.derive import padded_vocab_size
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
    "build_tokenizer",
    "padded_vocab_size",
]
