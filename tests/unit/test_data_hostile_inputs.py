"""Hostile data reaching training: a structurally bad ``.idx``, token ids outside the vocabulary, stale or corrupt
index-map caches, datasets without documents and splits that come out empty — each a one-line ``DataError`` naming
the file, or (caches) a rebuild with one log line."""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from megatron.data import index_format, index_map_cache, token_check
from megatron.data.data_utils import DataConfig, build_train_valid_test_datasets
from megatron.data.gpt2_dataset import GPT2Dataset, index_map_paths
from megatron.data.index_format import MMAP_HEADER_BYTES
from megatron.data.index_map_params import IndexMapParams
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, make_dataset, write_mmap_index
from megatron.errors import DataError


def write_docs(prefix: str, docs: list[list[int]], dtype: type = np.uint16) -> str:
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def patch_idx(prefix: str, sizes: list[int] | None = None, pointers: list[int] | None = None, doc_idx=None) -> None:
    """Overwrite the arrays of an existing ``.idx`` in place (same counts)."""
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    n, d = struct.unpack("<QQ", raw[18:34])
    at = MMAP_HEADER_BYTES
    if sizes is not None:
        raw[at : at + 4 * n] = np.asarray(sizes, np.int32).tobytes()
    at += 4 * n
    if pointers is not None:
        raw[at : at + 8 * n] = np.asarray(pointers, np.int64).tobytes()
    at += 8 * n
    if doc_idx is not None:
        raw[at : at + 8 * d] = np.asarray(doc_idx, np.int64).tobytes()
    Path(prefix + ".idx").write_bytes(bytes(raw))


DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # pointers 0, 6, 10 (uint16); the .bin has 18 bytes


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"pointers": [0, 0, 0]}, "document 1 starts at byte 0 of the .bin, expected 6 (right after document 0)"),
        ({"pointers": [0, 6, 12]}, "document 2 starts at byte 12 of the .bin, expected 10"),  # ends past the .bin
        ({"pointers": [2, 6, 10]}, "document 0 starts at byte 2 of the .bin, expected 0"),
        ({"sizes": [3, -2, 8]}, "document 1 has a negative size -2"),
        ({"sizes": [3, 2, 5]}, "describes 20 bytes"),  # sizes add up past the .bin
        ({"doc_idx": [0, 2, 1, 3]}, "doc_idx decreases at entry 2"),
        ({"doc_idx": [0, 1, 2, 9]}, "doc_idx[3] = 9 lies outside [0, 3]"),
        ({"doc_idx": [1, 1, 2, 3]}, "doc_idx starts at 1"),
    ],
)
def test_structurally_bad_idx_is_refused_on_open(tmp_path: Path, damage: dict, message: str) -> None:
    prefix = write_docs(str(tmp_path / "d"), DOCS)
    patch_idx(prefix, **damage)
    with pytest.raises(DataError) as err:
        make_dataset(prefix)
    text = str(err.value)
    assert message in text and prefix in text and "\n" not in text


