"""GPT-NeoX's ``BlendableDataset``: several datasets interleaved by deterministic greedy weights."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron.data.index_maps import build_blending_indices
from megatron.errors import DataError

logger = logging.getLogger(__name__)


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 summing to 1 (raises ValueError for negative or all-zero weights)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0:
        raise DataError("weights must be a non-empty list of numbers")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise DataError(f"weights must be finite and non-negative, got {list(weights)}")
    total = w.sum()
    if total <= 0:
        raise DataError(f"weights must not sum to 0, got {list(weights)}")
    return w / total


class BlendableDataset(torch.utils.data.Dataset):
    """Sample ``k`` comes from the dataset whose share lags its weight most (GPT-NeoX's C++ rule, no RNG).

    ``len`` is the sum of the datasets' lengths. Indices past a dataset's end wrap around inside it.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float]) -> None:
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = sum(len(d) for d in self.datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.size:
            idx %= self.size
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]


def weights_by_num_documents(num_documents: Sequence[int], alpha: float = 1.0) -> list[float]:
    """GPT-NeoX's ``weight_by_num_documents``: ``p_i ∝ (n_i / Σn)^α``, then ``w_i ∝ p_i · (1 − n_i / Σn)``."""
    n = np.asarray(num_documents, dtype=np.float64)
    if len(n) == 0 or np.any(n <= 0):
        raise DataError(f"every dataset needs documents to be weighted by them, got counts {list(num_documents)}")
    share = n / n.sum()
    p = share**alpha
    p /= p.sum()
    w = p * (1.0 - share)
    if w.sum() <= 0:  # a single dataset: 1 - share is 0
        return [1.0] * len(n)
    return list(w / w.sum())
