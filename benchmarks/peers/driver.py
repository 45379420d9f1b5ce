"""bench_train.py's side of the peer protocol: export our initial model for the peer, start it, feed it our batches.

Runs in our .venv (torch, megatron). The export is the Hugging Face GPTNeoX checkpoint layout as Pythia's are on the
Hub (``config.json`` + ``model.safetensors``, head named ``embed_out.weight``; transformers 5 ``from_pretrained``
renames it to ``lm_head``), so every peer converts it its own documented way.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from peers.protocol import PeerProcess
from peers.registry import PEERS, Peer

logger = logging.getLogger(__name__)


def export_hf(module: Any, out_dir: str) -> dict[str, Any]:
    """Write our model (``engine.module``) as a GPTNeoX checkpoint in ``out_dir``; returns the HF config dict."""
    import torch
    from safetensors.torch import save_file

    from megatron.model.hf_mapping import neox_to_hf_config, neox_to_hf_state_dict

    cfg = module.cfg if hasattr(module, "cfg") else module.config
    cfg = cfg.replace(params_dtype=torch.float32)
    hf_cfg = neox_to_hf_config(cfg)
    hf_cfg.hidden_dropout = 0.0
    hf_cfg.attention_dropout = 0.0
    sd = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    hf_sd = neox_to_hf_state_dict(sd, cfg)
    hub = {("embed_out.weight" if k == "lm_head.weight" else k): v.contiguous() for k, v in hf_sd.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(hub, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = hf_cfg.to_dict()
    config["architectures"] = ["GPTNeoXForCausalLM"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True, default=str)
    return config


def rows_from_batch(tokens: Any, labels: Any) -> list[list[int]]:
    """Our batch (inputs, labels shifted by one) as the protocol's rows of seq + 1 token ids."""
    if tokens.shape[1] > 1 and not bool((labels[:, :-1] == tokens[:, 1:]).all()):
        raise ValueError("labels are not the inputs shifted by one: the peer protocol cannot carry this batch")
    full = tokens.new_empty((tokens.shape[0], tokens.shape[1] + 1))
    full[:, :-1] = tokens
    full[:, -1] = labels[:, -1]
    rows: list[list[int]] = full.tolist()
    return rows


def lookup(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(sorted(PEERS))}")
    return PEERS[name]


def missing_venv(peer: Peer) -> str | None:
    """The one-line setup hint when the peer's virtualenv is not there, else None."""
    return None if os.path.exists(peer.python()) else peer.setup_hint()


def start_peer(peer: Peer, shape: str, seq: int, micro_batch: int, threads: int, init_dir: str) -> PeerProcess:
    args = ["--shape", shape, "--seq", str(seq), "--micro-batch", str(micro_batch), "--threads", str(threads)]
    args += ["--init-hf", init_dir, *peer.flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **peer.env}
    return PeerProcess(peer.python(), peer.runner_path(), args, env=env)


class PeerRun:
    """The peer side of one bench_train run: started at our first iteration (our initial weights exist then)."""

    def __init__(self, name: str, shape: str, seq: int, micro_batch: int, threads: int, extra: list[str]) -> None:
        import tempfile

        self.peer = lookup(name)
        self.name, self.shape, self.seq, self.micro_batch, self.threads = name, shape, seq, micro_batch, threads
        self.extra = list(extra)
        self.tmp = tempfile.TemporaryDirectory(prefix="neox-peer-")
        self.proc: PeerProcess | None = None
        self.ready: dict[str, Any] = {}
        self.losses: list[float] = []
        self.seconds: list[float] = []  # measured inside the runner
        self.walls: list[float] = []  # measured here, around the request (includes the pipe and JSON)

    def start(self, engine: Any) -> None:
        if self.proc is not None:
            return
        init_dir = os.path.join(self.tmp.name, "init-hf")
        export_hf(engine.module, init_dir)
        peer = Peer(**{**self.peer.__dict__, "flags": (*self.peer.flags, *self.extra)})
        self.proc = start_peer(peer, self.shape, self.seq, self.micro_batch, self.threads, init_dir)
        self.ready = self.proc.ready
        logger.info("peer %s ready: %s", self.name, json.dumps(self.ready))

    def step(self, tokens: Any, labels: Any, profile: bool = False) -> float:
        import time

        assert self.proc is not None, "PeerRun.start() first"
        rows = rows_from_batch(tokens, labels)
        start = time.perf_counter()
        loss, seconds = self.proc.step(rows, profile=profile)
        self.walls.append(time.perf_counter() - start)
        self.seconds.append(seconds)
        self.losses.append(loss)
        return loss

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
        self.tmp.cleanup()
