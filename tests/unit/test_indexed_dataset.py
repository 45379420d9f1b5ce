"""The .bin/.idx formats: round trips, the exact .idx bytes, legacy TNTIDX, infer, and clear errors on bad files."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data import indexed_dataset as ids
from megatron.data.legacy_indexed_dataset import IndexedCachedDataset, IndexedDataset, IndexedDatasetBuilder

DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 65000], [3, 4]]


def write_mmap(prefix: str, docs: list[list[int]], vocab_size: int | None = 1000) -> None:
    builder = ids.make_builder(prefix + ".bin", "mmap", vocab_size=vocab_size)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_round_trip_items_sizes_doc_idx_partial_reads(tmp_path):
    prefix = str(tmp_path / "d")
    write_mmap(prefix, DOCS)
    ds = ids.make_dataset(prefix, "mmap")
    assert isinstance(ds, ids.MMapIndexedDataset)
    assert ds.dtype == np.uint16
    assert len(ds) == 4
    assert ds.sizes.tolist() == [3, 1, 5, 2]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4]
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == doc
    assert ds.get(2, offset=1, length=3).tolist() == [9, 9, 9]
    assert ds.get(2, offset=3).tolist() == [9, 65000]
    assert [a.tolist() for a in ds[1:3]] == [DOCS[1], DOCS[2]]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)
    # Readers pickle by path (DataLoader workers).
    import pickle

    again = pickle.loads(pickle.dumps(ds))
    assert again[3].tolist() == [3, 4]


def test_dtype_follows_vocab_size(tmp_path):
    write_mmap(str(tmp_path / "small"), DOCS, vocab_size=65499)
    write_mmap(str(tmp_path / "big"), [[70000, 1]], vocab_size=65500)
    assert ids.make_dataset(str(tmp_path / "small")).dtype == np.uint16
    big = ids.make_dataset(str(tmp_path / "big"))
    assert big.dtype == np.int32
    assert big[0].tolist() == [70000, 1]


def test_idx_bytes_match_documented_layout(tmp_path):
    prefix = str(tmp_path / "d")
    builder = ids.MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item([1, 2, 3])
    builder.add_item([4])
    builder.end_document()  # a document of two items
    builder.add_item([5, 6])
    builder.end_document()
    builder.finalize(prefix + ".idx")
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert raw[9:17] == (1).to_bytes(8, "little")  # version
    assert raw[17:18] == bytes([8])  # uint16 code
    assert raw[18:26] == (3).to_bytes(8, "little")  # items
    assert raw[26:34] == (3).to_bytes(8, "little")  # doc_idx length: [0, 2, 3]
    assert raw[34:46] == struct.pack("<3i", 3, 1, 2)  # sizes int32
    assert raw[46:70] == struct.pack("<3q", 0, 6, 8)  # byte pointers
    assert raw[70:94] == struct.pack("<3q", 0, 2, 3)  # doc_idx
    assert len(raw) == 94
    assert Path(prefix + ".bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)
    # The standalone index writer produces the same bytes.
    ids.write_mmap_index(str(tmp_path / "w.idx"), np.uint16, [3, 1, 2], [0, 2, 3])
    assert Path(tmp_path / "w.idx").read_bytes() == raw


def test_add_documents_equals_item_by_item(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_mmap(a, DOCS)
    builder = ids.make_builder(b + ".bin", "mmap", vocab_size=1000)
    flat = np.concatenate([np.array(d) for d in DOCS])
    builder.add_documents(flat, np.array([len(d) for d in DOCS]))
    builder.finalize(b + ".idx")
    for ext in (".bin", ".idx"):
        assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes()


def test_legacy_cached_format_and_infer(tmp_path):
    prefix = str(tmp_path / "legacy")
    builder = ids.make_builder(prefix + ".bin", "cached")
    assert isinstance(builder, IndexedDatasetBuilder)
    for doc in DOCS:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:8] == b"TNTIDX\x00\x00"
    assert struct.unpack("<QQQQQQ", raw[8:56]) == (1, 4, 4, 4, 4, 5)  # version, int32 code, size, len, sizes, docs
    assert np.frombuffer(raw[56:96], np.int64).tolist() == [0, 1, 2, 3, 4]  # dim_offsets
    assert np.frombuffer(raw[96:136], np.int64).tolist() == [0, 3, 4, 9, 11]  # data_offsets
    assert ids.infer_dataset_impl(prefix) == "cached"
    for impl, cls in (("infer", IndexedCachedDataset), ("cached", IndexedCachedDataset), ("lazy", IndexedDataset)):
        ds = ids.make_dataset(prefix, impl)
        assert type(ds) is cls
        assert [ds[i].tolist() for i in range(len(ds))] == DOCS
        assert ds.sizes.tolist() == [3, 1, 5, 2]
        assert ds.get(2, offset=4, length=1).tolist() == [65000]
    mm = str(tmp_path / "mm")
    write_mmap(mm, DOCS)
    assert ids.infer_dataset_impl(mm) == "mmap"
    assert isinstance(ids.make_dataset(mm, "infer"), ids.MMapIndexedDataset)


def test_merge_keeps_documents(tmp_path):
    write_mmap(str(tmp_path / "a"), DOCS[:2])
    write_mmap(str(tmp_path / "b"), DOCS[2:])
    out = str(tmp_path / "merged")
    builder = ids.MMapIndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    builder.merge_file_(str(tmp_path / "a"))
    builder.merge_file_(str(tmp_path / "b"))
    builder.finalize(out + ".idx")
    merged = ids.make_dataset(out)
    assert [merged[i].tolist() for i in range(4)] == DOCS
    assert merged.doc_idx.tolist() == [0, 1, 2, 3, 4]
    write_mmap(str(tmp_path / "whole"), DOCS)
    assert Path(out + ".bin").read_bytes() == Path(tmp_path / "whole.bin").read_bytes()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate_idx", "does not match its header"),
        ("truncate_bin", "truncated"),
        ("magic", "wrong magic"),
        ("dtype", "dtype"),
        ("missing_bin", "data file not found"),
        ("missing_idx", "does not exist"),
        ("bad_code", "unknown dtype code"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path, damage, message):
    prefix = str(tmp_path / "d")
    write_mmap(prefix, DOCS)
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    raw = bytearray(Path(idx).read_bytes())
    if damage == "truncate_idx":
        Path(idx).write_bytes(raw[:-5])
    elif damage == "truncate_bin":
        Path(bin_).write_bytes(Path(bin_).read_bytes()[:-2])
    elif damage == "magic":
        raw[0:9] = b"NOTANIDX!"
        Path(idx).write_bytes(raw)
    elif damage == "dtype":
        raw[17] = 4  # the .idx now claims int32 tokens; the .bin holds uint16
        Path(idx).write_bytes(raw)
    elif damage == "missing_bin":
        os.remove(bin_)
    elif damage == "missing_idx":
        os.remove(idx)
    elif damage == "bad_code":
        raw[17] = 42
        Path(idx).write_bytes(raw)
    impl = "mmap" if damage in ("magic",) else "infer"
    with pytest.raises(ValueError, match=message) as err:
        ids.make_dataset(prefix, impl)
    assert prefix in str(err.value)


def test_unknown_impl_is_rejected(tmp_path):
    prefix = str(tmp_path / "d")
    write_mmap(prefix, DOCS)
    with pytest.raises(ValueError, match="valid: mmap, cached, lazy, infer"):
        ids.make_dataset(prefix, "fast")
