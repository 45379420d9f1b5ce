"""What a split's index maps are built from, besides its documents: one frozen value for the builders, the cache's
file names and stamp, and :class:`megatron.data.gpt2_dataset.GPT2Dataset`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexMapParams:
    """GPT-NeoX's index-map parameters. ``num_samples`` is None only for epoch-based training (``pack_impl``
    packed with ``num_epochs``); ``num_epochs`` (packed only) fixes the epochs instead of deriving them."""

    num_samples: int | None
    seq_length: int
    seed: int
    pack_impl: str = "packed"
    allow_chopped: bool = True
    num_epochs: int | None = None
