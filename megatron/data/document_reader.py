"""Read documents from ``.jsonl`` / ``.jsonl.zst`` / ``.jsonl.gz`` / ``.json`` / ``.txt`` files, with file:line errors.

A JSONL line is one document (a JSON object); ``.txt`` files are one document each and a ``.json`` file holding an
array is a list of documents (as ``lm_dataformat``).
Empty documents are dropped, as GPT-NeoX's reader does.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron.errors import DataError

SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json", ".json.zst", ".json.gz", ".zst", ".gz", ".txt")


class DocumentError(DataError):
    """A bad input line; the message names the file and line."""


@dataclass
class ReadStats:
    """What was read: documents yielded, skipped lines (with ``skip_invalid``) and empty documents dropped."""

    documents: int = 0
    skipped: int = 0
    empty: int = 0
    skipped_examples: list[str] = field(default_factory=list)


class _ZstdLines(io.RawIOBase):
    """The decompressed bytes of a (multi-frame) ``.zst`` file; a truncated last frame is an error, not an EOF."""

    def __init__(self, path: str) -> None:
        import zstandard

        self.path, self.raw = path, open(path, "rb")  # noqa: SIM115 - closed in close()
        self.dctx, self.pending = zstandard.ZstdDecompressor(), b""
        self.dobj: zstandard.ZstdDecompressionObj | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.dobj is not None and not self.dobj.eof:
                    raise EOFError("the last zstd frame is incomplete")
                return 0
            while chunk:
                if self.dobj is None or self.dobj.eof:
                    self.dobj = self.dctx.decompressobj()
                self.pending += self.dobj.decompress(chunk)
                chunk = self.dobj.unused_data if self.dobj.eof else b""
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def open_binary(path: str, name: str | None = None) -> io.BufferedIOBase:
    """The decompressed bytes of ``path``, by the suffix of ``name`` (default: ``path``): ``.zst``, ``.gz``, raw."""
    name = name or path
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdLines(path))
    if name.endswith((".gz", ".tgz")):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _checked_lines(path: str, f: io.BufferedIOBase) -> Iterator[bytes]:
    """The lines of a (compressed) file; a truncated or corrupt archive is a :class:`DocumentError` naming it."""
    kind = "zstd" if path.endswith(".zst") else "gzip" if path.endswith(".gz") else "input"
    lines = iter(f)
    lineno = 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except (EOFError, OSError, ValueError) as e:
            raise DocumentError(
                f"{path}: not a valid {kind} file or truncated after line {lineno} ({type(e).__name__}: {e})"
            ) from None
        except Exception as e:  # zstandard.ZstdError and friends
            if type(e).__module__.startswith("zstandard"):
                raise DocumentError(f"{path}: corrupt zstd data after line {lineno} ({e})") from None
            raise
        lineno += 1
        yield line


def check_inputs(paths: Sequence[str]) -> list[str]:
    """Validate input paths (exist, known suffix); returns them."""
    if not paths:
        raise DataError("--input: no input files given")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"--input: {path!r} does not exist or is not a file")
        if not path.endswith(SUFFIXES):
            raise DataError(f"--input: {path!r} has an unsupported suffix; valid: {', '.join(SUFFIXES)}")
    return list(paths)


def _texts(doc: dict[str, Any], keys: Sequence[str], where: str) -> dict[str, str]:
    """The string value of every key; null, numbers, booleans, lists and objects are refused (GPT-NeoX would store
    their ``str()``, e.g. ``'None'`` or ``"['a', 'b']"``, as if it were the document's text)."""
    for k in keys:
        if not isinstance(doc[k], str):
            kind = "null" if doc[k] is None else _JSON_KIND.get(type(doc[k]), type(doc[k]).__name__)
            raise DocumentError(f"{where}: key {k!r} holds {kind}, expected a string (the document's text)")
        if not doc[k].isascii():
            try:
                doc[k].encode("utf-8")
            except UnicodeEncodeError as e:  # a JSON "\ud800" escape: a lone surrogate no tokenizer can encode
                raise DocumentError(
                    f"{where}: key {k!r} holds a lone surrogate U+{ord(doc[k][e.start]):04X} at character {e.start} "
                    "(an unpaired \\uD800-\\uDFFF escape), which is not text; fix or drop the document"
                ) from None
    return {k: doc[k] for k in keys}


_JSON_KIND = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


def _starts_with_array(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _read_json_array(path: str, keys: Sequence[str], stats: ReadStats) -> Iterator[dict[str, str]]:
    """A ``.json`` file holding one array of documents (strings, or objects with the keys), as lm_dataformat."""
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DocumentError(f"{path}: not a valid JSON array ({e})") from None
    for n, item in enumerate(items):
        if isinstance(item, str):
            texts = _texts(dict.fromkeys(keys, item), keys, f"{path}: array element {n}")
        elif isinstance(item, dict) and all(k in item for k in keys):
            texts = _texts(item, keys, f"{path}: array element {n}")
        else:
            raise DocumentError(f"{path}: array element {n} is neither a string nor an object with keys {list(keys)}")
        if all(not t for t in texts.values()):
            stats.empty += 1
            continue
        stats.documents += 1
        yield texts


def read_documents(
    paths: Sequence[str], keys: Sequence[str], skip_invalid: bool = False, stats: ReadStats | None = None
) -> Iterator[dict[str, str]]:
    """Yield ``{key: text}`` per document. Invalid JSON, a non-object line, a missing key or invalid UTF-8 raise
    :class:`DocumentError` naming ``file:line`` (or, with ``skip_invalid``, are skipped and counted in ``stats``).
    """
    stats = stats if stats is not None else ReadStats()
    for path in check_inputs(paths):
        if path.endswith(".txt"):
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DocumentError(f"{path}: invalid UTF-8 at byte {e.start}") from None
            if text:
                stats.documents += 1
                yield dict.fromkeys(keys, text)
            else:
                stats.empty += 1
            continue
        if path.endswith(".json") and _starts_with_array(path):
            yield from _read_json_array(path, keys, stats)
            continue
        with open_binary(path) as f:
            for lineno, line in enumerate(_checked_lines(path, f), 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line.decode("utf-8"))
                    if not isinstance(doc, dict):
                        raise DocumentError(f"{path}:{lineno}: expected a JSON object, got {type(doc).__name__}")
                    missing = [k for k in keys if k not in doc]
                    if missing:
                        raise DocumentError(
                            f"{path}:{lineno}: missing key {missing[0]!r} (keys present: {sorted(doc)[:10]})"
                        )
                    texts = _texts(doc, keys, f"{path}:{lineno}")
                except (UnicodeDecodeError, json.JSONDecodeError, DocumentError) as e:
                    if isinstance(e, UnicodeDecodeError):
                        e = DocumentError(f"{path}:{lineno}: invalid UTF-8")
                    elif isinstance(e, json.JSONDecodeError):
                        e = DocumentError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
                    if not skip_invalid:
                        raise e from None
                    stats.skipped += 1
                    if len(stats.skipped_examples) < 5:
                        stats.skipped_examples.append(str(e))
                    continue
                if all(not t for t in texts.values()):
                    stats.empty += 1
                    continue
                stats.documents += 1
                yield texts
