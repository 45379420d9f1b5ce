"""An exact fast encoder (tiktoken's BPE core) for byte-level BPE ``tokenizer.json`` files.

``tokenizers`` spends most of a preprocessing run in its per-word bookkeeping (offsets, alignments); tiktoken runs
the same byte-level BPE about 4x faster in one thread. :func:`build_fast_bpe` builds the tiktoken form of a
``tokenizers`` JSON only when the file has the one shape whose ids it reproduces:

- model ``BPE`` without dropout, unk token, subword prefix/suffix, byte fallback or ``ignore_merges``;
- normalizer none or ``NFC``; pre-tokenizer ``ByteLevel`` (GPT-2's regex, no prefix space); post-processor none or
  ``ByteLevel`` (adds no tokens); decoder none or ``ByteLevel``; no truncation or padding;
- every byte that UTF-8 text can contain is a vocabulary token, every merge part and result is one, and no token
  is the result of two merges;
- every merge result is its own encoding by the ``tokenizers`` BPE model (see below);
- added tokens without ``lstrip``/``rstrip``/``single_word`` (the flags GPT-NeoX's 20B and GPT-2's files use).

Ranks are the merge order (bytes first), the priority ``tokenizers`` merges by; token ids are the vocabulary's
(the same numbers when the ids grow with the merge order, else mapped after encoding). Added tokens are split out
as ``tokenizers`` does: leftmost-longest matches of the non-normalized ones in the raw text, then NFC on the rest,
then the normalized ones (whose contents are normalized too). NFC is ``tokenizers``' own normalizer
(:mod:`megatron.tokenizer.tokenizers_nfc`): Python's ``unicodedata`` has another Unicode version.

Why the merge check makes the ids equal for every text. Within a pre-tokenized piece both run the same loop:
merge the adjacent pair of lowest rank, the leftmost of equal ones, until none is left. They differ in which
pairs count: ``tokenizers`` only listed merges ``(x, y)``; tiktoken any pair whose concatenation ``xy`` is a token
(ranked as the merge that makes ``xy``), and a piece that is a token as a whole it emits whole. Every listed merge
is such a pair with the same rank (no token is made by two merges), so the two can only part at a step where
tiktoken takes a pair ``(c, d)`` that is not a listed merge though ``cd = t`` is a token, or at a piece that is a
token ``t``. In the first case both made the same merges so far, none across the start of ``c`` or the end of
``d`` (symbols only grow), so the merges inside that span were the ones ``tokenizers`` makes first on the text
``t`` alone (each was the lowest pair of the piece, so of the span); they reached ``[c, d]``, where ``tokenizers``
stops. In the second, ``tokenizers`` gives ``[t]`` only if it encodes ``t`` alone so. Hence, when ``tokenizers``
encodes every merge result ``t`` alone as ``[t]`` (what :func:`check_merges` tests with the tokenizer's own BPE
model), the two never part; otherwise the file is refused. GPT-NeoX's 20B and GPT-2's files pass (training makes
a token where its text was merged, in the order encoding merges).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from megatron.tokenizer.tokenizers_nfc import TokenizersNFC

# The GPT-2 pre-tokenizer regex (the ByteLevel pre-tokenizer's, written as tiktoken's gpt2 encoding writes it).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Bytes that never occur in UTF-8 (a vocabulary may leave them out: text can never contain them).
_NOT_IN_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """The ByteLevel char of each byte (GPT-2's printable mapping) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class NotSupported(ValueError):
    """The tokenizer.json is not of the shape the fast encoder reproduces (the message says why)."""


@dataclass
class FastBPE:
    """tiktoken's byte-level BPE plus ``tokenizers``' added-token split and NFC; ids as ``tokenizers`` gives."""

    core: Any  # tiktoken's CoreBPE (encode_ordinary on a str)
    normalize: Callable[[str], str] | None  # tokenizers' NFC (None: no normalizer)
    raw_split: re.Pattern[str] | None  # non-normalized added tokens, in a capture group (re.split keeps them)
    normalized_split: re.Pattern[str] | None
    added_ids: dict[str, int]
    id_of_rank: np.ndarray | None  # None: ranks are the ids

    def _ordinary(self, text: str, out: list[int]) -> None:
        encode = self.core.encode_ordinary
        parts = [text] if self.normalized_split is None else self.normalized_split.split(text)
        if parts[0]:
            out.extend(encode(parts[0]))
        if len(parts) > 1:
            ids = self.added_ids
            for token, piece in zip(parts[1::2], parts[2::2], strict=True):
                out.append(ids[token])
                if piece:
                    out.extend(encode(piece))

    def encode(self, text: str) -> list[int]:
        """The ids ``tokenizers`` gives for ``text`` (``encode(text).ids``)."""
        out: list[int] = []
        parts = [text] if self.raw_split is None else self.raw_split.split(text)
        normalize = self.normalize
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self.added_ids[part])
            elif part:
                self._ordinary(normalize(part) if normalize is not None else part, out)
        if self.id_of_rank is not None:
            return self._to_ids(out)
        return out

    def _to_ids(self, ranks: list[int]) -> list[int]:
        assert self.id_of_rank is not None  # added tokens have ranks too (above the merges' ranks)
        arr = np.asarray(ranks, dtype=np.int64)
        return [int(x) for x in self.id_of_rank[arr]]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        if isinstance(m, str):
            parts = m.split(" ")
        else:
            parts = list(m)
        if len(parts) != 2:
            raise NotSupported(f"merge {m!r} is not a pair")
        pairs.append((parts[0], parts[1]))
    return pairs


