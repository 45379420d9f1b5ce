"""One test per tokenizer type (all from local files), padded_vocab_size, build errors and tokenizer training."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.neox_arguments import neox_namespace
from megatron.tokenizer import (
    CharLevelTokenizer,
    GPT2BPETokenizer,
    HFGPT2Tokenizer,
    HFTokenizer,
    SPMTokenizer,
    TiktokenTokenizer,
    TokenizerConfig,
    build_tokenizer,
    padded_vocab_size,
)
from megatron.tokenizer.train_tokenizer import train_tokenizer
from tests import shared_files

REPO = Path(__file__).resolve().parents[2]
SHARED = shared_files.SHARED / "data"
TOKENIZER_20B = SHARED / "tokenizers" / "20B_tokenizer.json"
GPT2_JSON = SHARED / "tokenizers" / "gpt2.json"
needs_shared = pytest.mark.skipif(not GPT2_JSON.exists(), reason="shared tokenizer files not on this machine")

TEXTS = [
    "Hello world! It's a test.",
    "def f(x):\n    return x ** 2  # café ☕\n",
    "  leading spaces and\ttabs\n\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gpt2_model() -> tuple[dict[str, int], list[str]]:
    model = json.loads(GPT2_JSON.read_text())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


def check_common(tok, texts=TEXTS, exact=True) -> None:
    ids = [tok.tokenize(t) for t in texts]
    assert all(isinstance(i, int) for seq in ids for i in seq)
    assert tok.tokenize_batch(texts) == ids
    assert 0 <= tok.eod < tok.vocab_size and 0 <= tok.pad < tok.vocab_size
    if exact:
        assert [tok.detokenize(seq) for seq in ids] == texts


@needs_shared
def test_hf_tokenizer_20b():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(TOKENIZER_20B)))
    assert isinstance(tok, HFTokenizer)
    # get_vocab_size() with added tokens, as GPT-NeoX calls it: ids 0..50280
    assert (tok.eod, tok.pad, tok.vocab_size) == (0, 1, 50281)
    assert padded_vocab_size(tok.vocab_size, 128, 1) == 50304
    check_common(tok)


@needs_shared
def test_gpt2_bpe_from_vocab_and_merges_matches_gpt2_json(tmp_path):
    vocab, merges = gpt2_model()
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(tmp_path / "vocab.json"),
            merge_file=str(tmp_path / "merges.txt"),
        )
    )
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.eod == 50256 and tok.vocab_size == 50257
    reference = HFTokenizer(str(GPT2_JSON))
    assert [tok.tokenize(t) for t in TEXTS] == [reference.tokenize(t) for t in TEXTS]
    assert tok.tokenize("Hello world") == [15496, 995]  # GPT-2's well-known ids
    check_common(tok)
    with pytest.raises(ValueError, match="merge_file"):
        build_tokenizer(
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=None)
        )


@needs_shared
def test_tiktoken_from_local_bpe_file_matches_gpt2(tmp_path):
    vocab, _ = gpt2_model()
    decode = {c: b for b, c in bytes_to_unicode().items()}
    lines = []
    for token, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token == "<|endoftext|>":
            continue
        raw = bytes(decode[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {rank}")
    path = tmp_path / "gpt2.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="TiktokenTokenizer", vocab_file=str(path)))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.eod == 50256 and tok.vocab_size == 50257
    reference = HFTokenizer(str(GPT2_JSON))
    assert [tok.tokenize(t) for t in TEXTS] == [reference.tokenize(t) for t in TEXTS]
    check_common(tok)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken:2"):
        TiktokenTokenizer(str(bad))


@needs_shared
def test_hf_gpt2_tokenizer_adds_padding_token():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HFGPT2Tokenizer", vocab_file=str(GPT2_JSON)))
    assert isinstance(tok, HFGPT2Tokenizer)
    assert tok.eod == 50256 and tok.pad == 50257 and tok.vocab_size == 50258
    assert tok.tokenize("Hello world") == [15496, 995]
    check_common(tok)


@needs_shared
def test_spm_tokenizer(tmp_path):
    model = shared_files.train_shakespeare_spm(tmp_path / "spm", vocab_size=400)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="SPMTokenizer", vocab_file=str(model)))
    assert isinstance(tok, SPMTokenizer)
    assert tok.vocab_size == 400
    assert tok.tokenizer.id_to_piece(tok.eod) == "<|endoftext|>"
    assert tok.tokenizer.id_to_piece(tok.pad) == "<|padding|>"
    texts = ["First Citizen: Before we proceed any further, hear me speak.", "All: Speak, speak."]
    check_common(tok, texts)


def test_char_level_tokenizer():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="CharLevelTokenizer"))
    assert isinstance(tok, CharLevelTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (512, 0, 1)
    assert tok.tokenize("Hi é") == [72, 105, 32, 195, 169]
    check_common(tok)


def test_padded_vocab_size_rule():
    assert padded_vocab_size(50277, 128, 1) == 50304
    assert padded_vocab_size(50277, 128, 2) == 50432
    assert padded_vocab_size(512, 128, 4) == 512
    assert padded_vocab_size(1, 8, 1) == 8
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        padded_vocab_size(10, 0, 1)


def test_config_from_neox_args_and_errors(tmp_path):
    args = neox_namespace(tokenizer_type="CharLevelTokenizer", vocab_file=None, make_vocab_size_divisible_by=64)
    cfg = TokenizerConfig.from_neox_args(args)
    assert cfg.tokenizer_type == "CharLevelTokenizer" and cfg.make_vocab_size_divisible_by == 64
    assert cfg.model_parallel_size == 1
    with pytest.raises(ValueError, match="unknown tokenizer_type 'BertTokenizer'; valid: GPT2BPETokenizer"):
        build_tokenizer(TokenizerConfig(tokenizer_type="BertTokenizer"))
    with pytest.raises(ValueError, match="vocab_file"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=None))
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"nope\.json"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(broken)))


@pytest.mark.parametrize("preset", ["neox", "lossless"])
def test_train_tokenizer_produces_loadable_json(tmp_path, preset):
    docs = [{"text": f"def function_{i}(value):\n    return value * {i}  # naïve\n"} for i in range(200)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    out = tmp_path / "tok" / "tokenizer.json"
    size = train_tokenizer(str(tmp_path), str(out), vocab_size=400, preset=preset)
    assert 256 < size <= 400
    tok = HFTokenizer(str(out))
    assert (tok.eod, tok.pad) == (0, 1)
    text = "def function_7(value):\n    return value * 7  # naïve\n"
    ids = tok.tokenize(text)
    assert len(ids) < len(text.encode()) / 2  # merges were learnt
    if preset == "lossless":
        assert tok.detokenize(ids) == text
        assert tok.detokenize(tok.tokenize("unseen ☃ bytes")) == "unseen ☃ bytes"
    else:
        assert tok.detokenize(ids).strip() == text.strip()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        train_tokenizer(str(tmp_path), str(tmp_path / "t2.json"), vocab_size=300)


def _hf_cache_with_gpt2(root: Path) -> Path:
    """A Hugging Face hub cache holding model ``gpt2``'s tokenizer files (what a past download leaves)."""
    snapshot = root / "hub" / "models--gpt2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(GPT2_JSON.read_bytes())
    vocab, merges = gpt2_model()
    (snapshot / "vocab.json").write_text(json.dumps(vocab))
    (snapshot / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (snapshot / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "hub" / "models--gpt2" / "refs").mkdir()
    (root / "hub" / "models--gpt2" / "refs" / "main").write_text("0123abcd")
    return root / "hub"


_LOAD_BY_NAME = """
import sys
from megatron.tokenizer import TokenizerConfig, build_tokenizer
try:
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HFGPT2Tokenizer", vocab_file=sys.argv[1] if len(sys.argv) > 1 else None))
except ValueError as e:
    print("error:", e)
else:
    print(type(tok).__name__, tok.eod, tok.pad, tok.vocab_size, tok.tokenize("Hello world"))
"""


def _load_by_name(cache: Path, *vocab_file: str) -> str:
    """The tokenizer built in a fresh process (the hub reads HF_HUB_CACHE once, at import)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", _LOAD_BY_NAME, *vocab_file]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout.strip()


@needs_shared
def test_hf_gpt2_tokenizer_by_model_name_from_the_local_cache(tmp_path):
    # GPT-NeoX loads from_pretrained(vocab_file or "gpt2"): a model name (or no vocab_file) works from the cache
    cache = _hf_cache_with_gpt2(tmp_path)
    for vocab_file in (["gpt2"], []):
        assert _load_by_name(cache, *vocab_file) == "HFGPT2Tokenizer 50256 50257 50258 [15496, 995]"


def test_hf_gpt2_tokenizer_offline_without_cache_says_so(tmp_path):
    msg = _load_by_name(tmp_path / "empty-cache", "gpt2")
    assert msg.startswith("error: vocab_file 'gpt2'") and "not in the Hugging Face cache" in msg, msg
    assert "HF_HUB_OFFLINE=1" in msg and str(tmp_path / "empty-cache") in msg and "\n" not in msg
