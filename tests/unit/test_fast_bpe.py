"""The fast byte-level BPE encoder gives ``tokenizers``' ids, and preprocessing uses it only when proven identical."""

from __future__ import annotations

import io
import json
import logging
import sysconfig
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megatron.data.encoder_choice import choose_encoder
from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.tokenizer import HFTokenizer
from megatron.tokenizer.fast_bpe import FastBPE, build_fast_bpe
from tests import shared_files

TOKENIZERS = shared_files.SHARED / "data" / "tokenizers"
SHAKESPEARE = shared_files.SHARED / "data" / "corpora" / "tinyshakespeare.txt"
pytestmark = pytest.mark.skipif(not (TOKENIZERS / "gpt2.json").exists(), reason="shared tokenizers not here")

# Text where byte-level BPE implementations tend to differ: NFC (composed vs combining marks, Hangul jamo, a
# combining mark right after a special token), emoji sequences, scripts, digits, whitespace runs of every length,
# contractions, added tokens inside words and next to each other.
TRICKY = [
    "e\u0301te\u0301 cafe\u0301 \u1100\u1161\u11a8 \u212b \ufb01 \u0041\u030a <|endoftext|>\u0301x",
    "👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇩🇪 😀🎉✨ 你好，世界 こんにちは 안녕하세요 مرحبا ١٢٣ שלום Привет ΑΒΓ",
    "".join(" " * n + f"x{n}\t" * (n % 3) + "\n" * (n % 4) for n in range(1, 70)),
    "don't I'LL we've they're it's 'S 'd  '' ' s 12345678 3.14159 1,000,000 ½ ² Ⅻ",
    "<|endoftext|><|padding|>assistantsRWKV<|im_start|>user\n  hi<|im_end|>\n\n\n\r\n\r\n\t\t \u00a0\u2028\u3000x",
    "def f(x):\n        return {'a': [1, 2]}  # comment\n\n\n    \n" * 5 + "trailing   ",
    "",
    "   ",
    "\x00\x01\x7f\u200b\ufeff\U0010fffd",
]