def _check_shape(spec: dict[str, Any]) -> None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotSupported(f"model type {model.get('type')!r} is not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise NotSupported("BPE dropout is set")
    if model.get("unk_token") is not None:
        raise NotSupported("the BPE model has an unk token")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotSupported(f"the BPE model has a {key}")
    for key in ("byte_fallback", "ignore_merges"):
        if model.get(key):
            raise NotSupported(f"the BPE model sets {key}")
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        raise NotSupported(f"normalizer {normalizer.get('type')!r} (only none or NFC)")
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel":
        raise NotSupported(f"pre-tokenizer {pre.get('type')!r} is not ByteLevel")
    if pre.get("add_prefix_space") or not pre.get("use_regex", True):
        raise NotSupported("the ByteLevel pre-tokenizer adds a prefix space or does not split with GPT-2's regex")
    post = spec.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        raise NotSupported(f"post-processor {post.get('type')!r} may add tokens (only none or ByteLevel)")
    decoder = spec.get("decoder")
    if decoder is not None and decoder.get("type") != "ByteLevel":
        raise NotSupported(f"decoder {decoder.get('type')!r} is not ByteLevel")
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        raise NotSupported("truncation or padding is set")


def _added_tokens(
    spec: dict[str, Any], normalize: Callable[[str], str] | None
) -> tuple[dict[str, int], dict[str, int]]:
    """(non-normalized, normalized) added tokens: content as matched -> id."""
    raw: dict[str, int] = {}
    normalized: dict[str, int] = {}
    for tok in spec.get("added_tokens") or []:
        for flag in ("lstrip", "rstrip", "single_word"):
            if tok.get(flag):
                raise NotSupported(f"added token {tok.get('content')!r} sets {flag}")
        content = tok.get("content")
        if not isinstance(content, str) or not content or not isinstance(tok.get("id"), int):
            raise NotSupported(f"added token {tok!r} has no content or id")
        if tok.get("normalized", not tok.get("special", False)):
            normalized[normalize(content) if normalize is not None else content] = tok["id"]
        else:
            raw[content] = tok["id"]
    return raw, normalized


def _split_pattern(tokens: dict[str, int]) -> re.Pattern[str] | None:
    # Longest first: at the leftmost position the longest content matches, as tokenizers' leftmost-longest split.
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def _ranks(spec: dict[str, Any]) -> tuple[dict[bytes, int], np.ndarray | None]:
    """tiktoken's ``mergeable_ranks`` (bytes -> rank) and the rank -> id table (None when ranks are the ids)."""
    vocab: dict[str, int] = spec["model"].get("vocab") or {}
    alphabet = byte_level_alphabet()
    byte_ids: dict[int, int] = {}
    for char, b in alphabet.items():
        if char in vocab:
            byte_ids[b] = vocab[char]
        elif b not in _NOT_IN_UTF8:
            raise NotSupported(f"byte 0x{b:02x} is not in the vocabulary")
    merged = [left + right for left, right in _merge_pairs(spec["model"].get("merges") or [])]
    if len(set(merged)) != len(merged):
        raise NotSupported("a token is the result of two merges")
    parts = {*merged, *(p for pair in _merge_pairs(spec["model"].get("merges") or []) for p in pair)}
    missing = next((t for t in parts if t not in vocab), None)
    if missing is not None:
        raise NotSupported(f"merge part or result {missing!r} is not in the vocabulary")
    if not set("".join(merged)) <= alphabet.keys():
        raise NotSupported("a merge result is not made of byte-level characters")
    # Each byte-level char -> the char of its byte, so that latin-1 gives the token's raw bytes (C speed).
    to_bytes = str.maketrans({c: chr(b) for c, b in alphabet.items()})
    results = [(t.translate(to_bytes).encode("latin-1"), vocab[t]) for t in merged]
    ids = [i for _, i in results]
    if len(set(byte_ids.values()) | set(ids)) != len(byte_ids) + len(ids):
        raise NotSupported("two tokens share an id")
    if all(x < y for x, y in itertools.pairwise(ids)):
        ranks = {bytes([b]): i for b, i in byte_ids.items()}
        ranks.update(results)
        return ranks, None
    # Ids out of merge order: rank = merge order (tiktoken's priority), then map each rank to its id.
    ranks = {bytes([b]): b for b in byte_ids}
    table = np.zeros(256 + len(results), dtype=np.int64)
    for b, i in byte_ids.items():
        table[b] = i
    for n, (raw, i) in enumerate(results):
        ranks[raw] = 256 + n
        table[256 + n] = i
    return ranks, table


def check_merges(pairs: list[tuple[str, str]], model: Any) -> None:
    """Refuse merges unless the ``tokenizers`` BPE ``model`` encodes every merge result as that one token (the
    condition under which tiktoken gives ``tokenizers``' ids; the module's doc says why)."""
    tokenize = model.tokenize
    for n, (left, right) in enumerate(pairs):
        if len(left) + len(right) == 2:  # two bytes: the merge itself is the only way to join them
            continue
        got = tokenize(left + right)
        if len(got) != 1:
            parts = " + ".join(repr(t.value) for t in got)
            raise NotSupported(
                f"tokenizers encodes merge {n}'s result {left + right!r} as {parts}, not by merge {left!r} + "
                f"{right!r}: tiktoken, which joins any pair that makes a token, could give other ids"
            )


def _load_model(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(tokenizer_json).model
    except Exception as e:  # tokenizers raises plain Exception on a file it cannot load
        raise NotSupported(f"tokenizers cannot load it ({e})") from None


def build_fast_bpe(tokenizer_json: str, model: Any = None) -> tuple[FastBPE | None, str]:
    """The fast encoder of a ``tokenizers`` JSON string, or ``(None, why not)``. ``model``: the ``tokenizers``
    model loaded from that JSON (``Tokenizer.model``), to check the merges with (None: loaded here)."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    try:
        spec = json.loads(tokenizer_json)
        if not isinstance(spec, dict):
            raise NotSupported("not a tokenizers JSON object")
        _check_shape(spec)
        normalize = TokenizersNFC() if spec.get("normalizer") is not None else None
        raw, normalized = _added_tokens(spec, normalize)
        ranks, table = _ranks(spec)
        pairs = _merge_pairs(spec["model"].get("merges") or [])
        check_merges(pairs, model if model is not None else _load_model(tokenizer_json))
    except NotSupported as e:
        return None, str(e)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return None, f"unreadable tokenizer JSON ({type(e).__name__}: {e})"
    if table is not None:
        # Added tokens are appended to the output as ranks too: give them ranks above the merges.
        added = {**raw, **normalized}
        extra = {content: len(table) + n for n, content in enumerate(added)}
        table = np.concatenate([table, np.array(list(added.values()), dtype=np.int64)])
        raw = {c: extra[c] for c in raw}
        normalized = {c: extra[c] for c in normalized}
    try:
        encoding = tiktoken.Encoding(name="fast-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    except Exception as e:  # tiktoken raises plain ValueError/AssertionError on inconsistent ranks
        return None, f"tiktoken refused the ranks ({type(e).__name__}: {e})"
    fast = FastBPE(
        core=encoding._core_bpe,
        normalize=normalize,
        raw_split=_split_pattern(raw),
        normalized_split=_split_pattern(normalized),
        added_ids={**raw, **normalized},
        id_of_rank=table,
    )
    why = f"byte-level BPE; each of its {len(pairs)} merge results is its own tokenizers encoding, so tiktoken merges"
    return fast, why + " as tokenizers does"
