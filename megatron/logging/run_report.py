"""A run report from TensorBoard logs: loss, learning rate, grad norm, tokens/s, MFU and memory over steps.

``read_run(path)`` reads every TensorBoard event file under a run folder (or a ``tensorboard_dir``) into
``{tag: (steps, values)}``; ``build_figure(runs)`` draws one panel per quantity with the runs overlaid (one colour
per run); ``write_report(figure, runs, out)`` writes a PNG, or a self-contained HTML page (the figure as inline
SVG plus a table of each run's last and best values). Every plotted line carries ``gid = "<run>|<tag>|<kind>"``
(kind ``raw``, ``smoothed`` or ``points``) so that a caller can find the data of each series in the figure.
"""

from __future__ import annotations

import html
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENT_FILE_MARK = "tfevents"
DEFAULT_SMOOTHING = 0.6  # TensorBoard's default EMA weight

# (title, y label, [(tag, legend label, kind)]); kind "smoothed" draws the raw series faintly plus its EMA
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    (
        "loss",
        "lm loss (nats/token)",
        [("train/lm_loss", "train", "smoothed"), ("validation/lm_loss", "validation", "points")],
    ),
    ("learning rate", "learning rate", [("train/learning_rate", "lr", "raw")]),
    ("grad norm", "global grad norm", [("train/grad_norm", "grad norm", "smoothed")]),
    ("throughput", "tokens/s", [("runtime/tokens_per_sec", "tokens/s", "raw")]),
    ("MFU", "model FLOPs utilisation (%)", [("runtime/model_flops_utilization", "MFU", "raw")]),
    (
        "memory (max over ranks)",
        "GiB",
        [
            ("memory/peak_rss_gb", "peak RSS", "raw"),
            ("memory/rss_gb", "RSS", "raw"),
            ("memory/peak_allocated_gb", "CUDA peak allocated", "raw"),
        ],
    ),
]


@dataclass
class Run:
    """One run's scalars: ``series[tag] = (steps, values)`` in step order."""

    name: str
    path: str
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)


def event_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """Folders under ``path`` (itself included) that hold TensorBoard event files."""
    root = Path(path)
    if root.is_file() and EVENT_FILE_MARK in root.name:
        return [root.parent]
    if not root.is_dir():
        raise ValueError(f"{path}: no such run folder or TensorBoard folder")
    found = sorted({p.parent for p in root.rglob(f"*{EVENT_FILE_MARK}*") if p.is_file()})
    if not found:
        raise ValueError(f"{path}: no TensorBoard event files (events.out.tfevents.*) in it or below it")
    return found


def run_name(path: str | os.PathLike[str]) -> str:
    """The run folder's name (``runs/x/tensorboard`` -> ``x``)."""
    p = Path(path).resolve()
    return p.parent.name if p.name in ("tensorboard", "tb") else p.name


def read_run(path: str | os.PathLike[str], name: str | None = None) -> Run:
    """Every scalar under ``path``; where files repeat a step, the later event wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, tuple[float, float]]] = {}
    for folder in event_dirs(path):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            points = merged.setdefault(tag, {})
            for event in acc.Scalars(tag):
                if event.step not in points or points[event.step][0] <= event.wall_time:
                    points[event.step] = (event.wall_time, float(event.value))
    run = Run(name or run_name(path), str(path))
    for tag, points in merged.items():
        steps = sorted(points)
        run.series[tag] = (steps, [points[s][1] for s in steps])
    return run


def smooth(values: list[float], weight: float = DEFAULT_SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average; non-finite values pass through without updating it."""
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight**n) if weight < 1.0 else v)
    return out


def build_figure(runs: list[Run], smoothing: float = DEFAULT_SMOOTHING) -> Any:
    """A matplotlib ``Figure`` (no pyplot state): 2 x 3 panels, each run in its own colour."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, ylabel, series) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        drawn = 0
        for run, colour in zip(runs, colours):
            for j, (tag, label, kind) in enumerate(series):
                if tag not in run.series:
                    continue
                steps, values = run.series[tag]
                name = f"{run.name} {label}" if len(runs) > 1 or len(series) > 1 else label
                style = ["-", "--", ":"][j % 3]
                if kind == "points":
                    ax.plot(steps, values, "o" + style, color=colour, label=name, gid=f"{run.name}|{tag}|points")
                elif kind == "smoothed":
                    ax.plot(steps, values, style, color=colour, alpha=0.3, lw=1, gid=f"{run.name}|{tag}|raw")
                    smoothed = smooth(values, smoothing)
                    ax.plot(steps, smoothed, style, color=colour, label=name, gid=f"{run.name}|{tag}|smoothed")
                else:
                    ax.plot(steps, values, style, color=colour, label=name, gid=f"{run.name}|{tag}|raw")
                drawn += 1
        if drawn:
            ax.legend(fontsize="small")
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    names = ", ".join(r.name for r in runs)
    fig.suptitle(f"neox-forge run report: {names}" + (f" (smoothing {smoothing})" if smoothing else ""))
    return fig


def _summary_rows(run: Run) -> list[tuple[str, str, str]]:
    rows = []
    for _, _, series in PANELS:
        for tag, _, _ in series:
            if tag in run.series:
                steps, values = run.series[tag]
                finite = [v for v in values if math.isfinite(v)]
                best = min(finite) if finite and "loss" in tag else None
                last = f"{values[-1]:.6g} (iteration {steps[-1]})"
                rows.append((tag, last, "" if best is None else f"{best:.6g}"))
    return rows


def render_html(fig: Any, runs: list[Run]) -> str:
    """A self-contained page: the figure as inline SVG and a table of last/best values per run."""
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    body = svg.getvalue()
    body = body[body.index("<svg") :]
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>neox-forge run report</title>',
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}svg{max-width:100%;height:auto}</style>",
        "</head><body>",
        f"<h1>Run report: {html.escape(', '.join(r.name for r in runs))}</h1>",
        body,
    ]
    for run in runs:
        parts.append(f"<h2>{html.escape(run.name)}</h2><p>{html.escape(run.path)}</p>")
        parts.append("<table><tr><th>series</th><th>last value</th><th>best</th></tr>")
        for tag, last, best in _summary_rows(run):
            parts.append(f"<tr><td>{html.escape(tag)}</td><td>{last}</td><td>{best}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(fig: Any, runs: list[Run], out: str | os.PathLike[str]) -> Path:
    """Write ``out`` (``.png`` or ``.html``) atomically; returns its path."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise ValueError(f"--out {out}: the report is a .png or an .html file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if suffix == ".png":
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        fig.savefig(tmp, format="png")
    else:
        tmp.write_text(render_html(fig, runs), encoding="utf-8")
    os.replace(tmp, out)
    return out
