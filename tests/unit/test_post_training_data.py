"""AlignedDocumentsDataset: one document per sample from streams aligned by index; padding, chopping, mismatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path, make_dataset
from megatron.post_training.data import AlignedDocumentsDataset


def _write(prefix: Path, docs: list[list[float]], dtype: type = np.int32) -> object:
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        b.add_item(np.asarray(d))
        b.end_document()
    b.finalize(index_file_path(str(prefix)))
    return make_dataset(str(prefix), "mmap")


def test_samples_are_whole_documents_padded_and_aligned(tmp_path: Path) -> None:
    pos = _write(tmp_path / "p", [[1, 2, 3], [4, 5, 6, 7, 8, 9]])
    lab = _write(tmp_path / "pl", [[-100, 2, 3], [-100, -100, 6, 7, 8, 9]])
    neg = _write(tmp_path / "n", [[11, 12], [13]])
    streams = {"pos": pos, "pos_label": lab, "neg": neg, "neg_label": neg}
    ds = AlignedDocumentsDataset(streams, {"pos": "p", "pos_label": "pl", "neg": "n"}, 4, seq_length=3, seed=1)
    assert len(ds) == 4 and sorted(ds.order.tolist()) == [0, 0, 1, 1]  # the 2 documents twice, shuffled once
    by_doc = {int(ds.order[i]): ds[i] for i in range(2)}
    assert by_doc[0]["pos"].tolist() == [1, 2, 3, 0] and by_doc[0]["pos_label"].tolist() == [-100, 2, 3, -100]
    assert by_doc[0]["neg"].tolist() == [11, 12, 0, 0] and by_doc[1]["pos"].tolist() == [4, 5, 6, 7]  # cut
    # no label stream: the tokens are the labels and the padding is not trained (GPT-NeoX trains on it)
    assert by_doc[0]["neg_label"].tolist() == [11, 12, -100, -100]
    short = AlignedDocumentsDataset(streams, {"pos": "p", "neg": "n"}, 2, seq_length=3, seed=1, allow_chopped=False)
    assert short.order.tolist() == [0, 0]  # the 6-token document does not fit seq_length + 1


def test_mismatched_streams_are_refused_naming_the_files(tmp_path: Path) -> None:
    pos = _write(tmp_path / "p", [[1, 2], [3]])
    with pytest.raises(ValueError, match=r"n has 1 documents but p has 2"):
        AlignedDocumentsDataset({"pos": pos, "neg": _write(tmp_path / "n", [[1]])}, {"pos": "p", "neg": "n"}, 2, 4, 1)
    bad_label = _write(tmp_path / "pl", [[1], [3]])
    with pytest.raises(ValueError, match=r"pl does not match p token for token"):
        AlignedDocumentsDataset({"pos": pos, "pos_label": bad_label}, {"pos": "p", "pos_label": "pl"}, 2, 4, 1)


def test_precomputed_reference_streams_are_float_aligned_and_checked(tmp_path: Path) -> None:
    """A ``pos_ref`` stream (``text_gen_type: precompute`` output) is read as float32, padded with 0; one with
    another document count, or too few values for the tokens it must score, is refused naming the file."""
    from megatron.errors import DataError

    pos = _write(tmp_path / "p", [[1, 2, 3, 4], [5, 6]])
    ref = _write(tmp_path / "p_ref", [[-0.5, -1.5, -2.5], [-3.5, 0.0, 0.0]], dtype=np.float32)
    prefixes = {"pos": "p", "pos_ref": "p_ref"}
    ds = AlignedDocumentsDataset({"pos": pos, "pos_ref": ref}, prefixes, 2, seq_length=3, seed=1)
    sample = next(ds[i] for i in range(2) if int(ds.order[i]) == 0)
    assert sample["pos_ref"].dtype == np.float32 and sample["pos_ref"].tolist() == [-0.5, -1.5, -2.5, 0.0]
    with pytest.raises(ValueError, match=r"p_ref has 1 documents but p has 2"):
        AlignedDocumentsDataset(
            {"pos": pos, "pos_ref": _write(tmp_path / "r1", [[0.0]], np.float32)}, prefixes, 2, 3, 1
        )
    short = _write(tmp_path / "p_short", [[-0.5, -1.5], [-3.5]], dtype=np.float32)  # written with seq_length 2
    with pytest.raises(DataError, match=r"p_short: document 0 has 2 reference log-probs but p scores 3 tokens"):
        AlignedDocumentsDataset({"pos": pos, "pos_ref": short}, {**prefixes, "pos_ref": "p_short"}, 2, 3, 1)


def test_documents_without_trained_labels_are_skipped(tmp_path: Path) -> None:
    """A document whose first ``seq_length`` labels are all -100 trains nothing: skipped, as GPT-NeoX does; when no
    document is left the error names the data (GPT-NeoX loops forever)."""
    text = _write(tmp_path / "t", [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    label = _write(tmp_path / "l", [[-100, 2, 3], [-100, -100, -100], [-100, -100, 9]])
    reward = _write(tmp_path / "r", [[1], [-1], [2]])  # one value per document (GPT-NeoX's chat-template tool)
    streams = {"text": text, "label": label, "reward": reward}
    ds = AlignedDocumentsDataset(streams, {"text": "t", "label": "l", "reward": "r"}, 6, seq_length=3, seed=2)
    assert sorted(ds.order.tolist()) == [0, 0, 0, 2, 2, 2]
    sample = ds[next(i for i in range(6) if int(ds.order[i]) == 2)]
    assert sample["reward"].tolist() == [2.0, 2.0, 2.0, 0.0]  # the document's reward on its positions
    with pytest.raises(ValueError, match=r"^t: no document has a trained label"):
        AlignedDocumentsDataset(
            {"text": text, "label": _write(tmp_path / "l0", [[-100] * 3] * 3)}, {"text": "t", "label": "l0"}, 2, 3, 1
        )


def test_trained_label_check_is_the_same_vectorised_and_per_document(tmp_path: Path) -> None:
    from megatron.post_training.data import _any_label_in_window

    rng = np.random.RandomState(0)
    docs = [[-100] * int(rng.randint(0, 5)) + [7] * int(rng.randint(0, 3)) for _ in range(40)]
    ds = _write(tmp_path / "l", docs)
    for window in (1, 2, 4, 9):
        want = [any(v != -100 for v in d[:window]) for d in docs]
        assert _any_label_in_window(ds, len(docs), window, chunk=7).tolist() == want


def test_data_without_label_streams_trains_the_document() -> None:
    """Pairwise and KTO data without label streams: each text stream doubles as its labels (GPT-NeoX's unpacked
    index builder crashes on such data)."""
    from megatron.post_training.data import _with_default_labels

    assert _with_default_labels({"text": "T", "reward": "R"}) == {"text": "T", "reward": "R", "label": "T"}
    assert _with_default_labels({"pos": "P", "neg": "N", "pos_label": "PL", "neg_label": "NL"})["pos_label"] == "PL"
    assert _with_default_labels({"pos": "P", "neg": "N"}) == {
        "pos": "P",
        "neg": "N",
        "pos_label": "P",
        "neg_label": "N",
    }
