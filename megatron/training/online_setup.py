"""The online side of a REINFORCE run (``dataset_impl: online``): this rank's weight server and rollout iterators.

It lives in ``training`` because it takes the engine; what it builds is ``post_training``'s (the rollout client and
the weight server, GPT-NeoX's protocol).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.online_data import build_online_iterators
from megatron.post_training.weight_server import WeightServer, weight_server_port_of


@dataclass
class OnlineSetup:
    """The rollout iterators (train, valid, test) and the weight server (``None`` without ``serve_model_weights``)."""

    iterators: tuple[Iterator[dict[str, torch.Tensor]] | None, ...]
    weight_server: WeightServer | None

    def close(self) -> None:
        """Stop serving weights."""
        if self.weight_server is not None:
            self.weight_server.close()


def setup_online(
    cfg: PostTrainingConfig, engine: Engine, *, seq_length: int, micro_batch_size: int, vocab_size: int
) -> OnlineSetup:
    """Start this rank's weight server (``localhost:weight_server_port + rank``) when ``serve_model_weights``, and
    the iterators over its data server's rollouts (requests made inside the server's window)."""
    server = None
    if cfg.serve_model_weights:
        module: Any = engine.module
        port = weight_server_port_of(cfg.weight_server_port, mpu.world_rank())
        server = WeightServer(lambda: module.state_dict(prefix="module."), port)  # the engine's keys, as GPT-NeoX
    iterators = build_online_iterators(
        cfg,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        vocab_size=vocab_size,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        fetches=mpu.get_model_parallel_rank() == 0,
        window=server.serving if server is not None else None,
    )
    return OnlineSetup(iterators, server)