def test_large_index_is_checked_fast_and_names_the_first_bad_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two million items in chunks of 300k (the carry between chunks must be right); vectorised, so fast."""
    monkeypatch.setattr(index_format, "CHECK_CHUNK", 300_000)
    n = 2_000_000
    sizes = np.random.RandomState(0).randint(0, 5, n).astype(np.int32)
    prefix = str(tmp_path / "big")
    write_mmap_index(prefix + ".idx", np.uint16, sizes, np.arange(n + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum(dtype=np.int64)) * 2)
    start = time.perf_counter()
    assert len(MMapIndexedDataset(prefix)) == n
    elapsed = time.perf_counter() - start  # ~0.15 s per 10 million items on an idle core (docs/data.md)
    assert elapsed < 20, elapsed  # generous for a busy machine (vectorised: well under a second here)
    bad = 3 * 300_000 + 12345  # in the fourth chunk
    idx = np.fromfile(prefix + ".idx", dtype=np.uint8)
    pointer_at = MMAP_HEADER_BYTES + 4 * n + 8 * bad
    idx[pointer_at : pointer_at + 8].view(np.int64)[0] += 2
    idx.tofile(prefix + ".idx")
    with pytest.raises(DataError, match=f"document {bad} starts at byte"):
        MMapIndexedDataset(prefix)


def data_config(prefix: str, **kw) -> DataConfig:
    base = dict(seq_length=4, train_batch_size=2, micro_batch_size=2, train_iters=3, eval_interval=3, eval_iters=1)
    return DataConfig(data_path=prefix, num_workers=0, **{**base, **kw})


def test_token_ids_outside_the_vocabulary_are_refused_once_per_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = write_docs(str(tmp_path / "t"), [[1, 2, 3, 500], [7, 8]] * 10)
    cfg = data_config(prefix, split="100,0,0", padded_vocab_size=256)
    with pytest.raises(DataError) as err:
        build_train_valid_test_datasets(cfg)
    assert f"{prefix}.bin: token id 500 is outside the model's vocabulary of 256" in str(err.value)
    stamp = token_check.stamp_path(prefix)
    assert os.path.isfile(stamp)
    # The range is cached: later runs (any vocabulary) read the stamp instead of scanning the .bin again.
    monkeypatch.setattr(token_check, "scan_token_range", lambda ds: pytest.fail("rescanned despite a valid stamp"))
    cfg.padded_vocab_size = 512
    assert build_train_valid_test_datasets(cfg)[0] is not None
    with pytest.raises(DataError, match="token id 500"):
        build_train_valid_test_datasets(data_config(prefix, split="100,0,0", padded_vocab_size=500))
    monkeypatch.undo()
    # Data preprocessed again (new size / mtime): the stamp no longer vouches for it, the .bin is scanned again.
    write_docs(prefix, [[1, 2, 3, 4], [7, 8]] * 10)
    assert build_train_valid_test_datasets(data_config(prefix, split="100,0,0", padded_vocab_size=256))[0]
    # A dtype that cannot hold an id past the vocabulary needs no scan (and no stamp).
    small = write_docs(str(tmp_path / "u8"), [[1, 2, 3]] * 20, dtype=np.uint8)
    token_check.check_token_ids(small, make_dataset(small), 256)
    assert not os.path.exists(token_check.stamp_path(small))


def test_negative_ids_in_a_signed_dataset_are_refused(tmp_path: Path) -> None:
    prefix = write_docs(str(tmp_path / "s"), [[1, -3, 2]] * 20, dtype=np.int32)
    with pytest.raises(DataError, match=r"s\.bin: token id -3 is negative"):
        token_check.check_token_ids(prefix, make_dataset(prefix), 100)


def test_dataset_without_documents_is_one_line_naming_it(tmp_path: Path) -> None:
    prefix = write_docs(str(tmp_path / "empty"), [])
    with pytest.raises(DataError, match=f"{prefix}: the dataset has no documents"):
        build_train_valid_test_datasets(data_config(prefix, split="100,0,0"))
    with pytest.raises(DataError, match=f"{prefix}: the dataset has no documents"):
        build_train_valid_test_datasets(
            DataConfig(seq_length=4, train_batch_size=2, micro_batch_size=2, train_iters=3, train_data_paths=[prefix])
        )


def test_empty_split_warns_for_validation_and_fails_for_training(tmp_path: Path, caplog) -> None:
    prefix = write_docs(str(tmp_path / "few"), [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 10)
    with caplog.at_level(logging.WARNING):
        train, valid, test = build_train_valid_test_datasets(data_config(prefix, split="99,1,0"))
    assert train is not None and valid is None and test is None
    warned = [r.getMessage() for r in caplog.records if "leaves the valid range" in r.getMessage()]
    assert len(warned) == 1 and "split '99,1,0'" in warned[0] and prefix in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a zero share is intended: no warning
        assert build_train_valid_test_datasets(data_config(prefix, split="100,0,0"))[1] is None
    assert not [r for r in caplog.records if "leaves the" in r.getMessage()]
    with pytest.raises(DataError, match=r"split '1,99,0' leaves the train range .* empty"):
        build_train_valid_test_datasets(data_config(prefix, split="1,99,0"))


def corpus(tmp_path: Path, n: int = 40) -> str:
    return write_docs(str(tmp_path / "c_text_document"), [list(range(1 + d, 9 + d)) for d in range(n)])


def maps_of(prefix: str, name: str, split: str, caplog) -> tuple[GPT2Dataset, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ds = build_train_valid_test_datasets(data_config(prefix, split=split))[("train", "valid").index(name)]
    return ds, [r.getMessage() for r in caplog.records if f"rebuilding the {name} index maps" in r.getMessage()]


def test_index_map_cache_of_another_split_is_rebuilt_not_reused(tmp_path: Path, caplog) -> None:
    prefix = corpus(tmp_path)
    first, logs = maps_of(prefix, "valid", "50,50,0", caplog)  # valid = documents 20..39
    assert logs == [] and int(first.doc_idx.min()) >= 20
    # Same cache file names (split name, samples, seq, seed), other document range: GPT-NeoX would reuse them.
    second, logs = maps_of(prefix, "valid", "75,25,0", caplog)  # valid = documents 30..39
    assert int(second.doc_idx.min()) >= 30 and int(second.doc_idx.max()) <= 39
    assert len(logs) == 1 and "built for other inputs (documents [20, 39, 20, " in logs[0]
    again, logs = maps_of(prefix, "valid", "75,25,0", caplog)  # now up to date: reused without a word
    assert logs == [] and np.array_equal(again.doc_idx, second.doc_idx)


def test_stale_unstamped_and_corrupt_caches_are_rebuilt(tmp_path: Path, caplog) -> None:
    prefix = corpus(tmp_path)
    ds, _ = maps_of(prefix, "train", "100,0,0", caplog)
    expected = [ds[i]["text"].copy() for i in range(len(ds))]
    paths = index_map_paths(prefix, "train", IndexMapParams(6, 4, 1234, "packed", True))
    stamp = index_map_cache.stamp_path(paths)
    assert stamp.endswith("_train_indexmap_6ns_4sl_1234s_packedpi_ac_stamp.json") and os.path.isfile(stamp)
    # Corrupt: garbage in a map file.
    Path(paths["sample_idx"]).write_bytes(b"\x93NUMPY garbage")
    ds, logs = maps_of(prefix, "train", "100,0,0", caplog)
    assert len(logs) == 1 and "unreadable" in logs[0]
    assert all(np.array_equal(ds[i]["text"], expected[i]) for i in range(len(ds)))
    # Unstamped (e.g. written by GPT-NeoX, or an interrupted build): rebuilt, identical maps.
    os.remove(stamp)
    ds, logs = maps_of(prefix, "train", "100,0,0", caplog)
    assert len(logs) == 1 and "no stamp" in logs[0]
    assert all(np.array_equal(ds[i]["text"], expected[i]) for i in range(len(ds)))
    # Stale: the data was preprocessed again with other documents (sizes change, the old maps would read past
    # the new documents' ends).
    write_docs(prefix, [[5, 6]] * 40)
    ds, logs = maps_of(prefix, "train", "100,0,0", caplog)
    assert len(logs) == 1 and "data" in logs[0]
    assert all(set(ds[i]["text"].tolist()) <= {5, 6} for i in range(len(ds)))


def test_cached_maps_with_ids_outside_the_split_are_refused_even_with_a_matching_stamp(tmp_path: Path, caplog) -> None:
    prefix = corpus(tmp_path)
    ds, _ = maps_of(prefix, "valid", "50,50,0", caplog)
    paths = index_map_paths(
        prefix, "valid", IndexMapParams(4, 4, 1234, "packed", True)
    )  # valid: (3 // 3 + 1) * 1 * 2 samples
    np.save(paths["doc_idx"], np.zeros_like(np.asarray(ds.doc_idx)))  # every sample from training document 0
    ds, logs = maps_of(prefix, "valid", "50,50,0", caplog)
    assert len(logs) == 1 and "outside this split's 20..39" in logs[0]
    assert int(ds.doc_idx.min()) >= 20


def test_legacy_cached_index_gets_the_same_structural_check(tmp_path: Path) -> None:
    from megatron.data.legacy_indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "legacy")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    for doc in DOCS:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    assert len(make_dataset(prefix, "cached")) == 3
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    n = 3
    data_offsets_at = 56 + 8 * (n + 1)  # header, then dim_offsets[n + 1], then data_offsets[n + 1]
    raw[data_offsets_at + 8 : data_offsets_at + 16] = struct.pack("<q", 0)  # document 1 starts where 0 does
    Path(prefix + ".idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"legacy\.idx: document 1 starts at byte 0 of the \.bin"):
        make_dataset(prefix, "cached")
