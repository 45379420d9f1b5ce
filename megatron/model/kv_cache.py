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

from typing import Any

import torch


class KVCache:
    """Per-layer K/V tensors, keyed by layer index; ``seq_len`` = tokens already processed.

    ``capacity`` (tokens) preallocates each layer's storage at its first update, so a generation that knows its
    final length never reallocates; beyond it storage grows by doubling (amortised O(1) per token instead of
    re-concatenating the whole past every step). ``update`` returns views of the filled part.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = int(capacity)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}
        self.layer_states: dict[int, Any] = {}  # recurrent layers' state (Mamba: conv and SSM state), by layer
        self.seq_len = 0

    def past_length(self, layer: int) -> int:
        """Tokens cached for ``layer`` (0 before the first forward)."""
        return self._lengths.get(layer, 0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ``[b, nkv, s_new, hn]`` for ``layer``; return the full ``[b, nkv, s_past+s_new, hn]``."""
        past, new = self._lengths.get(layer, 0), k.shape[2]
        keys, values = self._keys.get(layer), self._values.get(layer)
        if keys is None or values is None or past + new > keys.shape[2]:
            capacity = self.capacity if keys is None and past + new <= self.capacity else max(2 * (past + new), 16)
            grown_k = k.new_empty(*k.shape[:2], capacity, k.shape[3])
            grown_v = v.new_empty(*v.shape[:2], capacity, v.shape[3])
            if keys is not None and values is not None:
                grown_k[:, :, :past] = keys[:, :, :past]
                grown_v[:, :, :past] = values[:, :, :past]
            keys, values = grown_k, grown_v
            self._keys[layer], self._values[layer] = keys, values
        keys[:, :, past : past + new] = k
        values[:, :, past : past + new] = v
        self._lengths[layer] = past + new
        return keys[:, :, : past + new], values[:, :, : past + new]

    def advance(self, num_tokens: int) -> None:
        """Called by the model after a forward over ``num_tokens`` new tokens."""
        self.seq_len += num_tokens

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self._keys.clear()
        self._values.clear()
        self._lengths.clear()
        self.layer_states.clear()
        self.seq_len = 0
