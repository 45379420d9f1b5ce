"""GPT-NeoX's tokenizer types behind one interface, all loaded from local files (nothing is downloaded).

Every tokenizer has ``vocab_size``, ``eod``, ``pad``, ``tokenize(text) -> list[int]``, ``tokenize_batch(texts)``
and ``detokenize(ids) -> str``. This module does not import torch (preprocessing workers start fast).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron.config_utils import NeoXValues, neox_overrides
from megatron.errors import DataError
from megatron.neox_arguments.sections.model import VocabPaddingKeys
from megatron.neox_arguments.sections.other import ParallelSizeKeys, TokenizerArgs
from megatron.neox_arguments.sections.training import TokenizerFileKeys

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HFTokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
)


@dataclass
class TokenizerConfig(TokenizerArgs, TokenizerFileKeys, VocabPaddingKeys, ParallelSizeKeys):
    """The tokenizer keys of a GPT-NeoX config."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> TokenizerConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        return cls(**neox_overrides(cls, args))


def _require_file(path: str | None, key: str, tokenizer_type: str, what: str) -> str:
    if not path:
        raise DataError(f"tokenizer_type {tokenizer_type} needs {key}: {what}")
    if not os.path.exists(path):
        raise DataError(f"{key} {path!r} does not exist (tokenizer_type {tokenizer_type} needs {what})")
    return path


class AbstractTokenizer(ABC):
    """Common interface of all tokenizer types."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._eod: int | None = None  # set by each subclass's constructor
        self._pad: int | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (before padding for the model)."""

    @property
    def eod(self) -> int:
        """End-of-document id (appended by ``--append-eod``)."""
        assert self._eod is not None, f"{self.name} did not set its end-of-document id"
        return self._eod

    @property
    def eod_id(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        """Padding id (defaults to ``eod`` for tokenizers without a pad token)."""
        return self.eod if self._pad is None else self._pad

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (identical to ``tokenize`` one by one; faster where the backend batches)."""
        return [self.tokenize(t) for t in texts]

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""

    @property
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""
        raise NotImplementedError(f"{self.name} has no string vocabulary")

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token string."""
        return {v: k for k, v in self.vocab.items()}


class _TokenizersBackend(AbstractTokenizer):
    """Shared code for tokenizer types backed by a ``tokenizers.Tokenizer``."""

    def __init__(self, name: str, tokenizer: Any, eod_token: str = EOD_TOKEN) -> None:
        super().__init__(name)
        self.tokenizer = tokenizer
        self._eod = tokenizer.token_to_id(eod_token)
        if self._eod is None:
            raise DataError(f"{name}: the vocabulary has no end-of-document token {eod_token!r}")
        pad = tokenizer.token_to_id(PAD_TOKEN)
        self._pad = self._eod if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # no offsets: ~1.7x faster, same ids
        encodings = fast(list(texts)) if fast is not None else self.tokenizer.encode_batch(list(texts))
        return [e.ids for e in encodings]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)


class HFTokenizer(_TokenizersBackend):
    """A ``tokenizers`` JSON file (e.g. GPT-NeoX's ``20B_tokenizer.json``); eod ``<|endoftext|>``, pad ``<|padding|>``."""

    def __init__(self, vocab_file: str | None) -> None:
        from tokenizers import Tokenizer

        path = _require_file(vocab_file, "vocab_file", "HFTokenizer", "a tokenizers JSON file")
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"vocab_file {path!r} is not a valid tokenizers JSON file: {e}") from None
        super().__init__("HFTokenizer", tok)


