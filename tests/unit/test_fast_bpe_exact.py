"""The fast encoder gives ``tokenizers``' ids for every text or is not used: merge tables where tiktoken's pair rule
parts from the listed merges are refused, NFC is ``tokenizers``' own, and random tables and texts agree."""

from __future__ import annotations

import io
import json
import logging
import random
import unicodedata
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.tokenizer.fast_bpe import build_fast_bpe, byte_level_alphabet
from megatron.tokenizer.tokenizers_nfc import TokenizersNFC, is_inert
from tests import shared_files

TOKENIZERS = shared_files.SHARED / "data" / "tokenizers"
NEOX_20B = TOKENIZERS / "20B_tokenizer.json"
BYTE_CHAR = {b: c for c, b in byte_level_alphabet().items()}


def byte_chars(text: str) -> str:
    """``text`` as the ByteLevel pre-tokenizer writes it (one char per UTF-8 byte)."""
    return "".join(BYTE_CHAR[b] for b in text.encode("utf-8"))


def bpe(merges: list[tuple[str, str]], nfc: bool = False, added: list[AddedToken] = (), shuffle_ids: bool = False,
        rng: random.Random | None = None) -> Tokenizer:  # fmt: skip
    """A byte-level BPE over all 256 bytes with ``merges`` (byte-level strings), as ``tokenizers`` builds it."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    if shuffle_ids and rng is not None:  # ids out of merge order: the encoder maps ranks to ids
        ids = list(vocab.values())
        rng.shuffle(ids)
        vocab = dict(zip(vocab, ids, strict=True))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.add_tokens(list(added))
    return tok


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run(tmp_path: Path, name: str, src: Path, vocab: Path, **kw) -> tuple[bytes, bytes, str]:
    prefix = tmp_path / name
    cfg = PreprocessConfig(inputs=[str(src)], output_prefix=str(prefix), tokenizer_type="HFTokenizer",
                           vocab_file=str(vocab), append_eod=True, batch_docs=50, **kw)  # fmt: skip
    result = preprocess(cfg, progress_stream=io.StringIO())
    out = Path(f"{prefix}_text_document")
    return out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes(), result.encoder


def test_a_merge_table_tiktoken_reads_otherwise_is_refused(tmp_path, caplog):
    """Merges b+c, a+b, ab+c: tokenizers makes "abc" only as ab+c, but it merges b+c first, so "abc" stays a|bc;
    tiktoken emits a piece "abc" whole and joins a|bc because "abc" is a token. "abc" in one document of 1,000 (which
    a sample of the first and spread documents misses): the run refuses the fast encoder and writes what
    --no-fast-encoder writes."""
    tok = bpe([("b", "c"), ("a", "b"), ("ab", "c")])
    vocab = tok.get_vocab()
    assert tok.encode("abc").ids == [vocab["a"], vocab["bc"]]  # not vocab["abc"], which tiktoken would give
    path = tmp_path / "odd.json"
    tok.save(str(path))
    fast, why = build_fast_bpe(path.read_text())
    assert fast is None
    assert why == (
        "tokenizers encodes merge 2's result 'abc' as 'a' + 'bc', not by merge 'ab' + 'c': tiktoken, which joins "
        "any pair that makes a token, could give other ids"
    )
    docs = [f"document {i}: ab bc ca cab" for i in range(1000)]
    docs[500] = "abc x abc, zabc"  # the piece "abc" (whole) and " abc" (a|bc joined by the pair rule)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    with caplog.at_level(logging.INFO, logger="megatron.data.preprocess"):
        auto = run(tmp_path, "auto", src, path)
    # this run's lines only: the plain run below also logs when an earlier test left the logger at INFO
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("encoder:")]
    plain = run(tmp_path, "plain", src, path, fast_encoder=False)
    assert auto[:2] == plain[:2]
    assert auto[2] == f"encoder: tokenizers (fast encoder not used: {why})"
    assert logged == [auto[2]]


def nfc_disagreements(limit: int = 0x10000) -> list[str]:
    """Short strings whose NFC differs between Python's unicodedata and tokenizers' normalizer (code points
    assigned between their Unicode versions, next to marks they are reordered or composed with)."""
    nfc = normalizers.NFC()
    found = []
    for template in ("a{}\u0323", "{}\u0334", "a{}\u05b0", "{}\u0301"):
        for code in range(0x80, limit):
            if 0xD800 <= code < 0xE000:
                continue
            text = template.format(chr(code))
            if unicodedata.normalize("NFC", text) != nfc.normalize_str(text):
                found.append(text)
    return found


@pytest.mark.skipif(not NEOX_20B.exists(), reason="shared tokenizers not here")
def test_nfc_is_tokenizers_own_on_the_20b_tokenizer():
    cases = nfc_disagreements()
    assert len(cases) >= 50, len(cases)
    assert all(not all(is_inert(ch) for ch in case) for case in cases)  # none skips the normalizer
    tok = Tokenizer.from_file(str(NEOX_20B))
    fast, why = build_fast_bpe(tok.to_str(), tok.model)
    assert fast is not None, why
    texts = [*cases, *(f"x {c}y {c}{c}\n{c}" for c in cases), "".join(cases), "<|endoftext|>\u0898\u0323 a\u0898\u0323"]
    want = [e.ids for e in tok.encode_batch_fast(texts)]
    got = fast.encode_batch(texts)
    assert [t for t, a, b in zip(texts, got, want, strict=True) if a != b] == []


def test_tokenizers_nfc_matches_the_normalizer_and_skips_inert_text():
    nfc = TokenizersNFC()
    plain = normalizers.NFC()
    texts = ["plain ascii", "café naïve 日本語 한국어 😀", "e\u0301", "\u1100\u1161\u11a8", "a\u0898\u0323", "\u212b"]
    assert [nfc(t) for t in texts] == [plain.normalize_str(t) for t in texts]
    assert all(is_inert(ch) for ch in "café naïve 日本語 한국어 😀")
    assert not any(is_inert(ch) for ch in "\u0301\u1161\u11a8\u0898\u212b\U000e0000\U00030000"[:-2])
    assert not is_inert("\ufdd0") and not is_inert("\U0010ffff")  # unassigned (noncharacters) are never inert
    # every inert character of the first four planes, in code point order and shuffled: tokenizers leaves it as is
    inert = [chr(c) for c in range(0x80, 0x40000) if is_inert(chr(c))]
    assert len(inert) > 100_000
    random.Random(0).shuffle(shuffled := inert.copy())
    for text in ("".join(inert), "".join(shuffled), " ".join(shuffled)):
        assert plain.normalize_str(text) == text


# --- property test: random merge tables and random text ------------------------------------------------------------

# Characters the random tables merge (their UTF-8 bytes) and the random documents are made of: letters, digits,
# apostrophes, whitespace of several kinds, precomposed and combining forms, Hangul jamo, a mark tokenizers' Unicode
# version does not know, and emoji.
UNITS = ["a", "b", "c", "d", " ", "1", "2", "'", "s", "\n", "\t", "é", "e", "\u0301", "\u0323", "\u0898", "가", "\u1100",
         "\u1161", "\u11a8", "\u00a0", "\u3000", "😀", "\u200d", "Å", "\u212b", "\u05b0", "ß"]  # fmt: skip
EXTRA = [" ", "  ", "   ", "\r\n", "\n\n", " \t", "'s", "'ll", "'VE", "\u2028", "A\u030a", "\ufb01"]


def random_merges(rng: random.Random) -> list[tuple[str, str]]:
    """Merges of random pairs of tokens, up to 6 bytes each, from the bytes of a few of ``UNITS`` (few, so that
    tokens overlap: many tables have a token that splits into two tokens other than its merge's)."""
    units = rng.sample(UNITS[:6], 3) + rng.sample(UNITS[6:], 1)
    tokens = sorted({ch for u in units for ch in byte_chars(u)})
    merges = []
    seen = set(tokens)
    for _ in range(rng.randint(1, 40)):
        left, right = rng.choice(tokens), rng.choice(tokens)
        if left + right not in seen and len(left + right) <= 6:
            merges.append((left, right))
            tokens.append(left + right)
            seen.add(left + right)
    return merges


def has_other_split(merges: list[tuple[str, str]]) -> bool:
    """Whether a merge result also splits into two other tokens (a pair tiktoken would join and tokenizers not)."""
    tokens = {ch for pair in merges for part in pair for ch in part} | {a + b for a, b in merges}
    return any(
        (t[:k], t[k:]) != (a, b) and t[:k] in tokens and t[k:] in tokens
        for a, b in merges
        for t in [a + b]
        for k in range(1, len(t))
    )


def trained_merges(rng: random.Random, docs: list[str]) -> list[tuple[str, str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + rng.randint(5, 60), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(docs, trainer)
    spec = json.loads(tok.to_str())
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]


def random_char(rng: random.Random) -> str:
    """Any code point but a surrogate, every plane."""
    plane = rng.choice([0, 0, 0, 1, 2, 3, 14, 15, 16])
    code = (plane << 16) + rng.randrange(0x80 if plane == 0 else 0, 0x10000)
    return chr(code) if not 0xD800 <= code < 0xE000 else "\ufffd"


def random_document(rng: random.Random, added: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(0, 24)):
        roll = rng.random()
        if roll < 0.3:
            parts.append(rng.choice(UNITS[:6]))
        elif roll < 0.6:
            parts.append(rng.choice(UNITS))
        elif roll < 0.75:
            parts.append(rng.choice(EXTRA))
        elif roll < 0.9:
            parts.append(random_char(rng))
        else:
            parts.append(rng.choice([*added, "<|endoftext|>"]))
    return "".join(parts)


def test_random_tables_and_documents_fast_equals_plain_or_refused():
    """300 random byte-level BPE tables (random merges over a few characters' bytes, or trained on random text), with
    or without NFC, normalized and special added tokens, ids in or out of merge order; 48 random documents each:
    every table the fast encoder accepts gives tokenizers' ids on every document (also the tables with a token that
    tiktoken's pair rule reaches another way); the others are refused by the merge check."""
    rng = random.Random(1234)
    accepted = refused = compared = overlapping = 0
    for n in range(300):
        added_texts = rng.sample(["ab", "b\u0301", "<x>", "é", " c", "a\u0898"], 2)
        added = [
            AddedToken(added_texts[0], normalized=True),
            AddedToken(added_texts[1], normalized=False, special=True),
        ]
        docs = [random_document(rng, added_texts) for _ in range(48)]
        merges = random_merges(rng) if n % 2 else trained_merges(rng, [random_document(rng, []) for _ in range(30)])
        tok = bpe(merges, nfc=rng.random() < 0.7, added=added, shuffle_ids=rng.random() < 0.3, rng=rng)
        fast, why = build_fast_bpe(tok.to_str(), tok.model)
        if fast is None:
            assert "tiktoken, which joins any pair that makes a token, could give other ids" in why, why
            refused += 1
            continue
        accepted += 1
        overlapping += has_other_split(merges)
        want = [e.ids for e in tok.encode_batch_fast(docs)]
        for doc, got, ids in zip(docs, fast.encode_batch(docs), want, strict=True):
            assert got == ids, (merges, doc)
        compared += len(docs)
    # (seeded: 216 accepted, 36 of them with a token that splits otherwise too, 84 refused, 10,368 documents)
    assert accepted >= 200 and overlapping >= 30 and refused >= 50 and compared >= 10_000
