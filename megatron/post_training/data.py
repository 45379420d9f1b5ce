"""Post-training datasets: several streams (text, labels, rewards, chosen/rejected) aligned by document index.

One document per sample (``pack_impl: unpacked``): sample ``i`` reads document ``order[i]`` from every stream,
cut or padded to ``seq_length + 1`` (tokens padded with 0, labels with -100, rewards with 0). The order is GPT-NeoX's
(golden-tested): the kept documents are laid out in order, repeated cyclically to ``num_samples``, and shuffled once
with ``RandomState(seed)``. Kept are the documents with a label other than -100 among their first ``seq_length``
labels (GPT-NeoX's check) and, with ``allow_chopped: false``, no longer than ``seq_length + 1`` in any stream.
Streams:

* pairwise (DPO/RM): ``pos``, ``neg``, ``pos_label``, ``neg_label`` (a missing label stream trains every token of
  the document, not its padding);
* KTO: ``text``, ``label`` (missing: every token of the document), ``reward``: the document's reward is the first value of its reward document (GPT-NeoX's
  chat-template tool writes one int32 value per document, ours one float32 per token; both are read) and fills the
  document's positions of the sample's reward row (0 on padding);
* with ``precompute_model_name`` (DPO/KTO): ``pos_ref``/``neg_ref`` or ``ref``, the reference model's per-token
  log-probs that ``text_gen_type: precompute`` wrote to ``<prefix>_<precompute_model_name>`` (float32, value ``t``
  = log p(token ``t+1``); padded with 0).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.data_utils import SPLIT_NAMES, DataConfig, make_data_loader, open_dataset, weighted_num_samples
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError
from megatron.post_training.config import PostTrainingConfig

logger = logging.getLogger(__name__)

PADS = {"pos": 0, "neg": 0, "text": 0, "pos_label": -100, "neg_label": -100, "label": -100, "reward": 0.0}
PADS.update(dict.fromkeys(("pos_ref", "neg_ref", "ref"), 0.0))
FLOAT_STREAMS = ("reward", "pos_ref", "neg_ref", "ref")
# the stream whose documents a precomputed reference stream scores
REFERENCE_OF = {"pos_ref": "pos", "neg_ref": "neg", "ref": "text"}


class AlignedDocumentsDataset(torch.utils.data.Dataset):
    """Samples ``{stream: array[seq_length + 1]}``; every stream holds the same number of documents."""

    def __init__(
        self, streams: dict[str, Any], prefixes: dict[str, str], num_samples: int, seq_length: int, seed: int,
        allow_chopped: bool = True,
    ) -> None:  # fmt: skip
        self.streams, self.seq_length = streams, seq_length
        first = next(iter(streams))
        n = len(streams[first].sizes)
        for name, ds in streams.items():
            if len(ds.sizes) != n:
                raise ValueError(
                    f"{prefixes[name]} has {len(ds.sizes)} documents but {prefixes[first]} has {n}: the streams of "
                    "one dataset must be aligned document by document"
                )
        if "reward" in streams and np.any(np.asarray(streams["reward"].sizes) == 0):
            empty = int(np.flatnonzero(np.asarray(streams["reward"].sizes) == 0)[0])
            raise DataError(f"{prefixes['reward']}: document {empty} has no reward value (one per document needed)")
        for name, base in (("pos_label", "pos"), ("neg_label", "neg"), ("label", "text"), ("reward", "text")):
            if name == "reward" and name in streams and np.all(np.asarray(streams[name].sizes) == 1):
                continue  # one reward per document (GPT-NeoX's chat-template tool)
            if name in streams and base in streams and not np.array_equal(streams[name].sizes, streams[base].sizes):
                raise ValueError(
                    f"{prefixes.get(name, prefixes[base])} does not match {prefixes[base]} token for token (document "
                    "lengths differ): label and reward streams must come from the same preprocessing run"
                )
        for ref, base in REFERENCE_OF.items():
            if ref in streams and base in streams:
                needed = np.minimum(np.asarray(streams[base].sizes) - 1, seq_length)
                short = np.flatnonzero(np.asarray(streams[ref].sizes) < needed)
                if len(short):
                    raise DataError(
                        f"{prefixes[ref]}: document {int(short[0])} has {int(streams[ref].sizes[short[0]])} reference "
                        f"log-probs but {prefixes[base]} scores {int(needed[short[0]])} tokens there (written with "
                        f"another seq_length than this run's {seq_length}?); precompute them again with this config"
                    )
        keep = np.flatnonzero(self._has_trained_label(n))
        if len(keep) < n:
            logger.info("%s: %d of %d documents without a trained label skipped", prefixes[first], n - len(keep), n)
        if not allow_chopped:
            longest = np.max(np.stack([np.asarray(ds.sizes) for ds in streams.values()]), axis=0)
            fits = keep[longest[keep] <= seq_length + 1]
            if len(fits) < len(keep):
                logger.info(
                    "%s: %d of %d documents longer than seq_length+1 dropped", prefixes[first], len(keep) - len(fits), n
                )
            keep = fits
        if len(keep) == 0:
            raise ValueError(
                f"{prefixes[first]}: no document has a trained label (a label other than -100 in its first "
                f"seq_length={seq_length})" + ("" if allow_chopped else f" and fits seq_length+1={seq_length + 1}")
            )
        # one shuffle over all epochs: the kept documents repeated in order, permuted once
        self.order = keep[np.random.RandomState(seed).permutation(num_samples) % len(keep)]

    def _has_trained_label(self, n: int) -> np.ndarray:
        """Per document: whether a label stream has a value other than -100 among its first ``seq_length``
        (GPT-NeoX skips the others: they would train nothing)."""
        ok = np.ones(n, dtype=bool)
        for name, text in (("label", "text"), ("pos_label", "pos"), ("neg_label", "neg")):
            ds = self.streams.get(name)
            if ds is not None and ds is not self.streams.get(text):  # a text stream as labels has no -100
                ok &= _any_label_in_window(ds, n, self.seq_length)
        return ok

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        doc = int(self.order[idx % len(self.order)])
        out = {}
        for name, ds in self.streams.items():
            pad = PADS[name]
            arr = np.full(self.seq_length + 1, pad, dtype=np.float32 if name in FLOAT_STREAMS else np.int64)
            values = ds.get(doc)[: self.seq_length + 1]
            if name == "reward":  # the document's reward on each of its positions
                base = self.streams.get("text", ds)
                values = np.full(min(int(base.sizes[doc]), self.seq_length + 1), values[0], dtype=np.float32)
            arr[: len(values)] = values
            out[name] = arr
        return out


TOKEN_STREAMS = ("pos", "neg", "text")


def _any_label_in_window(ds: Any, n: int, window: int, chunk: int = 1 << 16) -> np.ndarray:
    """Per document of a label stream: any value other than -100 among its first ``window`` (vectorised over
    contiguous slices of ``.bin`` where the dataset supports them, one document at a time otherwise)."""
    if not isinstance(ds, MMapIndexedDataset):
        return np.array([bool(np.any(ds.get(i)[:window] != -100)) for i in range(n)], dtype=bool)
    out = np.zeros(n, dtype=bool)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        sizes = np.asarray(ds.sizes[start:stop], dtype=np.int64)
        docs = ds[start:stop]
        if not sizes.sum():
            continue
        flat = np.concatenate(docs)
        doc_of = np.repeat(np.arange(stop - start), sizes)
        position = np.arange(len(flat)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        trained = (position < window) & (flat != -100)
        out[start:stop] = np.bincount(doc_of[trained], minlength=stop - start) > 0
    return out


def _stream_prefixes(pt: PostTrainingConfig, data: DataConfig, split: str) -> list[dict[str, str]]:
    """One ``{stream: prefix}`` per dataset of the split (empty when the split has no data)."""
    if pt.pairwise:
        names = ("pos", "neg", "pos_label", "neg_label")
        lists = {s: pt.paths(split, s) for s in names}
        if not lists["pos"]:
            return []
        out = []
        for i, (pos, neg) in enumerate(zip(lists["pos"], lists["neg"] or [])):
            one = {"pos": pos, "neg": neg}
            for s in ("pos_label", "neg_label"):
                label_paths = lists[s]
                if label_paths:
                    one[s] = label_paths[i]
            out.append(one)
        return out
    texts = getattr(data, f"{split}_data_paths") or []
    labels: list[str | None] = getattr(data, f"{split}_label_data_paths") or [None] * len(texts)
    reward_paths = pt.paths(split, "reward")
    rewards: list[str | None] = [*reward_paths] if reward_paths else [None] * len(texts)
    if texts and not reward_paths:
        raise ValueError(f"train_impl: kto needs {split}_reward_data_paths for {split}_data_paths")
    return [
        {k: v for k, v in (("text", t), ("label", lab), ("reward", r)) if v}
        for t, lab, r in zip(texts, labels, rewards)
    ]


def _with_reference_streams(pt: PostTrainingConfig, groups: list[dict[str, str]]) -> list[dict[str, str]]:
    """Add the precomputed reference log-prob stream of each token stream (``<prefix>_<precompute_model_name>``)."""
    if not pt.reads_precomputed_reference:
        return groups
    for prefixes in groups:
        for ref, base in REFERENCE_OF.items():
            if base in prefixes:
                prefixes[ref] = f"{prefixes[base]}_{pt.precompute_model_name}"
                if not all(os.path.isfile(prefixes[ref] + ext) for ext in (".bin", ".idx")):
                    raise DataError(
                        f"precompute_model_name {pt.precompute_model_name!r}: {prefixes[ref]}.bin/.idx not found (the "
                        f"reference log-probs of {prefixes[base]}); write them first with the same config: python "
                        "deepy.py generate.py <configs> --text_gen_type precompute (or unset precompute_model_name to "
                        "use a frozen copy of the loaded model as the reference)"
                    )
    return groups


def _with_default_labels(streams: dict[str, Any]) -> dict[str, Any]:
    """Data without label streams trains every token of the document (not its padding): each text stream doubles
    as its label stream."""
    for text, label in (("pos", "pos_label"), ("neg", "neg_label"), ("text", "label")):
        if text in streams:
            streams.setdefault(label, streams[text])
    return streams


def build_datasets(pt: PostTrainingConfig, data: DataConfig) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets, ``None`` where a split has no data; several prefixes are blended."""
    counts = data.num_samples()
    result: list[Any] = []
    for k, split in enumerate(SPLIT_NAMES):
        groups = _with_reference_streams(pt, _stream_prefixes(pt, data, split))
        count = counts[k]
        if not groups or not count:
            result.append(None)
            continue
        weights, per_dataset = weighted_num_samples(
            getattr(data, f"{split}_data_weights") or [1.0] * len(groups), count
        )
        datasets = []
        for prefixes, n in zip(groups, per_dataset):
            # token streams are checked like pretraining data (documents, ids within padded_vocab_size)
            streams = {s: open_dataset(data, p, text=s in TOKEN_STREAMS) for s, p in prefixes.items()}
            streams = _with_default_labels(streams)
            datasets.append(
                AlignedDocumentsDataset(streams, prefixes, n, data.seq_length, data.seed, data.allow_chopped)
            )
        result.append(BlendableDataset(datasets, weights))
    return result[0], result[1], result[2]


def builds_own_data(pt: PostTrainingConfig) -> bool:
    """Whether this training reads pairwise, KTO or online (REINFORCE) data, not language-model data."""
    return bool(pt.pairwise) or pt.train_impl == "kto" or pt.dataset_impl == "online"


def build_post_training_loaders(
    pt: PostTrainingConfig, data: DataConfig, *, dp_rank: int, dp_size: int, consumed_train: int, consumed_valid: int
) -> tuple[Any, Any, Any] | None:
    """Loaders for pairwise and KTO data; ``None`` for language-model data (SFT included), built elsewhere."""
    if not builds_own_data(pt):
        return None
    train, valid, test = build_datasets(pt, data)
    if train is None:
        raise ValueError(f"train_impl: {pt.train_impl} has no training data")
    return (
        make_data_loader(train, data, dp_rank, dp_size, consumed_train),
        make_data_loader(valid, data, dp_rank, dp_size, consumed_valid, name="valid"),
        make_data_loader(test, data, dp_rank, dp_size, 0, name="test"),
    )
