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
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def model_name(args: Any) -> str:
    """``precompute_model_name``, else a stable signed 64-bit hash of ``load`` (like ``str(hash(...))``)."""
    if args.precompute_model_name:
        return str(args.precompute_model_name)
    digest = hashlib.sha256(str(args.load).encode("utf-8")).digest()[:8]
    return str(int.from_bytes(digest, "little", signed=True))


def precompute_paths(args: Any) -> list[str]:
    """The dataset prefixes to score, in GPT-NeoX's order."""
    if args.train_data_paths:
        groups = ("train_data_paths", "test_data_paths", "valid_data_paths")
    elif getattr(args, "pos_train_data_paths", None):
        groups = tuple(f"{kind}_{split}_data_paths" for split in ("train", "valid", "test") for kind in ("pos", "neg"))
    else:
        groups = ("data_path",)
    paths: list[str] = []
    for key in groups:
        value = getattr(args, key, None)
        paths += [value] if isinstance(value, str) else list(value or [])
    if not paths:
        raise ValueError("text_gen_type precompute needs data: set train_data_paths (or data_path)")
    return paths


@torch.no_grad()
def precompute_logprobs(model: torch.nn.Module, args: Any, device: torch.device | str = "cpu") -> list[str]:
    """Write the log-prob datasets; returns the output prefixes."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset

    seq, batch = int(args.seq_length), max(1, int(args.train_micro_batch_size_per_gpu or 1))
    name, outputs = model_name(args), []
    for path in precompute_paths(args):
        out = f"{path}_{name}"
        outputs.append(out)
        if os.path.exists(out + ".idx"):
            logger.info("precompute: %s.idx exists, kept", out)
            continue
        dataset = make_dataset(path, args.data_impl or "infer")
        if dataset is None:
            raise ValueError(f"precompute: dataset {path} (.bin/.idx) not found")
        builder = MMapIndexedDatasetBuilder(out + ".bin", dtype=np.float32)
        for first in range(0, len(dataset), batch):
            rows = []
            for j in range(first, min(first + batch, len(dataset))):
                doc = [int(x) for x in dataset.get(j)][: seq + 1]
                rows.append(doc + [0] * (seq + 1 - len(doc)))
            tokens = torch.tensor(rows, dtype=torch.long, device=device)
            logp = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)
            picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1).cpu().numpy().astype(np.float32)
            for row in picked:
                builder.add_item(row)
                builder.end_document()
        builder.finalize(out + ".idx")
        logger.info("precompute: wrote %d documents of %d log-probs to %s.bin/.idx", len(dataset), seq, out)
    return outputs
