"""Sample order equals GPT-NeoX's algorithm, written here from the specification (reference §5.2):

* ``num_epochs`` = smallest e with ``(e*T - 1) // seq_length >= num_samples``;
* ``doc_idx`` = documents tiled over all epochs, shuffled once as a whole by ``RandomState(seed)``;
* sample ``i`` (before shuffling) = tokens ``[i*seq_length, (i+1)*seq_length]`` of the documents concatenated in
  ``doc_idx`` order, so consecutive samples share one token;
* ``shuffle_idx`` = permutation of ``arange(rows - 1)`` drawn next from the same rng.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import index_maps
from megatron.data.gpt2_dataset import GPT2Dataset, index_map_paths
from megatron.data.index_map_params import IndexMapParams
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset


def reference_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """The sample-index loop as specified: walk documents, each sample takes seq_length + 1 tokens, the next one
    starts on the last token of the previous."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rows = [(0, 0)]
    d, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d += 1
                offset = 0
        rows.append((d, offset))
    return np.array(rows)


def make_corpus(tmp_path, sizes) -> tuple[str, list[np.ndarray]]:
    """Documents whose tokens are all distinct (document d, position k -> 1 + d*64 + k)."""
    prefix = str(tmp_path / "corpus_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = []
    for d, n in enumerate(sizes):
        doc = 1 + d * 64 + np.arange(n)
        docs.append(doc)
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, docs


@pytest.mark.parametrize("seq_length", [1, 3, 7, 16])
def test_sample_idx_matches_specified_loop_including_empty_documents(seq_length):
    rng = np.random.RandomState(0)
    sizes = rng.randint(0, 12, size=40).astype(np.int32)
    sizes[[0, 5, 6]] = 0  # empty documents are stepped over
    documents = np.arange(40)
    tokens = index_maps.num_tokens(documents, sizes)
    epochs = 3
    doc_idx = index_maps.build_doc_idx(documents, epochs, np.random.RandomState(7))
    ours = index_maps.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    ref = reference_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    assert ours.dtype == np.int32
    assert ours.shape == ref.shape == ((epochs * tokens - 1) // seq_length + 1, 2)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("num_samples", [0, 1, 10, 57, 58, 200])
def test_num_epochs_closed_form(num_samples):
    for tokens in (1, 5, 58, 97):
        for seq in (1, 4, 16):
            assert index_maps.num_epochs_for(tokens, seq, num_samples) == reference_num_epochs(tokens, seq, num_samples)


def test_gpt2_dataset_samples_follow_the_specification(tmp_path):
    sizes = [5, 1, 9, 3, 12, 2, 7, 4, 8, 6]
    prefix, docs = make_corpus(tmp_path, sizes)
    indexed = make_dataset(prefix, "mmap")
    seq_length, seed, num_samples = 8, 1234, 20
    documents = np.arange(2, 10, dtype=np.int32)  # a split that does not start at 0
    ds = GPT2Dataset("train", prefix, documents, indexed, IndexMapParams(num_samples, seq_length, seed))

    tokens_per_epoch = sum(sizes[2:])  # 51
    epochs = reference_num_epochs(tokens_per_epoch, seq_length, num_samples)
    assert epochs == 4  # 3 epochs give (153-1)//8 = 19 < 20 samples
    rng = np.random.RandomState(seed)
    expected_doc_idx = np.array(list(documents) * epochs, dtype=np.int32)
    rng.shuffle(expected_doc_idx)  # one shuffle across all epochs
    np.testing.assert_array_equal(ds.doc_idx, expected_doc_idx)
    assert ds.doc_idx.dtype == np.int32
    rows = (epochs * tokens_per_epoch - 1) // seq_length + 1
    expected_shuffle = np.arange(rows - 1, dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    np.testing.assert_array_equal(ds.shuffle_idx, expected_shuffle)
    assert ds.shuffle_idx.dtype == np.uint32
    assert len(ds) == min(len(expected_shuffle) - 1, rows - 1)

    stream = np.concatenate([docs[d] for d in expected_doc_idx])
    windows = [stream[i * seq_length : (i + 1) * seq_length + 1] for i in range(rows - 1)]
    for i in range(len(ds)):
        sample = ds[i]["text"]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(sample, windows[expected_shuffle[i]])
    # Consecutive windows overlap by exactly one token.
    for i in range(len(windows) - 1):
        assert windows[i][-1] == windows[i + 1][0]
    # Past the end, indices wrap around (GPT-NeoX's IndexError fallback).
    np.testing.assert_array_equal(ds[len(ds) + 3]["text"], ds[3]["text"])


def test_index_maps_are_cached_under_gpt_neox_names(tmp_path):
    prefix, _ = make_corpus(tmp_path, [4, 6, 8, 3])
    indexed = make_dataset(prefix)
    ds = GPT2Dataset("valid", prefix, np.arange(4), indexed, IndexMapParams(5, 4, 42))
    paths = index_map_paths(prefix, "valid", IndexMapParams(5, 4, 42, "packed", True))
    assert paths["doc_idx"] == f"{prefix}_valid_indexmap_5ns_4sl_42s_packedpi_ac_doc_idx.npy"
    for path in paths.values():
        assert os.path.isfile(path)
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]
    # A second dataset loads the cache (same samples); an edited cache file is used as is, i.e. really loaded.
    before = [ds[i]["text"].copy() for i in range(len(ds))]
    again = GPT2Dataset("valid", prefix, np.arange(4), indexed, IndexMapParams(5, 4, 42))
    assert all(np.array_equal(again[i]["text"], before[i]) for i in range(len(ds)))
    first_window = before[int(np.argmin(ds.shuffle_idx))]  # the unshuffled window 0
    np.save(paths["shuffle_idx"], np.zeros(len(ds.shuffle_idx), dtype=np.uint32))
    cached = GPT2Dataset("valid", prefix, np.arange(4), indexed, IndexMapParams(5, 4, 42))
    for i in range(len(cached)):
        np.testing.assert_array_equal(cached[i]["text"], first_window)
    no_ac = index_map_paths(prefix, "valid", IndexMapParams(5, 4, 42, "unpacked", False))
    assert no_ac["sample_idx"].endswith("_valid_indexmap_5ns_4sl_42s_unpackedpi_sample_idx.npy")


def test_index_map_build_needs_no_torch_distributed(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    prefix, _ = make_corpus(tmp_path, [3, 3, 3])
    ds = GPT2Dataset("train", prefix, np.arange(3), make_dataset(prefix), IndexMapParams(2, 2, 1))
    assert len(ds) >= 2
