"""Batches as the training step sees them (single process: mpu answers as one rank)."""

from __future__ import annotations

import torch

from megatron.training.step import BatchConfig, get_batch


def test_get_batch_shifts_tokens_and_masks_eod_and_labels() -> None:
    text = torch.tensor([[5, 6, 0, 7, 8], [1, 2, 3, 4, 0]])  # [b, s+1], EOD = 0
    (tokens, position_ids, _mask), (labels, loss_mask) = get_batch({"text": text}, BatchConfig(eod_token=0))
    assert tokens.tolist() == [[5, 6, 0, 7], [1, 2, 3, 4]]
    assert labels.tolist() == [[6, 0, 7, 8], [2, 3, 4, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert loss_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    _, (_, eod_masked) = get_batch({"text": text}, BatchConfig(eod_token=0, eod_mask_loss=True))
    assert eod_masked.tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]  # the EOD *input* position carries no loss

    label = torch.tensor([[-100, -100, 9, 9, 9], [-100, 1, 2, -100, 3]])
    cfg = BatchConfig(eod_token=0, with_labels=True)
    _, (labels, loss_mask) = get_batch({"text": text, "label": label}, cfg)
    assert labels.tolist() == [[0, 9, 9, 9], [1, 2, 0, 3]]  # negative labels → 0, masked out
    assert loss_mask.tolist() == [[0, 1, 1, 1], [1, 1, 0, 1]]