class GPT2BPETokenizer(_TokenizersBackend):
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (same ids as GPT-2's reference tokenizer)."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = _require_file(vocab_file, "vocab_file", "GPT2BPETokenizer", "GPT-2's vocab.json")
        merges = _require_file(merge_file, "merge_file", "GPT2BPETokenizer", "GPT-2's merges.txt")
        try:
            tok = Tokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:
            raise DataError(f"cannot read GPT-2 BPE files {vocab!r} / {merges!r}: {e}") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        super().__init__("GPT2BPETokenizer", tok)


def auto_tokenizer(name: str, local_files_only: bool = True) -> Any:
    """``AutoTokenizer.from_pretrained`` that never runs a folder's own code: ``trust_remote_code=False``, so no
    "run the custom code? [y/N]" prompt can appear; a tokenizer that needs its code (``auto_map``) is a one-line
    error."""
    from transformers import AutoTokenizer

    refusal = DataError(
        f"tokenizer {name}: its tokenizer_config.json (auto_map) asks to run the folder's own Python code; "
        "neox-forge never runs a tokenizer folder's code: use a tokenizer.json or a folder without auto_map"
    )
    config = os.path.join(name, "tokenizer_config.json")
    if os.path.isfile(config):  # transformers would skip auto_map silently when tokenizer.json exists: refuse alike
        try:
            with open(config) as f:
                has_auto_map = "auto_map" in json.load(f)
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"tokenizer {name}: cannot read {config} ({e})") from None
        if has_auto_map:
            raise refusal
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_files_only, trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise refusal from None


def _hub_tokenizer(name: str) -> Any:
    """Hugging Face tokenizer ``name`` from the local cache, else from the hub unless offline."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    for local_only in (True,) if offline else (True, False):
        try:
            return auto_tokenizer(name, local_files_only=local_only)
        except OSError as e:
            error = e
    where = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME", "~/.cache/huggingface"), "hub")
    how = "offline (HF_HUB_OFFLINE=1)" if offline else "and the Hugging Face hub could not be reached"
    raise DataError(
        f"vocab_file {name!r} (tokenizer_type HFGPT2Tokenizer) is not a local file or folder, and the model is not in "
        f"the Hugging Face cache ({where}) {how}; set vocab_file to a tokenizer.json or a save_pretrained folder "
        f"({type(error).__name__})"
    ) from None


class HFGPT2Tokenizer(AbstractTokenizer):
    """A transformers fast tokenizer, with ``<|padding|>`` added as pad token like GPT-NeoX. ``vocab_file`` is a local
    directory (``save_pretrained``), a ``tokenizer.json``, or (as GPT-NeoX, default ``gpt2``) a Hugging Face model
    name, loaded from the local Hugging Face cache (downloaded only when the hub is reachable and not offline).
    """

    def __init__(self, vocab_file: str | None) -> None:
        super().__init__("HFGPT2Tokenizer")
        from transformers import PreTrainedTokenizerFast

        name = vocab_file or "gpt2"
        if os.path.isdir(name):
            self.tokenizer = auto_tokenizer(name)
        elif os.path.isfile(name):
            self.tokenizer = PreTrainedTokenizerFast(
                tokenizer_file=name, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, unk_token=EOD_TOKEN
            )
        else:
            self.tokenizer = _hub_tokenizer(name)
        if self.tokenizer.eos_token_id is None:
            raise DataError(f"vocab_file {name!r}: the tokenizer has no eos token")
        self.tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        self._eod, self._pad = int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab()

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(t) for t in token_ids]))


class SPMTokenizer(AbstractTokenizer):
    """A sentencepiece model file; eod is the piece ``<|endoftext|>`` (else the model's eos)."""

    def __init__(self, vocab_file: str | None) -> None:
        super().__init__("SPMTokenizer")
        import sentencepiece as spm

        path = _require_file(vocab_file, "vocab_file", "SPMTokenizer", "a sentencepiece .model file")
        try:
            self.tokenizer = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"vocab_file {path!r} is not a sentencepiece model: {e}") from None
        self._eod = self._piece(EOD_TOKEN, self.tokenizer.eos_id())
        self._pad = self._piece(PAD_TOKEN, self.tokenizer.pad_id())
        if self._eod < 0:
            raise DataError(f"vocab_file {path!r}: the model has neither a {EOD_TOKEN!r} piece nor an eos id")
        if self._pad < 0:
            self._pad = self._eod

    def _piece(self, piece: str, fallback: int) -> int:
        pid = self.tokenizer.piece_to_id(piece)
        return fallback if pid == self.tokenizer.unk_id() else pid

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self.tokenizer.id_to_piece(i): i for i in range(self.vocab_size)}

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer.encode(list(texts))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids])