def stdlib_texts(count: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    step = max(1, len(files) // count)
    return [f.read_text(encoding="utf-8", errors="replace") for f in files[::step][:count]]


@pytest.fixture(scope="module")
def real_texts() -> list[str]:
    return [*stdlib_texts(40), SHAKESPEARE.read_text(), *TRICKY]


@pytest.mark.parametrize("name", ["20B_tokenizer.json", "gpt2.json"])
def test_ids_identical_to_tokenizers_on_real_text(name, real_texts):
    tok = Tokenizer.from_file(str(TOKENIZERS / name))
    fast, why = build_fast_bpe(tok.to_str())
    assert fast is not None, why
    assert fast.id_of_rank is None  # both files number their merges in order: ranks are the ids
    want = [e.ids for e in tok.encode_batch_fast(real_texts)]
    got = fast.encode_batch(real_texts)
    for text, a, b in zip(real_texts, got, want, strict=True):
        assert a == b, text[:80]
    assert sum(map(len, got)) > 100_000
    from_file, _ = build_fast_bpe((TOKENIZERS / name).read_text())  # the file as written ("a b" merges), not re-saved
    assert from_file is not None and from_file.encode_batch(TRICKY) == got[-len(TRICKY) :]
    if name == "20B_tokenizer.json":  # the added tokens were really split out
        ids = set(fast.encode(TRICKY[4]) + fast.encode(TRICKY[2]))
        assert {0, 1, tok.token_to_id("assistant"), tok.token_to_id(" " * 24), tok.token_to_id("  ")} <= ids


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], nfc: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def trained_bpe(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SHAKESPEARE.read_text().splitlines()[:2000], trainer)
    return tok


def test_ids_out_of_merge_order_are_mapped():
    spec = json.loads(trained_bpe().to_str())
    vocab = spec["model"]["vocab"]
    merged = [a + b for a, b in (m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"])]
    old = [vocab[t] for t in merged]
    for token, new_id in zip(merged, reversed(old), strict=True):  # the last merge gets the first merge's id
        vocab[token] = new_id
    tok = Tokenizer.from_str(json.dumps(spec))
    fast, why = build_fast_bpe(tok.to_str())
    assert fast is not None and fast.id_of_rank is not None, why
    texts = [*SHAKESPEARE.read_text().splitlines()[2000:2600], "<|endoftext|>the king<|endoftext|>", *TRICKY]
    assert fast.encode_batch(texts) == [e.ids for e in tok.encode_batch(texts)]


def other_tokenizers() -> dict[str, Tokenizer]:
    words = {"<|endoftext|>": 0, "[UNK]": 1, "a": 2, "b": 3, "ab": 4}
    wordpiece = Tokenizer(models.WordPiece(words, unk_token="[UNK]"))
    unigram = Tokenizer(models.Unigram([("<|endoftext|>", 0.0), ("a", -1.0), ("b", -1.0), ("ab", -0.5)], 0))
    prefixed = trained_bpe(300)
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    stripped = trained_bpe(300)
    stripped.add_tokens([AddedToken("[X]", lstrip=True)])
    nfkc = trained_bpe(300)
    nfkc.normalizer = normalizers.NFKC()
    return {"WordPiece": wordpiece, "Unigram": unigram, "prefix space": prefixed, "lstrip": stripped, "NFKC": nfkc}


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("WordPiece", "model type 'WordPiece' is not BPE"),
        ("Unigram", "model type 'Unigram' is not BPE"),
        ("prefix space", "adds a prefix space"),
        ("lstrip", "added token '[X]' sets lstrip"),
        ("NFKC", "normalizer 'NFKC'"),
    ],
)
def test_not_built_for_other_shapes(kind, reason):
    fast, why = build_fast_bpe(other_tokenizers()[kind].to_str())
    assert fast is None and reason in why


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run(tmp_path: Path, name: str, src: Path, vocab: Path, **kw) -> tuple[bytes, bytes, str]:
    prefix = tmp_path / name
    cfg = PreprocessConfig(
        inputs=[str(src)], output_prefix=str(prefix), tokenizer_type="HFTokenizer", vocab_file=str(vocab),
        append_eod=True, batch_docs=7, **kw,
    )  # fmt: skip
    result = preprocess(cfg, progress_stream=io.StringIO())
    out = Path(f"{prefix}_text_document")
    return out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes(), result.encoder


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_fast_and_plain_byte_identical(tmp_path, workers, caplog):
    src = write_jsonl(tmp_path / "c.jsonl", [*stdlib_texts(16), *TRICKY[:6]])
    vocab = TOKENIZERS / "20B_tokenizer.json"
    with caplog.at_level(logging.INFO, logger="megatron.data.preprocess"):
        fast = run(tmp_path, "fast", src, vocab, workers=workers)
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("encoder:")]
    plain = run(tmp_path, "plain", src, vocab, workers=workers, fast_encoder=False)
    assert fast[2] == (
        "encoder: tiktoken (byte-level BPE; each of its 50009 merge results is its own tokenizers encoding, so "
        "tiktoken merges as tokenizers does; also identical on 17/17 sample documents)"
    )
    assert logged == [fast[2]]  # one line per run (an earlier in-process cli() may leave the logger at INFO)
    assert plain[2] == "encoder: tokenizers (fast encoder not used: disabled (--no-fast-encoder))"
    assert fast[:2] == plain[:2]


def test_preprocess_falls_back_for_wordpiece(tmp_path):
    vocab = tmp_path / "wordpiece.json"
    other_tokenizers()["WordPiece"].save(str(vocab))
    src = write_jsonl(tmp_path / "c.jsonl", ["ab a b", "ba"])
    assert run(tmp_path, "wp", src, vocab)[2] == (
        "encoder: tokenizers (fast encoder not used: model type 'WordPiece' is not BPE)"
    )


