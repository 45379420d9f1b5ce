"""Train/valid/test datasets and loaders from GPT-NeoX data keys (``data_path`` + ``split``, or per-split paths).

Sample counts follow GPT-NeoX: train ``train_iters * train_batch_size``; valid
``(train_iters // eval_interval + 1) * eval_iters * train_batch_size``; test ``eval_iters * train_batch_size``.
With several paths per split, dataset ``i`` gets ``ceil(N * w_i * 1.005)`` samples and the datasets are blended.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_overrides, require_keys
from megatron.data.blendable_dataset import BlendableDataset, normalize_weights, weights_by_num_documents
from megatron.data.gpt2_dataset import PACK_IMPLS, GPT2Dataset, is_cache_builder
from megatron.data.index_map_params import IndexMapParams
from megatron.data.indexed_dataset import make_dataset
from megatron.data.samplers import DistributedBatchSampler
from megatron.data.token_check import check_token_ids
from megatron.errors import DataError
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.model import SequenceKeys
from megatron.neox_arguments.sections.other import SeedKeys, VocabKeys
from megatron.neox_arguments.sections.training import DataKeys, DataPathKeys, IterationKeys
from megatron.neox_arguments.value_checks import parse_split

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(kw_only=True)  # micro_batch_size (not a key) has no default
class DataConfig(SequenceKeys, BatchSizeKeys, IterationKeys, SeedKeys, DataPathKeys, DataKeys, VocabKeys):
    """The data keys of a GPT-NeoX config (flat names as in GPT-NeoX YAML)."""

    micro_batch_size: int
    label_data_paths: list[str] | None = None
    weighted_document_limit: int | None = None

    # not config keys: micro_batch_size is train_micro_batch_size_per_gpu; label_data_paths (labels for data_path)
    # and weighted_document_limit are set only by code that builds a DataConfig itself
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("micro_batch_size", "label_data_paths", "weighted_document_limit")

    def __post_init__(self) -> None:
        require_keys(self, ("seq_length", "train_batch_size"))  # required: the schema's default is None

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> DataConfig:
        """Read every field strictly under its NeoX key (``None`` means the default; ``micro_batch_size`` is
        ``train_micro_batch_size_per_gpu``, which the config layer also mirrors into GPT-NeoX's older ``batch_size``)."""
        kwargs: dict[str, Any] = neox_overrides(cls, args)
        kwargs["micro_batch_size"] = args.train_micro_batch_size_per_gpu
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise ValueError naming the key when the data keys are inconsistent."""
        if self.pack_impl not in PACK_IMPLS:
            raise DataError(f"pack_impl {self.pack_impl!r} is not one of {', '.join(PACK_IMPLS)}")
        if self.train_epochs and self.pack_impl != "packed":
            raise DataError("train_epochs needs pack_impl packed")
        if self.train_epochs and (
            self.weight_by_num_documents or any(float(w) != 1.0 for w in self.train_data_weights or [])
        ):
            # GPT-NeoX's rule: an epoch of several datasets is each of them once, which fixes their shares
            raise DataError("train_epochs with several train_data_paths needs train_data_weights unset or all 1.0")
        if self.data_path and self.train_data_paths:
            raise DataError("set either data_path (with split) or train/valid/test_data_paths, not both")
        if not self.data_path and not self.train_data_paths:
            raise DataError("no data: set data_path (with split) or train_data_paths/valid_data_paths/test_data_paths")
        for split in SPLIT_NAMES:
            paths, weights = getattr(self, f"{split}_data_paths"), getattr(self, f"{split}_data_weights")
            if paths and weights and len(paths) != len(weights):
                raise DataError(f"{split}_data_paths has {len(paths)} entries but {split}_data_weights {len(weights)}")
            labels = getattr(self, f"{split}_label_data_paths")
            if labels and (not paths or len(labels) != len(paths)):
                raise DataError(f"{split}_label_data_paths must have one entry per {split}_data_paths entry")

    def num_samples(self) -> tuple[int | None, int | None, int | None]:
        """GPT-NeoX's (train, valid, test) sample counts (all None with ``train_epochs``: one epoch each)."""
        if self.train_epochs or self.train_iters is None:  # validation requires one of them
            return None, None, None
        train = self.train_iters * self.train_batch_size
        valid = (self.train_iters // self.eval_interval + 1) * self.eval_iters * self.train_batch_size
        test = self.eval_iters * self.train_batch_size
        return train, valid, test


def split_boundaries(split: str, size: int) -> list[int]:
    """GPT-NeoX's item boundaries ``[0, a, b, size]`` for a split string over ``size`` items."""
    idx = [0]
    for frac in parse_split(split):
        idx.append(idx[-1] + round(frac * float(size)))
    excess = idx[-1] - size
    return [idx[0]] + [i - excess for i in idx[1:]]


def weighted_num_samples(weights: Sequence[float], num_samples: int) -> tuple[list[float], list[int]]:
    """Normalised weights and ``ceil(num_samples * w * 1.005)`` samples per dataset."""
    w = [float(x) for x in normalize_weights(weights)]
    return w, [math.ceil(num_samples * x * 1.005) for x in w]


def _gpt2(
    cfg: DataConfig, name: str, prefix: str, documents: np.ndarray, indexed: Any, num_samples: int | None, **kw: Any
) -> GPT2Dataset:
    return GPT2Dataset(
        name,
        prefix,
        documents,
        indexed,
        IndexMapParams(
            num_samples,
            cfg.seq_length,
            cfg.seed,
            pack_impl=cfg.pack_impl,
            allow_chopped=cfg.allow_chopped,
            num_epochs=1 if num_samples is None else None,
        ),
        use_shared_fs=cfg.use_shared_fs,
        **kw,
    )


def open_dataset(cfg: DataConfig, prefix: str, barrier: Callable[[], None] | None = None, text: bool = True) -> Any:
    """Open a dataset; a text dataset must hold documents and (with ``padded_vocab_size``) only ids the model
    embeds (label/reward datasets hold -100 or floats and are not checked)."""
    ds = make_dataset(prefix, cfg.data_impl, skip_warmup=not cfg.mmap_warmup)
    if len(ds.sizes) == 0:
        raise DataError(f"{prefix}: the dataset has no documents ({prefix}.idx lists 0); preprocess it again")
    if text and cfg.padded_vocab_size:
        check_token_ids(prefix, ds, cfg.padded_vocab_size, is_cache_builder(cfg.use_shared_fs), barrier or mpu.barrier)
    return ds


def _empty_split(cfg: DataConfig, name: str, size: int, count: int | None) -> None:
    """A split that asked for a share of the documents but got none: an error for train, else one warning."""
    share = parse_split(cfg.split)[SPLIT_NAMES.index(name)]
    if share <= 0 or (count is not None and count <= 0):
        return  # e.g. split 100,0,0 or eval_iters 0: nothing was asked for
    message = (
        f"split {cfg.split!r} leaves the {name} range of data_path {cfg.data_path} empty: {share:.2%} of its {size} "
        "documents rounds to none"
    )
    if name == "train":
        raise DataError(f"{message}; give the train share more weight or use more data")
    logger.warning("%s; no %s evaluation will run (use more documents, a larger share, or a zero share)", message, name)


def _text_and_label_prefixes(cfg: DataConfig) -> tuple[list[str], list[str]]:
    """Every text and every label dataset prefix the run reads."""
    if cfg.data_path:
        return [cfg.data_path], list(cfg.label_data_paths or [])[:1]
    texts: list[str] = []
    labels: list[str] = []
    for split in SPLIT_NAMES:
        texts += getattr(cfg, f"{split}_data_paths") or []
        labels += [p for p in getattr(cfg, f"{split}_label_data_paths") or [] if p]
    return texts, labels


def check_datasets(cfg: DataConfig, barrier: Callable[[], None] | None = None) -> dict[tuple[str, bool], Any]:
    """Open every dataset of the run with the checks :func:`open_dataset` makes (index and ``.bin`` consistency,
    documents present, token ids inside ``padded_vocab_size``), so training refuses bad data before it builds the
    model and engine; returns the opened datasets by ``(prefix, is_text)`` for
    :func:`build_train_valid_test_datasets` to reuse."""
    cfg.validate()
    texts, labels = _text_and_label_prefixes(cfg)
    opened: dict[tuple[str, bool], Any] = {}
    for prefix, text in [(p, True) for p in texts] + [(p, False) for p in labels]:
        if (prefix, text) not in opened:
            opened[prefix, text] = open_dataset(cfg, prefix, barrier, text=text)
    return opened


def build_train_valid_test_datasets(
    cfg: DataConfig, barrier: Callable[[], None] | None = None, opened: dict[tuple[str, bool], Any] | None = None
) -> tuple[Any, Any, Any]:
    """The three datasets (``None`` where a split is empty or has no samples; an empty train split is an error).
    ``opened``: datasets :func:`check_datasets` already opened and checked."""
    cfg.validate()
    counts = cfg.num_samples()
    known = opened or {}

    def open_checked(prefix: str, text: bool = True) -> Any:
        found = known.get((prefix, text))
        return found if found is not None else open_dataset(cfg, prefix, barrier, text=text)

    if cfg.data_path:
        indexed = open_checked(cfg.data_path)
        labels = open_checked(cfg.label_data_paths[0], text=False) if cfg.label_data_paths else None
        bounds = split_boundaries(cfg.split, len(indexed.sizes))
        out: list[Any] = []
        for k, name in enumerate(SPLIT_NAMES):
            lo, hi, count = bounds[k], bounds[k + 1], counts[k]
            if hi <= lo:
                _empty_split(cfg, name, len(indexed.sizes), count)
            if hi <= lo or (count is not None and count <= 0):
                out.append(None)
                continue
            docs = np.arange(lo, hi, dtype=np.int32)
            ds = _gpt2(cfg, name, cfg.data_path, docs, indexed, count, label_dataset=labels, barrier=barrier)
            out.append(ds)
        return out[0], out[1], out[2]
    result: list[Any] = []
    for k, split in enumerate(SPLIT_NAMES):
        paths, count = getattr(cfg, f"{split}_data_paths") or [], counts[k]
        if not paths or (count is not None and count <= 0):
            result.append(None)
            continue
        label_paths = getattr(cfg, f"{split}_label_data_paths") or [None] * len(paths)
        indexed = [open_checked(p) for p in paths]
        weights = getattr(cfg, f"{split}_data_weights") or [1.0] * len(paths)
        if cfg.weight_by_num_documents:
            num_docs = [len(d.sizes) for d in indexed]
            if cfg.weighted_document_limit:
                num_docs = [min(n, cfg.weighted_document_limit) for n in num_docs]
            weights = weights_by_num_documents(num_docs, cfg.weighted_sampler_alpha)
        per_dataset: list[int | None]
        if count is None:  # train_epochs: one epoch of every dataset, blended in proportion to its samples
            weights, per_dataset = [], [None] * len(paths)
        else:
            weights, counted = weighted_num_samples(weights, count)
            per_dataset = list(counted)
        datasets = []
        for i, (prefix, ds, label_path) in enumerate(zip(paths, indexed, label_paths)):
            labels = open_checked(label_path, text=False) if label_path else None
            docs = np.arange(len(ds.sizes), dtype=np.int32)
            datasets.append(
                _gpt2(cfg, f"{split}_{i}", prefix, docs, ds, per_dataset[i], label_dataset=labels, barrier=barrier)
            )
        if count is None:
            # GPT-NeoX blends epochs with equal weights, so a smaller dataset repeats and a larger one is cut short
            # (docs/gpt-neox-differences.md); in proportion to their lengths each is read exactly once.
            weights = [float(len(d)) for d in datasets]
        result.append(BlendableDataset(datasets, weights))
    return result[0], result[1], result[2]


def make_data_loader(
    dataset: Any, cfg: DataConfig, dp_rank: int, dp_size: int, consumed_samples: int = 0, name: str = "train"
) -> torch.utils.data.DataLoader | None:
    """A loader giving DP rank ``dp_rank`` its ``micro_batch_size`` slice of each global batch, resuming after
    ``consumed_samples`` (counted in samples over all DP ranks).

    A dataset smaller than one global batch is an error for ``train``; for ``valid``/``test`` it is logged and
    ``None`` is returned (GPT-NeoX's dataset length can be one sample short of the requested count).
    """
    if dataset is None:
        return None
    global_batch = cfg.micro_batch_size * dp_size
    sampler = DistributedBatchSampler(
        len(dataset), cfg.micro_batch_size, dp_rank, dp_size, start_iter=consumed_samples // global_batch
    )
    if len(sampler) == 0:
        message = (
            f"{name} dataset has {len(dataset)} samples, fewer than one global batch of {global_batch} "
            "(micro_batch_size x data-parallel size)"
        )
        if name == "train":
            raise DataError(message)
        logger.warning("%s; no %s loader", message, name)
        return None
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        # A private generator: starting an epoch must not draw from the global torch RNG (dropout's stream),
        # or a resumed run would diverge from an uninterrupted one.
        generator=torch.Generator().manual_seed(0),
    )


def build_train_valid_test_data_loaders(
    cfg: DataConfig,
    *,
    dp_rank: int,
    dp_size: int,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    barrier: Callable[[], None] | None = None,
    opened: dict[tuple[str, bool], Any] | None = None,
) -> tuple[Any, Any, Any]:
    """Datasets as GPT-NeoX builds them, wrapped in per-DP-rank loaders: ``(train, valid, test)``, any may be None.

    Each batch is ``{"text": LongTensor[micro_batch, seq_length + 1]}`` (+ ``"label"``). Re-iterating a loader
    starts the next epoch from sample 0. ``barrier`` (default: the default group's barrier when
    ``torch.distributed`` is initialised) lets the ranks that call this wait while one of them builds index maps;
    ``opened``: as for :func:`build_train_valid_test_datasets`.
    """
    train, valid, test = build_train_valid_test_datasets(cfg, barrier=barrier, opened=opened)
    return (
        make_data_loader(train, cfg, dp_rank, dp_size, consumed_train_samples),
        make_data_loader(valid, cfg, dp_rank, dp_size, consumed_valid_samples, name="valid"),
        make_data_loader(test, cfg, dp_rank, dp_size, 0, name="test"),
    )
