"""``text_gen_type: precompute``: per-token reference log-probs of the configured datasets (GPT-NeoX's
``precompute_logits``, read by DPO/KTO as the reference model's log-probs).

For every prefix in ``train_data_paths``, ``test_data_paths``, ``valid_data_paths`` (or, for pairwise data, the
``pos_*`` / ``neg_*`` paths; or ``data_path`` when none of those is set), each document is cut or padded with id 0
to ``seq_length + 1`` tokens and the log-probability of tokens 1..seq_length under the model is written as one
float32 document of ``seq_length`` values to ``<prefix>_<precompute_model_name>.bin/.idx`` (mmap format). An
existing output is kept (GPT-NeoX skips it too). Without ``precompute_model_name`` GPT-NeoX names the file after
Python's ``hash(load)``, which changes with every process; here it is a stable hash of the ``load`` path. GPT-NeoX
also pads the document count up to a multiple of 8 with repeated documents; here there is one output document per
input document.

Under the training layout on N ranks (``model_parallel_size`` / ``pipe_parallel_size`` > 1) every rank scores with
its part of the model (:meth:`~megatron.generation.parallel.StageForward.score`: the last stage's logits on every
rank), each data-parallel replica takes its rows of a batch of ``train_micro_batch_size_per_gpu x DP`` documents,
and global rank 0 alone writes (and decides whether an output already exists). The output appears atomically: it
is written under a ``.partial`` name and renamed (``.bin`` first, ``.idx`` last), and removed on an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron import mpu
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
from megatron.data.staged_output import staged_builders
from megatron.generation.config import PrecomputeConfig
from megatron.mpu.dp_split import DataParallelSplit

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


@torch.no_grad()
def precompute_logprobs(
    score: Callable[[torch.Tensor], torch.Tensor],
    cfg: PrecomputeConfig,
    device: torch.device | str = "cpu",
    *,
    dp: DataParallelSplit | None = None,
) -> list[str]:
    """Write the log-prob datasets; returns the output prefixes.

    ``score`` maps tokens ``[b, s]`` to logits ``[b, s, V]`` (the sequential model, or ``StageForward.score``);
    ``dp`` is given on the ranks of the training layout (see the module docstring), None on one process.
    """
    parallel = dp is not None
    dp = dp or DataParallelSplit()
    writes = not parallel or mpu.world_rank() == 0
    seq, micro = cfg.seq_length, cfg.train_micro_batch_size_per_gpu
    name, outputs = cfg.model_name, []
    for path in cfg.paths():
        out = f"{path}_{name}"
        outputs.append(out)
        exists = os.path.exists(out + ".idx") if writes else None
        if mpu.broadcast_object(exists) if parallel else exists:
            logger.info("precompute: %s.idx exists, kept", out)
            continue
        dataset = make_dataset(path, cfg.data_impl)
        if dataset is None:
            raise ValueError(f"precompute: dataset {path} (.bin/.idx) not found")
        staged: contextlib.AbstractContextManager[dict[str, Any]] = contextlib.nullcontext({})
        if writes:
            staged = staged_builders({out: out}, lambda _, bin_path: MMapIndexedDatasetBuilder(bin_path, np.float32))
        with staged as builders:
            builder = builders.get(out)
            for first in range(0, len(dataset), micro * dp.size):
                batch = range(first, min(first + micro * dp.size, len(dataset)))
                mine = [batch[i] for i in dp.my_rows(len(batch))]
                for row in dp.gather(_logprobs(score, dataset, mine, seq, device) if mine else []):
                    if builder is not None:
                        builder.add_item(row)
                        builder.end_document()
        if writes:
            logger.info("precompute: wrote %d documents of %d log-probs to %s.bin/.idx", len(dataset), seq, out)
    return outputs


def _logprobs(score: Callable[[torch.Tensor], torch.Tensor], dataset: Any, docs: list[int], seq: int,
              device: torch.device | str) -> list[np.ndarray]:  # fmt: skip
    """Float32 log-probs of tokens 1..seq of each document (cut, or padded with id 0, to ``seq + 1`` tokens)."""
    rows = []
    for j in docs:
        doc = [int(x) for x in dataset.get(j)][: seq + 1]
        rows.append(doc + [0] * (seq + 1 - len(doc)))
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    logp = torch.log_softmax(score(tokens[:, :-1]).float(), dim=-1)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1).cpu().numpy().astype(np.float32)
    return list(picked)
