"""Plot one or more training runs from their TensorBoard logs.

    python tools/plot_run.py runs/quickstart [runs/other ...] [--out report.png|report.html] [--smoothing 0.6]

Each argument is a run folder or a ``tensorboard_dir`` (every event file below it is read). Panels: loss (train raw
and smoothed, validation), learning rate, grad norm, tokens/s, MFU and memory over iterations; several runs are
overlaid, one colour each. Writes a PNG (default ``report.png``) or, for ``--out *.html``, a self-contained page.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.dirname(os.path.dirname(__file__))))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.setup_check import require


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_TB_DIR", help="run folders or TensorBoard folders")
    p.add_argument("--out", default="report.png", help="output .png (default report.png) or .html")
    p.add_argument("--smoothing", type=float, default=0.6, help="EMA weight of the smoothed curves, 0 to <1")
    p.add_argument("--names", nargs="+", default=None, help="legend names, one per run (default: folder names)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Read the runs, draw, write; returns the exit status (2 for bad input)."""
    require("matplotlib", "tensorboard")
    from megatron.logging.run_report import build_figure, read_run, write_report

    args = parse_args(argv)
    try:
        if not 0.0 <= args.smoothing < 1.0:
            raise ValueError(f"--smoothing {args.smoothing}: must be in [0, 1)")
        if args.names and len(args.names) != len(args.runs):
            raise ValueError(f"--names: {len(args.names)} names for {len(args.runs)} runs")
        names = args.names or [None] * len(args.runs)
        runs = [read_run(path, name) for path, name in zip(args.runs, names)]
        for i, run in enumerate(runs):  # two folders with the same name: number them in the legend
            if any(r.name == run.name for r in runs[:i]):
                run.name = f"{run.name} ({i + 1})"
        out = write_report(build_figure(runs, args.smoothing), runs, args.out)
    except ValueError as e:
        print(f"plot_run.py: error: {e}", file=sys.stderr)
        return 2
    print(f"run report written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
