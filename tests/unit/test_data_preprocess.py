"""The preprocessing engine in-process: many small batches over several workers give the same bytes as one."""

from __future__ import annotations

import io
import json

import pytest

from megatron.data.document_reader import DocumentError, ReadStats, read_documents
from megatron.data.indexed_dataset import make_dataset
from megatron.data.preprocess import PreprocessConfig, preprocess


def write_corpus(path, n: int) -> list[str]:
    texts = [f"word{i} " * (1 + i % 17) + "é\n" for i in range(n)]
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return texts


@pytest.mark.parametrize("workers", [1, 3])
def test_small_batches_any_worker_count_same_bytes(tmp_path, workers):
    src = tmp_path / "c.jsonl"
    texts = write_corpus(src, 50)
    base = dict(inputs=[str(src)], tokenizer_type="CharLevelTokenizer", append_eod=True, log_interval=7)
    ref = preprocess(PreprocessConfig(output_prefix=str(tmp_path / "ref"), **base), progress_stream=io.StringIO())
    progress = io.StringIO()
    out = preprocess(
        PreprocessConfig(output_prefix=str(tmp_path / "out"), workers=workers, batch_docs=3, batch_chars=100, **base),
        progress_stream=progress,
    )
    assert out.documents == ref.documents == 50
    assert out.tokens == ref.tokens == sum(len(t.encode()) + 1 for t in texts)
    assert "docs/s" in progress.getvalue() and "tokens/s" in progress.getvalue()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out_text_document{ext}").read_bytes() == (
            tmp_path / f"ref_text_document{ext}"
        ).read_bytes()
    ds = make_dataset(str(tmp_path / "out_text_document"))
    assert ds[49].tolist() == [*texts[49].encode(), 0]


def test_reader_reports_file_and_line_or_counts_skips(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_bytes(b'{"text": "a"}\n\n{"text": "\xff"}\n{"text": 5}\n')
    with pytest.raises(DocumentError, match=r"r\.jsonl:3: invalid JSON|r\.jsonl:3: invalid UTF-8"):
        list(read_documents([str(src)], ["text"]))
    stats = ReadStats()
    docs = list(read_documents([str(src)], ["text"], skip_invalid=True, stats=stats))
    assert docs == [{"text": "a"}]  # a number is not text: refused like any invalid line (GPT-NeoX stores '5')
    assert stats.skipped == 2 and stats.documents == 1
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported suffix"):
        list(read_documents([str(tmp_path / "x.csv")], ["text"]))


def test_json_array_file_and_jsonl_named_json(tmp_path):
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(["first doc", {"text": "second doc"}, ""]))
    stats = ReadStats()
    assert list(read_documents([str(arr)], ["text"], stats=stats)) == [{"text": "first doc"}, {"text": "second doc"}]
    assert stats.empty == 1
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert [d["text"] for d in read_documents([str(lines)], ["text"])] == ["a", "b"]
    arr.write_text(json.dumps([1]))
    with pytest.raises(DocumentError, match=r"arr\.json: array element 0"):
        list(read_documents([str(arr)], ["text"]))
