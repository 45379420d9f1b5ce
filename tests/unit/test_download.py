"""Dataset downloads (megatron/data/download.py, remote_corpora.py) against a local HTTP server on 127.0.0.1 only:
resume with a Range request, size/checksum refusal, atomic final files, archives unpacked, offline refusal."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from megatron.data import corpora, download, remote_corpora
from megatron.data.download import RemoteFile, download_file
from megatron.errors import DataError


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``files``; ``cuts`` (popped one per request) close the connection after that many body bytes."""

    files: ClassVar[dict[str, bytes]] = {}
    ranges: ClassVar[list[str | None]] = []
    if_ranges: ClassVar[list[str | None]] = []
    cuts: ClassVar[list[int]] = []
    honour_range = True
    honour_if_range = True
    send_length = True

    def do_GET(self) -> None:
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        etag = f'"{hashlib.sha256(body).hexdigest()[:16]}"'
        header, if_range = self.headers.get("Range"), self.headers.get("If-Range")
        type(self).ranges.append(header)
        type(self).if_ranges.append(if_range)
        start = int(header.removeprefix("bytes=").rstrip("-")) if header and self.honour_range else 0
        if if_range is not None and if_range != etag and self.honour_if_range:
            start = 0  # the file changed: the whole new file
        if start >= len(body) and start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        self.send_header("ETag", etag)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        if self.send_length:
            self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        payload = body[start:]
        if self.cuts:
            payload = payload[: type(self).cuts.pop(0)]
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"files": {}, "ranges": [], "if_ranges": [], "cuts": []})
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
    handler.cuts = [5000, 5000]
    with pytest.raises(DataError, match=r"interrupted .* after 2 tries; 10000 bytes kept"):
        download_file(RemoteFile(f"{base}/data.bin"), tmp_path / "data.bin", retries=1, backoff_s=0)
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
    with open(tmp_path / "enwik8" / "enwik8.txt", "r+b") as f:  # damaged after the download: every run checks it
        f.truncate(len(text) - 1)
    with pytest.raises(DataError, match=f"should be {len(text)} bytes but is {len(text) - 1}"):
        corpora.prepare_dataset("enwik8", "CharLevelTokenizer", data_dir=str(tmp_path))
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
    assert downloaders["enwik8"].files[0].size == 36_445_475  # its known size; no SHA-256 is published


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


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_cut_download_keeps_its_bytes_and_resumes_from_the_byte_where_it_stopped(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.cuts = [300_000]  # the first response drops the connection after 300,000 of ~1 MB
    dest = tmp_path / "data.bin"
    with pytest.raises(DataError, match="interrupted") as e:
        download_file(RemoteFile(f"{base}/data.bin"), dest, retries=0)
    assert "\n" not in str(e.value) and (tmp_path / "data.bin.partial").stat().st_size == 300_000
    download_file(RemoteFile(f"{base}/data.bin"), dest)  # the same command again
    assert handler.ranges == [None, "bytes=300000-"] and _sha(dest.read_bytes()) == _sha(BODY)
    assert handler.if_ranges[1] is not None  # the validator the first reply gave (If-Range)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_a_cut_is_retried_within_one_call_with_a_range_request(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.cuts = [1234, 500_000]
    dest = tmp_path / "data.bin"
    download_file(RemoteFile(f"{base}/data.bin", size=len(BODY), sha256=_sha(BODY)), dest, backoff_s=0.01)
    assert handler.ranges == [None, "bytes=1234-", "bytes=501234-"] and dest.read_bytes() == BODY


def test_after_a_cut_a_server_ignoring_range_restarts_cleanly_from_byte_0(server, tmp_path: Path) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.honour_range = False
    handler.cuts = [300_000]
    download_file(RemoteFile(f"{base}/data.bin"), tmp_path / "data.bin", backoff_s=0.01)
    assert handler.ranges == [None, "bytes=300000-"]  # asked to resume, got a 200: truncated, not appended
    assert _sha((tmp_path / "data.bin").read_bytes()) == _sha(BODY)


@pytest.mark.parametrize("honour_if_range", [True, False])
def test_a_file_changed_between_attempts_restarts_rather_than_splicing(
    server, tmp_path: Path, honour_if_range: bool
) -> None:
    base, handler = server
    handler.files["/data.bin"] = BODY
    handler.honour_if_range = honour_if_range  # False: the server resumes anyway, but its ETag shows the change
    handler.cuts = [300_000]
    dest = tmp_path / "data.bin"
    with pytest.raises(DataError, match="interrupted"):
        download_file(RemoteFile(f"{base}/data.bin"), dest, retries=0)
    new = bytes(reversed(BODY))
    handler.files["/data.bin"] = new
    download_file(RemoteFile(f"{base}/data.bin"), dest, backoff_s=0.01)
    assert _sha(dest.read_bytes()) == _sha(new)
    assert handler.ranges[1] == "bytes=300000-" and handler.if_ranges[1] == f'"{_sha(BODY)[:16]}"'


def _frames(docs: int, per_frame: int) -> tuple[bytes, list[int]]:
    """A multi-frame ``.jsonl.zst`` with content checksums, and where each frame ends."""
    import zstandard

    c = zstandard.ZstdCompressor(write_checksum=True)
    data, ends = b"", []
    for first in range(0, docs, per_frame):
        lines = "".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(first, first + per_frame))
        data += c.compress(lines.encode())
        ends.append(len(data))
    return data, ends


