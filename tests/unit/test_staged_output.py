"""Datasets appear all-or-nothing: renamed into place on success, partial files removed on any error."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.legacy_indexed_dataset import IndexedDatasetBuilder
from megatron.data.staged_output import staged_builders


def _files(folder: object) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(str(folder)).iterdir()}


def _make(name: str, path: str) -> object:
    return IndexedDatasetBuilder(path) if name == "legacy" else MMapIndexedDatasetBuilder(path, dtype=np.int32)


def test_success_renames_every_pair(tmp_path: object) -> None:
    prefixes = {"a": f"{tmp_path}/a", "legacy": f"{tmp_path}/b"}
    with staged_builders(prefixes, _make) as builders:
        for b in builders.values():
            b.add_item(np.array([1, 2, 3]))
            b.end_document()
        assert sorted(os.listdir(tmp_path)) == ["a.bin.partial", "b.bin.partial"]
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]
    assert MMapIndexedDataset(prefixes["a"])[0].tolist() == [1, 2, 3]


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_error_leaves_existing_dataset_untouched_and_no_partial_files(tmp_path: object, error: type) -> None:
    prefix = f"{tmp_path}/d"
    with staged_builders({"d": prefix}, _make) as builders:
        builders["d"].add_item(np.array([7]))
        builders["d"].end_document()
    before = _files(tmp_path)
    with pytest.raises(error), staged_builders({"d": prefix, "legacy": f"{tmp_path}/e"}, _make) as builders:
        builders["d"].add_item(np.array([9, 9]))
        raise error("boom")
    assert _files(tmp_path) == before
