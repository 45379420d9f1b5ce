"""muP learning-rate transfer: does the best Adam LR at width 64 stay the best at width 256? (issue 34)

    python benchmarks/bench_mup_lr.py [--steps 200] [--seeds 3] [--docs 150] [--lrs 3e-4,6e-4,1e-3,2e-3,3e-3,6e-3,1e-2] [--save]

On the quick-start corpus (the Python standard library's sources, ``tools/datasets/corpora.py``; the first
``--docs`` files, a BPE tokenizer of 1024 tokens trained on them, ``tools/datasets/train_tokenizer.py``) a 2-layer
GPT is trained at widths 64 and 256 for ``--steps`` Adam steps at each LR, in standard parametrisation and with
muP (base shapes: the width-64 model against width 128, as ``save_base_shapes``; ``megatron.model.mup``). Each
(width, LR) is trained ``--seeds`` times (seed ``s``: model init ``1234 + s`` and, for ``s > 0``, a shuffled order of
the same training batches); its score is the mean over seeds of the loss on held-out batches after training (one
seed's 100-step sweep was too noisy to rank neighbouring LRs: its curves were not monotone). Printed: the loss per LR and the argmin per width; ``ratio`` is 1 when the width-64 argmin is also the
width-256 one under muP, else 0 (standard parametrisation is reported beside it). One process, CPU, no DeepSpeed:
the model, muP and optimizer code of ``pretrain()`` without its loop.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import REPO, Report, now

from megatron.data.indexed_dataset import make_dataset
from megatron.model import GPTModelConfig, get_ltor_masks_and_position_ids
from megatron.model.gpt2_model import build_sequential_model, cross_entropy
from megatron.model.mup import MupConfig, apply_mup, make_base_shapes, shapes_of

VOCAB = 1024
BASE_WIDTH = 64


def build_corpus(folder: Path, docs: int) -> np.ndarray:
    """The quick-start corpus's first ``docs`` files → tokenizer → .bin/.idx with the project's tools; all tokens."""
    tools, py = Path(REPO) / "tools" / "datasets", sys.executable
    env = {**os.environ, "PYTHONPATH": REPO}
    jsonl, tok, prefix = folder / "stdlib.jsonl", folder / "tokenizer.json", folder / "stdlib"
    for cmd in (
        [py, tools / "corpora.py", "--output", jsonl, "--max-docs", str(docs)],
        [py, tools / "train_tokenizer.py", "--json_input_dir", folder, "--tokenizer_output_path", tok,
         "--vocab_size", str(VOCAB)],
        [py, tools / "preprocess_data.py", "--input", jsonl, "--output-prefix", prefix, "--tokenizer-type",
         "HFTokenizer", "--vocab-file", tok, "--append-eod", "--workers", "1"],
    ):  # fmt: skip
        subprocess.run([str(c) for c in cmd], check=True, env=env, capture_output=True, timeout=600)
    ds = make_dataset(f"{prefix}_text_document", "mmap")
    return np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])


def batches(tokens: np.ndarray, seq: int, micro: int, count: int, offset: int) -> list[torch.Tensor]:
    """``count`` batches ``[micro, seq+1]`` of consecutive windows starting at window ``offset``."""
    need = (offset + count * micro) * (seq + 1)
    if need > len(tokens):
        raise SystemExit(f"--docs gives {len(tokens)} tokens; {need} needed: raise --docs or lower --steps")
    windows = torch.from_numpy(tokens[:need].reshape(-1, seq + 1))[offset:]
    return [windows[i * micro : (i + 1) * micro] for i in range(count)]


def model_config(width: int, seq: int, use_mup: bool, seed: int = 1234) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=2, hidden_size=width, num_attention_heads=4, padded_vocab_size=VOCAB, max_position_embeddings=seq,
        pos_emb="rotary", init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0, use_mup=use_mup, seed=seed,
    )  # fmt: skip


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    tokens, labels = batch[:, :-1], batch[:, 1:]
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, 0)
    return cross_entropy(model(tokens, pos, mask), (labels, loss_mask))


def run(width: int, lr: float, use_mup: bool, seq: int, train: list, held: list, base: Any, seed: int = 0) -> float:
    """Train one model (``seed``: its init and the order of the training batches); its mean held-out loss (inf when
    training diverged)."""
    torch.manual_seed(seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist() if seed else None
    train = [train[i] for i in order] if order else train
    cfg = model_config(width, seq, use_mup, seed=1234 + seed)
    model = build_sequential_model(cfg)
    groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if use_mup:
        shapes = apply_mup(model, MupConfig(), cfg, base, "bench_mup_lr's base model")
        groups = shapes.param_groups(groups, "adam", lr)
    opt = torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.95))
    warmup = max(1, len(train) // 10)  # linear warmup over the first 10% of the steps, then constant
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    for batch in train:
        loss = lm_loss(model, batch)
        if not math.isfinite(loss.item()):
            return math.inf
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        value = sum(lm_loss(model, b).item() for b in held) / len(held)
    return value if math.isfinite(value) else math.inf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--docs", type=int, default=150)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--held", type=int, default=8, help="held-out batches")
    p.add_argument("--widths", default="64,256")
    p.add_argument("--lrs", default="3e-4,6e-4,1e-3,2e-3,3e-3,6e-3,1e-2")
    p.add_argument(
        "--seeds", type=int, default=3, help="runs per (width, LR): init seed and batch order; losses averaged"
    )
    p.add_argument("--save", action="store_true")
    a = p.parse_args()
    widths, lrs = [int(w) for w in a.widths.split(",")], [float(x) for x in a.lrs.split(",")]
    torch.manual_seed(0)
    report = Report(
        "mup_lr", " ".join(["python", *sys.argv]), steps=a.steps, docs=a.docs, seq=a.seq, micro=a.micro,
        widths=widths, lrs=lrs, seeds=a.seeds, layers=2, vocab=VOCAB, optimizer="Adam betas (0.9, 0.95), linear warmup over 10% of the steps, then constant",
    )  # fmt: skip
    start = now()
    with tempfile.TemporaryDirectory(prefix="bench-mup-lr-") as folder:
        tokens = build_corpus(Path(folder), a.docs)
    train = batches(tokens, a.seq, a.micro, a.steps, 0)
    held = batches(tokens, a.seq, a.micro, a.held, a.steps * a.micro)
    with torch.device("meta"):
        base = make_base_shapes(
            shapes_of(build_sequential_model(model_config(BASE_WIDTH, a.seq, True))),
            shapes_of(build_sequential_model(model_config(2 * BASE_WIDTH, a.seq, True))),
        )
    losses: dict[str, dict[str, dict[str, float]]] = {}
    best: dict[str, dict[str, float]] = {}
    for tag, use_mup in (("mup", True), ("sp", False)):
        losses[tag], best[tag] = {}, {}
        for width in widths:
            row = {
                f"{lr:g}": sum(run(width, lr, use_mup, a.seq, train, held, base, s) for s in range(a.seeds)) / a.seeds
                for lr in lrs
            }
            losses[tag][str(width)] = {k: round(v, 4) for k, v in row.items()}
            best[tag][str(width)] = float(min(row, key=lambda k: row[k]))
            print(f"{tag:>3} width {width:4d}: " + "  ".join(f"lr {k}: {v:.4f}" for k, v in row.items())
                  + f"  -> best lr {best[tag][str(width)]:g}", flush=True)  # fmt: skip
    transfers = {tag: len(set(best[tag].values())) == 1 for tag in best}
    report.finish(
        1.0 if transfers["mup"] else 0.0,
        "1 when the best LR at width 64 is also the best at width 256 under muP (held-out loss), else 0",
        save=a.save,
        held_out_loss=losses,
        best_lr=best,
        transfers=transfers,
        tokens=len(tokens),
        seconds=round(now() - start, 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