def test_choice_falls_back_when_the_sample_differs(tmp_path):
    """The sample is a smoke test on top of the merge check: an encoder that gives other ids on a document of the
    sample is not used (here, through the builder seam, one built without the tokenizer's last merge ab+c)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"ab": 256, "abc": 257})
    path = tmp_path / "abc.json"
    byte_level_bpe(vocab, [("a", "b"), ("ab", "c")], nfc=True).save(str(path))

    def build_without_last_merge(spec: str, model: object) -> tuple[FastBPE | None, str]:
        parsed = json.loads(spec)
        parsed["model"]["merges"] = parsed["model"]["merges"][:-1]
        return build_fast_bpe(json.dumps(parsed))

    # "abc" only in the second half: the first documents agree, the spread sample finds the difference
    src = write_jsonl(tmp_path / "c.jsonl", [f"doc {i} ab bc" for i in range(200)] + [f"x abc {i}" for i in range(200)])
    tok = HFTokenizer(str(path))
    choice = choose_encoder(tok, [str(src)], ["text"], build=build_without_last_merge)
    assert choice.line.startswith("encoder: tokenizers (fast encoder not used: ids differ from tokenizers on ")
    assert "c.jsonl @byte" in choice.line
    assert choose_encoder(tok, [str(src)], ["text"]).name == "tiktoken"


def test_choice_refuses_an_encoder_that_fails(tmp_path):
    """The builder seam: an encoder that raises on the sample is not used (the tokenizer decides such text)."""
    src = write_jsonl(tmp_path / "c.jsonl", ["hello <|endoftext|> world"])
    tok = HFTokenizer(str(TOKENIZERS / "gpt2.json"))

    def build_broken(spec: str, model: object):
        fast, why = build_fast_bpe(spec, model)
        assert fast is not None
        fast.added_ids = {}  # its split still finds <|endoftext|>, whose id is now unknown: KeyError
        fast.raw_split = fast.normalized_split
        return fast, why

    choice = choose_encoder(tok, [str(src)], ["text"], build=build_broken)
    assert choice.fast is None and choice.line.endswith("the fast encoder failed on the sample (KeyError))")
    assert choose_encoder(tok, [str(src)], ["text"]).name == "tiktoken"


def test_gpt2_vocab_and_merges_files_use_the_fast_encoder(tmp_path):
    """GPT2BPETokenizer (vocab.json + merges.txt) is a tokenizers byte-level BPE too."""
    from megatron.tokenizer import GPT2BPETokenizer

    spec = json.loads((TOKENIZERS / "gpt2.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    src = write_jsonl(tmp_path / "c.jsonl", [*stdlib_texts(4), *TRICKY])
    choice = choose_encoder(tok, [str(src)], ["text"])
    assert choice.name == "tiktoken", choice.line
    assert choice.fast is not None and choice.fast.encode_batch(TRICKY) == tok.tokenize_batch(TRICKY)


def test_a_worker_that_did_not_inherit_the_encoder_builds_it(tmp_path):
    """Spawned workers (no fork) start without the main process's encoder and build it from the tokenizer."""
    from megatron.data import preprocess as engine

    engine._CHOSEN.clear()
    cfg = PreprocessConfig(inputs=[], output_prefix=str(tmp_path / "x"), tokenizer_type="HFTokenizer",
                           vocab_file=str(TOKENIZERS / "gpt2.json"), append_eod=True)  # fmt: skip
    engine._init_worker(cfg, "uint16", False, True)
    assert engine._WORKER["fast"] is not None
    flat, lengths = engine.encode_batch([{"text": TRICKY[1]}, {"text": "x"}])[0]["text"]
    tok = HFTokenizer(str(TOKENIZERS / "gpt2.json"))
    assert flat.tolist() == [*tok.tokenize(TRICKY[1]), tok.eod, *tok.tokenize("x"), tok.eod]
    assert lengths.tolist() == [len(tok.tokenize(TRICKY[1])) + 1, 2]


def test_ftfy_runs_before_either_encoder(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["cafÃ© naÃ¯ve â€œquotedâ€\x9d", *TRICKY[:3]])
    vocab = TOKENIZERS / "20B_tokenizer.json"
    fast = run(tmp_path, "fast", src, vocab, ftfy=True)
    assert fast[2].startswith("encoder: tiktoken") and fast[:2] == run(tmp_path, "plain", src, vocab, ftfy=True,
                                                                         fast_encoder=False)[:2]  # fmt: skip
