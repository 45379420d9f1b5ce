"""Key/value cache for incremental decoding with the sequential model.

Usage (greedy decode)::

    cache = KVCache()
    logits = model(prompt_ids, kv_cache=cache)            # fills the cache, cache.seq_len == prompt length
    next_id = logits[:, -1].argmax(-1, keepdim=True)
    logits = model(next_id, kv_cache=cache)               # one new token; positions continue at seq_len

The cache stores, per transformer layer, keys and values of this TP rank's KV heads as ``[b, kv_heads/tp, s, hn]``
(after rotary). Position ids default to ``cache.seq_len + arange(s_new)``; the causal mask for the new tokens is
built internally when ``attention_mask`` is None (a given mask is sliced to ``[.., past:past+s_new, :past+s_new]``).
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K/V tensors, keyed by layer index; ``seq_len`` = tokens already processed."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.seq_len = 0

    def past_length(self, layer: int) -> int:
        """Tokens cached for ``layer`` (0 before the first forward)."""
        k = self.keys.get(layer)
        return 0 if k is None else k.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ``[b, nkv, s_new, hn]`` for ``layer``; return the full ``[b, nkv, s_past+s_new, hn]``."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def advance(self, num_tokens: int) -> None:
        """Called by the model after a forward over ``num_tokens`` new tokens."""
        self.seq_len += num_tokens

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self.keys.clear()
        self.values.clear()
        self.seq_len = 0