class CharLevelTokenizer(AbstractTokenizer):
    """UTF-8 bytes as ids, vocab 512, eod 0, pad 1 (GPT-NeoX's ids). Decoding drops ids >= 256 and round-trips
    UTF-8 (GPT-NeoX maps each id through ``chr`` and clamps to >= 32, which loses newlines)."""

    def __init__(self, vocab_size: int = 512) -> None:
        super().__init__("CharLevelTokenizer")
        self._vocab_size = vocab_size
        self._eod, self._pad = 0, 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return bytes(int(t) for t in token_ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")


# The GPT-2 and cl100k pre-tokenization patterns (public constants of those encodings).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


class TiktokenTokenizer(AbstractTokenizer):
    """tiktoken from a local ``.tiktoken`` BPE file (base64 token + rank per line), eod ``<|endoftext|>``.

    GPT-NeoX calls ``tiktoken.get_encoding(vocab_file)``, which downloads; a bare encoding name is still accepted
    when tiktoken's cache has it. The pre-tokenizer pattern is GPT-2's for files named like ``gpt2``/``r50k``/
    ``p50k``, else cl100k's.
    """

    def __init__(self, vocab_file: str | None) -> None:
        super().__init__("TiktokenTokenizer")
        import tiktoken

        if vocab_file and not os.path.exists(vocab_file) and os.sep not in vocab_file and "." not in vocab_file:
            try:
                self.encoding = tiktoken.get_encoding(vocab_file)
            except Exception as e:
                raise DataError(
                    f"vocab_file {vocab_file!r}: tiktoken encoding not available offline ({type(e).__name__}); "
                    "pass a local .tiktoken file instead"
                ) from None
        else:
            path = _require_file(vocab_file, "vocab_file", "TiktokenTokenizer", "a local .tiktoken BPE file")
            ranks = load_tiktoken_ranks(path)
            base = os.path.basename(path).lower()
            pattern = _GPT2_PATTERN if any(k in base for k in ("gpt2", "r50k", "p50k")) else _CL100K_PATTERN
            self.encoding = tiktoken.Encoding(
                name=base, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOD_TOKEN: len(ranks)}
            )
        self._eod = self.encoding.eot_token

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def tokenize(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_batch(list(texts), allowed_special="all", num_threads=2)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.encoding.decode([int(t) for t in token_ids])


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (``base64(token) rank`` per line) with line-numbered errors."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:60]!r}") from None
    if not ranks:
        raise DataError(f"{path}: no tokens")
    return ranks


def build_tokenizer(cfg: TokenizerConfig) -> AbstractTokenizer:
    """The tokenizer named by ``cfg.tokenizer_type`` (GPT-NeoX's six types)."""
    kind = cfg.tokenizer_type
    logger.info("building %s tokenizer", kind)
    if kind.lower() == "GPT2BPETokenizer".lower():
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind.lower() == "HFTokenizer".lower():
        return HFTokenizer(cfg.vocab_file)
    if kind.lower() == "HFGPT2Tokenizer".lower():
        return HFGPT2Tokenizer(cfg.vocab_file)
    if kind.lower() == "SPMTokenizer".lower():
        return SPMTokenizer(cfg.vocab_file)
    if kind.lower() == "CharLevelTokenizer".lower():
        return CharLevelTokenizer(vocab_size=512)
    if kind.lower() == "TiktokenTokenizer".lower():
        return TiktokenTokenizer(cfg.vocab_file)
    raise DataError(f"unknown tokenizer_type {kind!r}; valid: {', '.join(TOKENIZER_TYPES)}")
