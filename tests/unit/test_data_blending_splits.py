"""Blending, split strings, weighting by documents, non-packed sampling and label datasets (reference §5.2–5.3)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron.data import index_maps
from megatron.data.blendable_dataset import BlendableDataset, weights_by_num_documents
from megatron.data.data_utils import parse_split, split_boundaries, weighted_num_samples
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.index_map_params import IndexMapParams
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset


def reference_blending(weights, size):
    """Specified rule: sample k goes to argmax_d of w_d * max(k, 1) - count_d (first on ties)."""
    counts = [0] * len(weights)
    index, sample = [], []
    for k in range(size):
        errors = [w * max(k, 1) - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        index.append(d)
        sample.append(counts[d])
        counts[d] += 1
    return index, sample


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.2, 0.3, 0.5], [0.7, 0.1, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3]])
def test_blending_indices_match_greedy_rule(weights):
    w = np.array(weights) / np.sum(weights)
    index, sample = index_maps.build_blending_indices(w, 500)
    ref_index, ref_sample = reference_blending(list(w), 500)
    assert index.dtype == np.uint8 and sample.dtype == np.int64
    assert index.tolist() == ref_index
    assert sample.tolist() == ref_sample
    shares = np.bincount(index, minlength=len(w)) / 500
    np.testing.assert_allclose(shares, w, atol=0.01)


class Constant:
    """A dataset whose sample i is (tag, i)."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return (self.tag, i)


def test_blendable_dataset_size_and_lookup():
    ds = BlendableDataset([Constant(0, 30), Constant(1, 10)], [3, 1])
    assert len(ds) == 40
    ref_index, ref_sample = reference_blending([0.75, 0.25], 40)
    assert [ds[k] for k in range(40)] == list(zip(ref_index, ref_sample))
    assert ds[41] == ds[1]
    with pytest.raises(ValueError, match="weights"):
        BlendableDataset([Constant(0, 3)], [0])


def test_weight_by_num_documents_formula():
    n = [100, 10, 1]
    alpha = 0.3
    share = np.array(n) / 111
    p = share**alpha / np.sum(share**alpha)
    w = p * (1 - share)
    np.testing.assert_allclose(weights_by_num_documents(n, alpha), w / w.sum())
    assert weights_by_num_documents([5]) == [1.0]


@pytest.mark.parametrize(
    "split, size, expected",
    [
        ("949,50,1", 1000, [0, 949, 999, 1000]),
        ("969, 30, 1", 1000, [0, 969, 999, 1000]),
        ("98/2/0", 50, [0, 49, 50, 50]),
        ("1", 7, [0, 7, 7, 7]),
        ("1,1,1", 10, [0, 4, 7, 10]),  # 3+3+3 rounds to 9: every boundary shifts by 1
        ("2,1", 5, [0, 3, 5, 5]),
    ],
)
def test_split_boundaries(split, size, expected):
    assert split_boundaries(split, size) == expected


def test_split_errors_and_weighted_counts():
    with pytest.raises(ValueError, match="split"):
        parse_split("a,b")
    with pytest.raises(ValueError, match="positive sum"):
        parse_split("0,0,0")
    weights, counts = weighted_num_samples([2, 1, 1], 1000)
    assert weights == [0.5, 0.25, 0.25]
    assert counts == [math.ceil(1000 * 0.5 * 1.005), math.ceil(1000 * 0.25 * 1.005), math.ceil(1000 * 0.25 * 1.005)]


def corpus(tmp_path, sizes, name="c", labels=None):
    prefix = str(tmp_path / name)
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d, n in enumerate(sizes):
        doc = (1 + d * 100 + np.arange(n)) if labels is None else labels[d]
        b.add_item(np.asarray(doc))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix, make_dataset(prefix)


