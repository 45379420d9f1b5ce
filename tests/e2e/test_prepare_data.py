"""``prepare_data.py`` (GPT-NeoX's dataset entry point): the embedded corpus, local files, GPT-NeoX's dataset names
from files already on disk, and one-line errors (no download, unknown name, missing GPT-2 files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import HFTokenizer
from tests import shared_files
from tests.harness import PYTHON, REPO_ROOT, run_command

GPT2_JSON = shared_files.SHARED / "data" / "tokenizers" / "gpt2.json"
pytestmark = pytest.mark.skipif(not GPT2_JSON.exists(), reason="shared gpt2.json not on this machine")
TEXTS = ["def f(x):\n    return x + 1\n", "Hello world. Ünïcode too.", "class A:\n    pass\n"]


def prepare(*args: str, check: bool = True):
    return run_command([PYTHON, str(REPO_ROOT / "prepare_data.py"), *args], timeout=240, check=check)


def documents(prefix: str) -> list[list[int]]:
    ds = MMapIndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_local_file_and_neox_dataset_name_from_disk(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    data = tmp_path / "data"
    out = prepare(str(src), "-t", "HFTokenizer", "-v", str(GPT2_JSON), "-d", str(data)).stdout
    tok = HFTokenizer(str(GPT2_JSON))
    expected = [[*tok.tokenize(t), tok.eod] for t in TEXTS]
    assert documents(str(data / "docs" / "docs_text_document")) == expected
    assert f"data_path: {data / 'docs' / 'docs_text_document'}" in out

    # a GPT-NeoX dataset name reads the copy already in <data-dir>/<name>/ (what its downloader would leave)
    (data / "enwik8").mkdir()
    (data / "enwik8" / "enwik8.jsonl").write_text(src.read_text())
    prepare("enwik8", "-t", "HFTokenizer", "-v", str(GPT2_JSON), "-d", str(data))
    assert documents(str(data / "enwik8" / "enwik8_text_document")) == expected


def test_embedded_stdlib_corpus(tmp_path: Path) -> None:
    prepare("stdlib", "-t", "CharLevelTokenizer", "-d", str(tmp_path), "--max-docs", "5")
    docs = documents(str(tmp_path / "stdlib" / "stdlib_text_document"))
    corpus = [json.loads(line)["text"] for line in (tmp_path / "stdlib" / "stdlib.jsonl").read_text().splitlines()]
    assert len(docs) == len(corpus) == 5
    assert docs[0] == [*corpus[0].encode("utf-8"), 0]  # char-level ids are the UTF-8 bytes; eod 0


@pytest.mark.parametrize(
    "args,expected",
    [
        (["enwik8", "-t", "CharLevelTokenizer"], "has to be downloaded and downloads are off"),
        (["enwik9", "-t", "CharLevelTokenizer"], "unknown dataset 'enwik9'"),
        (["stdlib"], "GPT2BPETokenizer needs GPT-2's vocab and merges files"),
    ],
)
def test_errors_are_one_line_and_write_nothing(tmp_path: Path, args: list[str], expected: str) -> None:
    res = prepare(*args, "-d", str(tmp_path / "data"), check=False)
    assert res.returncode == 1, res.describe()
    assert expected in res.stderr and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    if "enwik8" in args:
        assert "data/enwik8/" in res.stderr
    if "enwik9" in args:
        assert "did you mean" in res.stderr and "enwik8?" in res.stderr
    assert not list((tmp_path).rglob("*.bin"))
