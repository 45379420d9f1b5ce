"""Dataset downloads (megatron/data/download.py, remote_corpora.py) against a local HTTP server on 127.0.0.1 only:
resume with a Range request, size/checksum refusal, atomic final files, archives unpacked, offline refusal."""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from megatron.data import corpora, remote_corpora
from megatron.data.download import RemoteFile, download_file
from megatron.errors import DataError


class _Handler(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    ranges: ClassVar[list[str | None]] = []
    honour_range = True
    truncate_to: int | None = None  # announce the full length but send only this many bytes

    def do_GET(self) -> None:
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        header = self.headers.get("Range")
        type(self).ranges.append(header)
        start = int(header.removeprefix("bytes=").rstrip("-")) if header and self.honour_range else 0
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        payload = body[start:]
        if self.truncate_to is not None:
            payload = payload[: self.truncate_to]
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"files": {}, "ranges": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


BODY = bytes(range(256)) * 4000  # ~1 MB


def test_download_resumes_a_partial_file_with_a_range_request(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    dest = tmp_path / "data.bin"
    (tmp_path / "data.bin.partial").write_bytes(BODY[:1000])
    remote = RemoteFile(f"{base}/data.bin", size=len(BODY), sha256=hashlib.sha256(BODY).hexdigest())
    assert download_file(remote, dest) == dest
    assert dest.read_bytes() == BODY and handler.ranges == ["bytes=1000-"]
    assert not (tmp_path / "data.bin.partial").exists()


def test_a_server_without_range_support_restarts_the_file(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.honour_range = False
    (tmp_path / "data.bin.partial").write_bytes(b"x" * 1000)  # stale bytes that must not stay in front
    download_file(RemoteFile(f"{base}/data.bin", sha256=hashlib.sha256(BODY).hexdigest()), tmp_path / "data.bin")
    assert (tmp_path / "data.bin").read_bytes() == BODY


def test_checksum_mismatch_is_refused_and_leaves_no_file(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    with pytest.raises(DataError, match="SHA-256 mismatch"):
        download_file(RemoteFile(f"{base}/data.bin", sha256="0" * 64), tmp_path / "data.bin")
    assert list(tmp_path.iterdir()) == []


def test_short_transfer_is_refused_atomically(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.truncate_to = 5000
    with pytest.raises(DataError):
        download_file(RemoteFile(f"{base}/data.bin"), tmp_path / "data.bin")
    assert not (tmp_path / "data.bin").exists()  # never a partial final file


def test_unreachable_host_and_missing_file_are_one_line_errors(server, tmp_path: Path) -> None:
    base, _ = server
    with pytest.raises(DataError, match="HTTP 404"):
        download_file(RemoteFile(f"{base}/nothing.bin"), tmp_path / "x")
    with pytest.raises(DataError, match="only http and https"):
        download_file(RemoteFile("file:///etc/passwd"), tmp_path / "y")
    assert list(tmp_path.iterdir()) == []


def test_enwik8_style_zip_is_downloaded_unpacked_and_tokenized(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, handler = server
    text = "".join(f"<page>line {i}</page>\n" for i in range(50))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", text)
    handler.files["/dc/enwik8.zip"] = buf.getvalue()
    local = remote_corpora.RemoteDataset("enwik8", [f"{base}/dc/enwik8.zip"], {"enwik8.txt": len(text)})
    monkeypatch.setitem(remote_corpora.DATASETS, "enwik8", local)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    done = corpora.prepare_dataset("enwik8", "CharLevelTokenizer", data_dir=str(tmp_path))
    assert done.inputs == [str(tmp_path / "enwik8" / "enwik8.txt")] and done.result.documents > 0
    assert (tmp_path / "enwik8" / "enwik8_text_document.idx").is_file()
    assert remote_corpora.DATASETS["pile"].urls[0].endswith("/00.jsonl.zst")  # GPT-NeoX's URL table stays intact


def test_offline_refuses_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="downloads are off") as e:
        corpora.prepare_dataset("enwik8", "CharLevelTokenizer", data_dir=str(tmp_path))
    assert "\n" not in str(e.value) and not list(tmp_path.rglob("*"))


def test_gpt_neox_names_and_urls() -> None:
    from tests.harness import load_tool

    downloaders = load_tool("tools/datasets/corpora.py").DATA_DOWNLOADERS
    assert downloaders["enwik8"].urls == ["http://mattmahoney.net/dc/enwik8.zip"]
    assert len(downloaders["c4"].urls) == 1024 and set(corpora.REMOTE_DATASETS) == set(downloaders)


def test_force_redownload_fetches_and_unpacks_again(server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, handler = server
    local = remote_corpora.RemoteDataset("enwik8", [f"{base}/dc/enwik8.zip"])
    monkeypatch.setitem(remote_corpora.DATASETS, "enwik8", local)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    for text in ("first version\n", "second version\n"):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("enwik8", text)
        handler.files["/dc/enwik8.zip"] = buf.getvalue()
        corpora.prepare_dataset("enwik8", "CharLevelTokenizer", data_dir=str(tmp_path), force_redownload=True)
        assert (tmp_path / "enwik8" / "enwik8.txt").read_text() == text