def test_unpacked_one_document_per_sample_with_padding_and_chopping(tmp_path):
    sizes = [3, 12, 5, 2, 4]
    prefix, indexed = corpus(tmp_path, sizes)
    seq = 6
    ds = GPT2Dataset("train", prefix, np.arange(5), indexed, IndexMapParams(8, seq, 3, "unpacked", allow_chopped=False))
    rng = np.random.RandomState(3)
    shuffle = np.arange(8)
    rng.shuffle(shuffle)
    usable = [0, 2, 3, 4]  # document 1 (12 tokens > seq + 1) is skipped without allow_chopped
    expected_docs = [usable[i % 4] for i in range(9)]
    assert ds.doc_idx.tolist() == expected_docs
    np.testing.assert_array_equal(ds.shuffle_idx, shuffle)
    assert len(ds) == 7
    for i in range(len(ds)):
        doc = expected_docs[shuffle[i]]
        text = ds[i]["text"]
        assert text[: sizes[doc]].tolist() == (1 + doc * 100 + np.arange(sizes[doc])).tolist()
        assert (text[sizes[doc] :] == 0).all()
    chopped = GPT2Dataset("train", prefix, np.arange(5), indexed, IndexMapParams(8, seq, 3, "unpacked"))
    assert 1 in chopped.doc_idx.tolist()
    long_sample = next(chopped[i]["text"] for i in range(len(chopped)) if chopped[i]["text"][0] == 101)
    assert long_sample.tolist() == list(range(101, 108))  # truncated to seq + 1


def test_pack_until_overflow_never_splits_documents(tmp_path):
    sizes = [3, 4, 2, 5, 1, 6]
    prefix, indexed = corpus(tmp_path, sizes)
    seq = 7
    ds = GPT2Dataset("train", prefix, np.arange(6), indexed, IndexMapParams(10, seq, 11, "pack_until_overflow"))
    starts = ds.sample_idx[:, 0]
    assert len(starts) == 11
    for k in range(10):
        members = [int(ds.doc_idx[i]) for i in range(starts[k], starts[k + 1])]
        assert members, "every sample holds at least one document"
        total = sum(sizes[d] for d in members)
        assert total <= seq + 1 or len(members) == 1
        if k + 1 < 10:  # adding the next sample's first document would have overflowed
            assert total + sizes[int(ds.doc_idx[starts[k + 1]])] > seq + 1
    for i in range(len(ds)):
        k = int(ds.shuffle_idx[i])
        members = [int(ds.doc_idx[j]) for j in range(starts[k], starts[k + 1])]
        expected = np.concatenate([1 + d * 100 + np.arange(sizes[d]) for d in members])[: seq + 1]
        text = ds[i]["text"]
        assert text[: len(expected)].tolist() == expected.tolist()
        assert (text[len(expected) :] == 0).all()


def test_label_dataset_is_aligned_and_padded_with_minus_100(tmp_path):
    sizes = [4, 3, 5]
    prefix, indexed = corpus(tmp_path, sizes)
    labels = [[-100, -100, 7, 8], [-100, -100, -100], [1, 2, 3, -100, 5]]
    _, label_ds = corpus(tmp_path, sizes, name="labels", labels=labels)
    packed = GPT2Dataset("train", prefix, np.arange(3), indexed, IndexMapParams(3, 4, 5), label_dataset=label_ds)
    for i in range(len(packed)):
        s = packed[i]
        text, label = s["text"], s["label"]
        assert text.shape == label.shape == (5,)
        # label value at each position belongs to the same (document, offset) as the text token there
        for t, lab in zip(text, label):
            d, k = divmod(int(t) - 1, 100)
            assert lab == labels[d][k]
    unpacked = GPT2Dataset(
        "train", prefix, np.arange(3), indexed, IndexMapParams(4, 6, 5, "unpacked"), label_dataset=label_ds
    )
    assert 1 not in unpacked.doc_idx.tolist()  # all of document 1's labels are -100
    sample = next(unpacked[i] for i in range(len(unpacked)) if unpacked[i]["text"][0] == 1)
    assert sample["label"].tolist() == [-100, -100, 7, 8, -100, -100, -100]
    assert sample["text"].tolist() == [1, 2, 3, 4, 0, 0, 0]
