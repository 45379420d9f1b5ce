"""Batch helpers: GPT-NeoX's left-to-right attention mask, loss mask and position ids."""

from __future__ import annotations

import torch


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    eod_mask_loss: bool = False,
    sliding_window_width: int | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(attention_mask, loss_mask, position_ids)`` for tokens ``data`` [b, s].

    ``attention_mask``: bool, True = masked; ``[1, 1, s, s]`` causal (banded to ``i - w <= j <= i`` with a
    sliding window), or ``[b, 1, s, s]`` when ``reset_attention_mask`` also blocks attention across EOD
    boundaries. ``loss_mask`` [b, s] float: 1, or 0 on EOD tokens with ``eod_mask_loss``. ``position_ids``
    [b, s]: ``arange(s)``, or restarting at 0 after every EOD with ``reset_position_ids``.
    GPT-NeoX's defaults (no resets) let packed documents attend across EOD boundaries.
    """
    b, s = data.shape
    device = data.device
    idx = torch.arange(s, device=device)
    causal_masked = idx[None, :] > idx[:, None]  # [s, s], True above the diagonal
    if sliding_window_width is not None:
        causal_masked = causal_masked | (idx[None, :] < idx[:, None] - sliding_window_width)
    is_eod = data == eod_token
    if reset_attention_mask:
        doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # an EOD belongs to the document it ends
        other_doc = doc[:, :, None] != doc[:, None, :]  # [b, s, s]
        attention_mask = (causal_masked[None] | other_doc).unsqueeze(1)
    else:
        attention_mask = causal_masked[None, None]
    loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if reset_position_ids:
        starts = torch.zeros_like(is_eod)
        starts[:, 1:] = is_eod[:, :-1]
        starts[:, 0] = True
        start_idx = torch.cummax(torch.where(starts, idx[None, :], torch.zeros_like(idx)[None, :]), dim=1).values
        position_ids = idx[None, :] - start_idx
    else:
        position_ids = idx[None, :].expand(b, s).clone()
    return attention_mask, loss_mask, position_ids
