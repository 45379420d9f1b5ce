"""CLI flows of the data tools: corpora -> train_tokenizer -> preprocess_data, workers, formats, bad input, tools."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard

from megatron.data.indexed_dataset import MMapIndexedDataset, make_dataset
from megatron.tokenizer import HFTokenizer
from tests import shared_files
from tests.harness import PYTHON, REPO_ROOT, run_command

GPT2_JSON = shared_files.SHARED / "data" / "tokenizers" / "gpt2.json"
TOOLS = REPO_ROOT / "tools" / "datasets"
pytestmark = pytest.mark.skipif(not GPT2_JSON.exists(), reason="shared gpt2.json not on this machine")


def preprocess(*args: str, check: bool = True):
    cmd = [PYTHON, str(TOOLS / "preprocess_data.py"), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(GPT2_JSON)]
    return run_command([*cmd, *args], timeout=240, check=check)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """60 real documents (stdlib sources) as JSONL, built by the corpora tool."""
    out = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    result = run_command([PYTHON, str(TOOLS / "corpora.py"), "--output", str(out), "--max-docs", "60"], timeout=120)
    assert "Wrote 60 documents" in result.stdout
    return out


def read_docs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_workers_two_equals_one_and_matches_tokenizer(corpus, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = preprocess("--input", str(corpus), "--output-prefix", str(one), "--append-eod", "--workers", "1")
    r2 = preprocess(
        "--input", str(corpus), "--output-prefix", str(two), "--append-eod", "--workers", "2", "--log-interval", "10"
    )
    plain = tmp_path / "plain"
    r3 = preprocess(
        "--input", str(corpus), "--output-prefix", str(plain), "--append-eod", "--workers", "2", "--no-fast-encoder"
    )
    assert "docs/s" in r2.stderr and "tokens/s" in r2.stderr
    assert f"Wrote {two}_text_document.bin and {two}_text_document.idx" in r2.stdout
    # one line says which encoder ran; the fast one and the tokenizer itself write the same bytes
    lines = [x for x in r1.stderr.splitlines() if x.startswith("encoder:")]
    assert len(lines) == 1 and re.fullmatch(
        r"encoder: tiktoken \(byte-level BPE; each of its 50000 merge results is its own tokenizers encoding, so "
        r"tiktoken merges as tokenizers does; also identical on (\d+)/\1 sample documents\)",
        lines[0],
    ), lines
    assert "encoder: tokenizers (fast encoder not used: disabled (--no-fast-encoder))" in r3.stderr
    for ext in (".bin", ".idx"):
        assert Path(f"{one}_text_document{ext}").read_bytes() == Path(f"{two}_text_document{ext}").read_bytes()
        assert Path(f"{one}_text_document{ext}").read_bytes() == Path(f"{plain}_text_document{ext}").read_bytes()
    assert "Processed 60 documents" in r1.stdout
    ds = make_dataset(f"{one}_text_document", "infer")
    assert isinstance(ds, MMapIndexedDataset) and ds.dtype == np.uint16 and len(ds) == 60
    tok = HFTokenizer(str(GPT2_JSON))
    docs = read_docs(corpus)
    for i in (0, 17, 59):
        assert ds[i].tolist() == [*tok.tokenize(docs[i]["text"]), tok.eod]
    assert ds.doc_idx.tolist() == list(range(61))
    assert not list(tmp_path.glob("*.partial"))


def test_compressed_multiple_inputs_and_txt(corpus, tmp_path):
    lines = corpus.read_text().splitlines(keepends=True)
    zst, gz = tmp_path / "a.jsonl.zst", tmp_path / "b.jsonl.gz"
    zst.write_bytes(zstandard.ZstdCompressor().compress("".join(lines[:25]).encode()))
    with gzip.open(gz, "wt") as f:
        f.write("".join(lines[25:]))
    preprocess("--input", f"{zst},{gz}", "--output-prefix", str(tmp_path / "split"), "--workers", "2")
    preprocess("--input", str(corpus), "--output-prefix", str(tmp_path / "whole"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"split_text_document{ext}").read_bytes() == (
            tmp_path / f"whole_text_document{ext}"
        ).read_bytes()
    txt = tmp_path / "plain.txt"
    txt.write_text("A whole file is one document.\nSecond line.\n")
    preprocess("--input", str(txt), "--output-prefix", str(tmp_path / "txt"), "--append-eod")
    ds = make_dataset(str(tmp_path / "txt_text_document"))
    tok = HFTokenizer(str(GPT2_JSON))
    assert len(ds) == 1 and ds[0].tolist() == [*tok.tokenize(txt.read_text()), 50256]


def test_several_keys_and_cached_impl(tmp_path):
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"q": f"question {i}?", "a": f"answer {i}."}) + "\n" for i in range(5)))
    preprocess(
        "--input",
        str(src),
        "--jsonl-keys",
        "q",
        "a",
        "--output-prefix",
        str(tmp_path / "qa"),
        "--dataset-impl",
        "cached",
    )
    tok = HFTokenizer(str(GPT2_JSON))
    for key in ("q", "a"):
        ds = make_dataset(str(tmp_path / f"qa_{key}_document"), "infer")
        assert type(ds).__name__ == "IndexedCachedDataset"
        assert ds[3].tolist() == tok.tokenize("question 3?" if key == "q" else "answer 3.")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "fine"}\n{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:3: invalid JSON"),
        ('{"text": "fine"}\n{"body": "no text key"}\n', "bad.jsonl:2: missing key 'text'"),
        ('["a list"]\n', "bad.jsonl:1: expected a JSON object"),
        ("", "no documents in"),
        ('{"text": ""}\n', "no documents in"),
        # GPT-NeoX stores str(value) ('None', "['a', 'b']", '12345') as if it were text; refused here.
        ('{"text": "fine"}\n{"text": null}\n', "bad.jsonl:2: key 'text' holds null, expected a string"),
        ('{"text": ["a", "b"]}\n', "bad.jsonl:1: key 'text' holds a list, expected a string"),
        ('{"text": 12345}\n', "bad.jsonl:1: key 'text' holds a number, expected a string"),
        ('{"text": {"body": "x"}}\n', "bad.jsonl:1: key 'text' holds an object, expected a string"),
        # a JSON escape of half a UTF-16 pair: valid JSON, not text (tokenizers raised a bare TypeError)
        (
            '{"text": "fine"}\n{"text": "caf\\u00e9 \\ud800 x"}\n',
            "bad.jsonl:2: key 'text' holds a lone surrogate U+D800",
        ),
    ],
)
def test_bad_input_fails_cleanly(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    result = preprocess("--input", str(bad), "--output-prefix", str(out / "x"), "--workers", "2", check=False)
    assert result.returncode == 1
    assert message in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(out) == []  # no partial output


def test_skip_invalid_counts_and_continues(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"text": "one"}\nnot json\n{"text": "two"}\n{"other": 1}\n')
    result = preprocess("--input", str(src), "--output-prefix", str(tmp_path / "m"), "--skip-invalid")
    assert "Skipped 2 invalid lines" in result.stdout and "mixed.jsonl:2" in result.stdout
    assert len(make_dataset(str(tmp_path / "m_text_document"))) == 2
    missing = preprocess("--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "n"), check=False)
    assert missing.returncode == 1 and "nope.jsonl" in missing.stderr


def test_quickstart_chain_merge_and_token_count(tmp_path):
    data = tmp_path / "data" / "stdlib"
    run_command([PYTHON, str(TOOLS / "corpora.py"), "--output", str(data / "stdlib.jsonl"), "--max-docs", "30"])
    trained = run_command(
        [
            PYTHON,
            str(TOOLS / "train_tokenizer.py"),
            "--json_input_dir",
            str(data),
            "--tokenizer_output_path",
            str(data / "tokenizer.json"),
            "--vocab_size",
            "512",
        ],
        timeout=240,
    )
    assert "Tokenizer saved at" in trained.stdout
    run_command(
        [
            PYTHON,
            str(TOOLS / "preprocess_data.py"),
            "--input",
            str(data / "stdlib.jsonl"),
            "--output-prefix",
            str(data / "stdlib"),
            "--tokenizer-type",
            "HFTokenizer",
            "--vocab-file",
            str(data / "tokenizer.json"),
            "--append-eod",
            "--workers",
            "2",
        ],
        timeout=240,
    )
    prefix = str(data / "stdlib_text_document")
    ds = make_dataset(prefix)
    assert len(ds) == 30 and int(ds.sizes.max()) > 0 and all(ds[i][-1] == 0 for i in range(30))  # eod id 0
    # merge two copies, then count tokens
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("p1", "p2"):
        for ext in (".bin", ".idx"):
            (parts / f"{name}{ext}").write_bytes(Path(prefix + ext).read_bytes())
    merged = tmp_path / "merged"
    out = run_command([PYTHON, str(TOOLS / "merge_datasets.py"), "--input", str(parts), "--output-prefix", str(merged)])
    assert "Merged 2 datasets (60 items)" in out.stdout
    total = int(ds.sizes.sum())
    counted = run_command([PYTHON, str(TOOLS / "dataset_token_count.py"), str(merged), prefix])
    assert f"{merged}: {2 * total} tokens in 60 items" in counted.stdout
    assert f"{prefix}: {total} tokens in 30 items" in counted.stdout
    bad = run_command([PYTHON, str(TOOLS / "dataset_token_count.py"), str(tmp_path / "none")], check=False)
    assert bad.returncode == 1 and "none.idx" in bad.stderr
