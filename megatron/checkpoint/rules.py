"""The merge/split rule of every tensor between TP shards and the full (tp=1) GPT-NeoX layout.

| tensor                                                   | rule                                             |
|----------------------------------------------------------|--------------------------------------------------|
| word embedding, untied ``final_linear``                  | cat / split dim 0 (vocab rows)                   |
| ``attention.query_key_value`` (MHA)                      | cat dim 0 (per-head interleaved ``[q|k|v]``)     |
| ``attention.query_key_value`` (GQA)                      | per rank ``[Q_r|K_r|V_r]``: each block cat dim 0 |
| ``mlp.linear1`` (gated)                                  | per rank ``[up_r|gate_r]``: each half cat dim 0  |
| ``mlp.linear1`` (plain)                                  | cat dim 0                                        |
| ``attention.dense.weight``, ``mlp.linear2.weight``       | cat dim 1                                        |
| norms, position embeddings                               | replicated (rank 0; mean if ranks disagree)      |
| row-parallel biases                                      | replicated, or ``split``: **sum** over TP        |
| gMLP blocks (``input_linear``, ``output_linear``, ``sgu``) | tp=1 only: refused across TP ranks               |

Row-parallel biases are stored as GPT-NeoX's training stores them: equal shares that sum to the effective bias in
parallel-residual layers at TP > 1 (``split``), the effective bias otherwise (``megatron.checkpoint.bias_layout``).

Older GPT-NeoX names are accepted on input: ``mlp.dense_h_to_4h``/``mlp.dense_4h_to_h`` and the Llama-style
``mlp.w1`` (gate), ``mlp.w3`` (up), ``mlp.w2`` (down).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch

from megatron.checkpoint.bias_layout import is_row_bias
from megatron.model.config import GPTModelConfig
from megatron.model.tp_sharding import check_reshardable, merge, partition_spec, shard

logger = logging.getLogger(__name__)

VOCAB_ROWS = ("word_embeddings.weight", "final_linear.weight")
_TE_MARKERS = ("layernorm_qkv", "layernorm_mlp", "._extra_state")


def rename_legacy(shard_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One TP rank's tensors with GPT-NeoX's legacy MLP names mapped to ``mlp.linear1/linear2``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in shard_sd.items():
        if any(marker in key for marker in _TE_MARKERS):
            raise ValueError(
                f"tensor {key!r}: TransformerEngine checkpoints are not supported; export with norm/attention "
                "implementations that use plain torch layers"
            )
        key = key.replace("mlp.dense_h_to_4h.", "mlp.linear1.").replace("mlp.dense_4h_to_h.", "mlp.linear2.")
        key = key.replace("mlp.w2.", "mlp.linear2.")
        out[key] = value
    for key in [k for k in out if ".mlp.w1." in k or k.startswith("mlp.w1.")]:
        up_key = key.replace("mlp.w1.", "mlp.w3.")
        if up_key not in out:
            raise ValueError(f"legacy gated MLP: {key!r} present but {up_key!r} missing")
        gate, up = out.pop(key), out.pop(up_key)
        out[key.replace("mlp.w1.", "mlp.linear1.")] = torch.cat((up, gate), dim=0)  # this rank's [up_r | gate_r]
    return out


def merge_tensor(
    name: str, shards: Sequence[torch.Tensor], cfg: GPTModelConfig, *, sum_row_biases: bool = False
) -> torch.Tensor:
    """The full tensor for ``name`` from its per-TP-rank shards."""
    dim, subs = partition_spec(name, cfg)
    if len(shards) == 1:
        return shards[0]
    check_reshardable(name, len(shards))
    if dim is not None:
        return merge(list(shards), dim, subs)
    if sum_row_biases and is_row_bias(name):
        return torch.stack([s.double() for s in shards]).sum(0).to(shards[0].dtype)  # exact for equal shares
    first = shards[0]
    if first.is_floating_point() and any(not torch.equal(first, s) for s in shards[1:]):
        logger.warning("replicated tensor %s differs across TP ranks: using the mean", name)
        return torch.stack([s.float() for s in shards]).mean(0).to(first.dtype)
    return first


def split_tensor(name: str, full: torch.Tensor, cfg: GPTModelConfig, tp: int) -> list[torch.Tensor]:
    """The per-TP-rank shards of the full tensor ``name`` (replicated tensors are shared, not copied)."""
    check_reshardable(name, tp)
    dim, subs = partition_spec(name, cfg)
    if dim is None or tp == 1:
        return [full] * tp
    try:
        return [shard(full, dim, r, tp, subs) for r in range(tp)]
    except ValueError as e:
        raise ValueError(f"{name} {tuple(full.shape)} cannot be split over tp={tp}: {e}") from None


def resize_vocab(name: str, full: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad (zeros) or trim the vocabulary rows of an embedding / output layer (or its optimizer state)."""
    if not name.endswith(VOCAB_ROWS) or full.size(0) == rows:
        return full
    if rows < full.size(0):
        logger.warning("%s: trimming padded vocabulary rows %d -> %d", name, full.size(0), rows)
        return full[:rows].clone()
    pad = full.new_zeros((rows - full.size(0), *full.shape[1:]))
    return torch.cat((full, pad), dim=0)


def layer_index(name: str) -> int:
    """The spec index of a full-layout key ``sequential.<idx>.<name>``."""
    m = re.match(r"^sequential\.(\d+)\.", name)
    if not m:
        raise ValueError(f"not a full-layout key: {name!r}")
    return int(m.group(1))
