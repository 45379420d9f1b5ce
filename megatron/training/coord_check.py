"""GPT-NeoX's muP coordinate check (``coord_check: true`` with ``use_mup``): train the model at several widths for a
few steps on one fixed batch, with and without muP, and record the average coordinate size ``mean(|x|)`` (mup's
``l1``) of every module's output at each step; then plot size against width, one panel per step.

Under muP the sizes stay flat across widths; in standard parametrisation some (the output logits first) grow.
As GPT-NeoX (through mup's ``get_coord_data``): widths ``num_attention_heads · 2^p`` for ``p`` in 2..8, 3 training
steps recorded at ``t`` = 1..4 (the forward pass before each step, and one after the last), SGD at lr 0.1 (MuSGD
with muP), seed 0, the first batch of the training data reused; the plots go to ``coord_check_up.{rank}.jpg`` (muP)
and ``coord_check_sp.{rank}.jpg`` (standard) in the working directory, the data beside them as ``.csv``.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron.model.config import GPTModelConfig
from megatron.model.gpt2_model import build_sequential_model, cross_entropy
from megatron.model.mup import MupConfig, apply_mup, make_base_shapes, shapes_of

logger = logging.getLogger(__name__)

Record = dict[str, Any]  # {"width", "module", "t", "l1"}
Batch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def gpt_neox_widths(num_attention_heads: int) -> list[int]:
    """GPT-NeoX's coord-check widths: ``num_attention_heads · 2^p``, ``p`` = 2..8."""
    return [num_attention_heads * 2**p for p in range(2, 9)]


def _hook(records: list[Record], width: int, name: str, t: int) -> Any:
    """mup's ``_record_coords`` for the output: one record per tensor (``name:out[i]`` for a tuple's items)."""

    def stat(module_name: str, x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            records.append({"width": width, "module": module_name, "t": t, "l1": x.detach().abs().mean().item()})

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            for i, out in enumerate(output):
                stat(f"{name}:out[{i}]", out)
        else:
            stat(name, output)

    return hook


def coord_data(
    model_cfg: GPTModelConfig,
    cfg: MupConfig,
    widths: Iterable[int],
    batch: Batch,
    *,
    use_mup: bool,
    steps: int = 3,
    optimizer: str = "sgd",
    lr: float | None = None,
    seed: int = 0,
) -> list[Record]:
    """The coordinate sizes of every module's output, per width and step (``t`` = 1..steps+1).

    Each width's model is the configured one with ``hidden_size`` changed; under muP its base shapes are the
    configured model's against its delta (``hidden_size · mup_width_scale``), as ``save_base_shapes`` writes them.
    """
    lr = lr if lr is not None else (0.1 if optimizer == "sgd" else 1e-3)  # mup's get_coord_data defaults
    base = delta = None
    if use_mup:
        delta_cfg = model_cfg.replace(hidden_size=model_cfg.hidden_size * cfg.mup_width_scale)
        with torch.device("meta"):
            base, delta = shapes_of(build_sequential_model(model_cfg)), shapes_of(build_sequential_model(delta_cfg))
    records: list[Record] = []
    (tokens, position_ids, mask), targets = batch
    for width in widths:
        torch.manual_seed(seed)
        wcfg = model_cfg.replace(hidden_size=width, use_mup=use_mup)
        model = build_sequential_model(wcfg)
        groups: list[dict[str, Any]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if use_mup:
            assert base is not None and delta is not None
            shapes = apply_mup(model, cfg, wcfg, make_base_shapes(base, delta), "the coordinate check's base model")
            groups = shapes.param_groups(groups, optimizer, lr)
        opt = _optimizer(optimizer, groups, lr)
        model.train()
        for t in range(1, steps + 2):
            handles = [m.register_forward_hook(_hook(records, width, n, t)) for n, m in model.named_modules() if n]
            try:
                logits = model(tokens, position_ids, mask)
            finally:
                for h in handles:
                    h.remove()
            if t <= steps:
                opt.zero_grad()
                cross_entropy(logits, targets).backward()
                opt.step()
    return records


def _optimizer(name: str, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    raise ValueError(f"coord check optimizer {name!r}: use sgd or adam")


def write_csv(records: Sequence[Record], path: Path) -> None:
    """The records as CSV (``width,module,t,l1``)."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["width", "module", "t", "l1"])
        writer.writeheader()
        writer.writerows(records)


def plot(records: Sequence[Record], path: Path, title: str) -> None:
    """mup's ``plot_coord_data`` layout: one log-log panel per step, ``l1`` against width, a line per module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["t"] for r in records})
    modules = list(dict.fromkeys(r["module"] for r in records))
    fig, axes = plt.subplots(1, len(steps), figsize=(5 * len(steps), 4), squeeze=False)
    for ax, t in zip(axes[0], steps, strict=True):
        for name in modules:
            points = sorted((r["width"], r["l1"]) for r in records if r["t"] == t and r["module"] == name)
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=name if t == steps[0] else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"t={t}")
        ax.set_xlabel("width")
    axes[0][0].set_ylabel("l1")
    if len(modules) <= 40:
        fig.legend(loc="center right", fontsize=6)
    fig.suptitle(title)
    fig.savefig(path)
    plt.close(fig)


def run_coord_check(model_cfg: GPTModelConfig, cfg: MupConfig, batch: Batch, rank: int, out_dir: Path) -> list[Path]:
    """GPT-NeoX's coord check: muP and standard data and plots for this rank; returns the files written."""
    widths = gpt_neox_widths(model_cfg.num_attention_heads)
    written: list[Path] = []
    for tag, use_mup in (("up", True), ("sp", False)):
        records = coord_data(model_cfg, cfg, widths, batch, use_mup=use_mup)
        data, image = out_dir / f"coord_check_{tag}.{rank}.csv", out_dir / f"coord_check_{tag}.{rank}.jpg"
        write_csv(records, data)
        plot(records, image, f"coordinate check ({'muP' if use_mup else 'standard'})")
        written += [data, image]
        logger.info("coord check (%s) saved to %s and %s", tag, image, data)
    return written