def _remote_dataset(monkeypatch: pytest.MonkeyPatch, urls: list[str], sizes: dict[str, int] | None = None) -> None:
    monkeypatch.setitem(
        remote_corpora.DATASETS, "pile_subset", remote_corpora.RemoteDataset("pile_subset", urls, sizes or {})
    )
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(download, "BACKOFF_S", 0.01)


def test_a_stream_without_length_cut_between_zstd_frames_is_completed(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, handler = server
    data, ends = _frames(600, 300)
    handler.files["/00.jsonl.zst"] = data
    handler.send_length = False
    handler.cuts = [ends[0]]  # a valid 300-document file, one frame short
    _remote_dataset(monkeypatch, [f"{base}/00.jsonl.zst"])
    done = corpora.prepare_dataset("pile_subset", "CharLevelTokenizer", data_dir=str(tmp_path))
    assert done.result.documents == 600 and handler.ranges == [None, f"bytes={ends[0]}-"]
    # a complete stream without length: the end is confirmed by a 416 to one more Range request
    handler.ranges.clear()
    download_file(RemoteFile(f"{base}/00.jsonl.zst"), tmp_path / "again.jsonl.zst")
    assert handler.ranges == [None, f"bytes={len(data)}-"] and (tmp_path / "again.jsonl.zst").read_bytes() == data


def _gzip_docs(docs: int) -> bytes:
    return gzip.compress("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(docs)).encode())


@pytest.mark.parametrize("name", ["00.jsonl.zst", "00.jsonl.gz"])
def test_a_truncated_stream_is_one_line_error_and_no_dataset(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    import prepare_data

    base, handler = server
    data = _frames(600, 300)[0] if name.endswith(".zst") else _gzip_docs(2000)
    handler.files[f"/{name}"] = data
    handler.send_length = False
    handler.honour_range = False  # nothing but the format can tell the stream is short
    handler.cuts = [len(data) - 7, len(data) - 7]  # inside the last zstd frame / before the gzip trailer's end
    _remote_dataset(monkeypatch, [f"{base}/{name}"])
    argv = ["pile_subset", "-t", "CharLevelTokenizer", "-d", str(tmp_path)]
    assert prepare_data.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated or corrupt" in err and name in err
    folder = tmp_path / "pile_subset"
    assert not (folder / name).exists() and not list(folder.glob("*_text_document.*"))  # nothing a rerun would reuse


def _zip(members: list[tuple[str, bytes, int | None]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if mode is not None:
                info.external_attr = mode << 16
            z.writestr(info, data)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        (("../evil.txt", b"outside", None), "points outside the folder"),
        (("/tmp/evil.txt", b"outside", None), "points outside the folder"),
        (("link", b"/etc/passwd", 0o120777), "is a link or device"),
        (("bomb.txt", b"\0" * (8 << 20), None), "a zip bomb"),
    ],
)
def test_a_refused_archive_stays_refused_with_nothing_extracted(
    server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    second: tuple[str, bytes, int | None],
    expected: str,
) -> None:
    import prepare_data

    base, handler = server
    handler.files["/dc/enwik8.zip"] = _zip([("enwik8", b"<page>the first member</page>\n" * 20, None), second])
    local = remote_corpora.RemoteDataset("enwik8", [f"{base}/dc/enwik8.zip"], {"enwik8.txt": 100})
    monkeypatch.setitem(remote_corpora.DATASETS, "enwik8", local)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    data_dir = tmp_path / "data"
    errors = []
    for _ in range(2):  # the same command twice
        assert prepare_data.main(["enwik8", "-t", "CharLevelTokenizer", "-d", str(data_dir)]) == 1
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1] and errors[0].count("\n") == 1 and expected in errors[0]
    assert sorted(p.name for p in (data_dir / "enwik8").iterdir()) == ["enwik8.zip"]  # nothing else, no marker
    assert not (tmp_path / "evil.txt").exists() and not (data_dir / "evil.txt").exists()


def test_an_unfinished_multi_file_download_is_finished_not_tokenized(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, handler = server
    first, second = _gzip_docs(10), _gzip_docs(20)
    handler.files["/00.jsonl.gz"] = first
    _remote_dataset(monkeypatch, [f"{base}/00.jsonl.gz", f"{base}/01.jsonl.gz"])
    monkeypatch.setattr(download, "RETRIES", 0)
    with pytest.raises(DataError, match="HTTP 404"):  # the second file is not there yet
        corpora.prepare_dataset("pile_subset", "CharLevelTokenizer", data_dir=str(tmp_path))
    handler.files["/01.jsonl.gz"] = second
    done = corpora.prepare_dataset("pile_subset", "CharLevelTokenizer", data_dir=str(tmp_path))
    assert done.result.documents == 30  # not the 10 of the first file alone


def _tar_gz(members: list[tarfile.TarInfo], data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for info in members:
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _tar_member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, link
    return info


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (_tar_member("docs/link.jsonl", tarfile.SYMTYPE, link="/etc/passwd"), "is a link or device"),
        (_tar_member("docs/hard.jsonl", tarfile.LNKTYPE, link="docs/a.jsonl"), "is a link or device"),
        (_tar_member("../up.jsonl", size=12), "points outside the folder"),
    ],
)
def test_a_tar_archive_is_checked_whole_before_anything_is_extracted(
    tmp_path: Path, bad: tarfile.TarInfo, expected: str
) -> None:
    from megatron.data.archives import unpack

    folder = tmp_path / "corpus"
    folder.mkdir()
    archive = folder / "docs.tar.gz"
    line = b'{"text": "x"}\n'
    archive.write_bytes(_tar_gz([_tar_member("docs/a.jsonl", size=len(line)), bad], line))
    for _ in range(2):
        with pytest.raises(DataError, match=expected):
            unpack(archive, folder)
        assert sorted(p.name for p in folder.iterdir()) == ["docs.tar.gz"]
    archive.write_bytes(_tar_gz([_tar_member("docs/a.jsonl", size=len(line))], line))
    assert unpack(archive, folder) == [folder / "docs" / "a.jsonl"]
    assert (folder / "docs" / "a.jsonl").read_bytes() == line


def _corrupt_files() -> list[tuple[str, bytes, str]]:
    import zstandard

    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b'{"text": "a"}\n' * 1000)
    gz = gzip.compress(b'{"text": "a"}\n' * 1000)
    zipped = _zip([("a.jsonl", b'{"text": "a"}\n' * 1000, None)])
    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w") as t:
        t.addfile(_tar_member("a.jsonl", size=100_000), io.BytesIO(b"x" * 100_000))
    return [
        ("x.jsonl.zst", frame + b"junk", "corrupt zstd stream"),  # bytes after the last frame
        ("x.jsonl.zst", frame[:-4] + bytes(4), "checksum"),  # the frame's content checksum
        ("x.jsonl.gz", gz[:-8] + bytes(8), "CRC check failed"),  # the trailer's CRC-32 and ISIZE
        ("x.zip", zipped[:-30], "not a complete zip archive"),  # no central directory
        ("x.tar", tarred.getvalue()[:50_000], "cut off"),
        ("x.jsonl.zst", b"", "empty"),
    ]


@pytest.mark.parametrize(("name", "data", "expected"), _corrupt_files())
def test_a_file_is_checked_by_its_format(tmp_path: Path, name: str, data: bytes, expected: str) -> None:
    from megatron.data.stream_check import check_complete

    (tmp_path / "f").write_bytes(data)
    with pytest.raises(DataError, match=expected) as e:
        check_complete(tmp_path / "f", name)
    assert "\n" not in str(e.value)


def test_an_archive_larger_than_the_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.data import archives

    (tmp_path / "a.zip").write_bytes(_zip([("a.jsonl", b"x" * 1000, None)]))
    monkeypatch.setattr(archives, "MAX_TOTAL_BYTES", 999)
    with pytest.raises(DataError, match="unpacks to 1000 bytes"):
        archives.unpack(tmp_path / "a.zip", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["a.zip"]
