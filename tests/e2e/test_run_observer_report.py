"""Watching a run: ETA and per-rank memory in the log lines and in TensorBoard, the end-of-run summary line, and
``tools/plot_run.py``'s report drawn from a real 2-rank run's TensorBoard logs (series read back from the figure)."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import pytest

from megatron.logging.run_report import build_figure, read_run, smooth, write_report
from megatron.logging.wandb_reader import find_run_files, read_wandb_history
from tests.distributed.fns_train import deepy_train, make_tiny_data, tensorboard_scalars, tiny_config
from tests.harness import PYTHON, REPO_ROOT, free_port, run_command

pytestmark = pytest.mark.distributed
ITERS, LOG_INTERVAL = 12, 3


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``deepy.py train.py`` on 2 CPU ranks (DP=2, tiny model): the run folder and rank 0's output."""
    tmp = tmp_path_factory.mktemp("observe")
    data = make_tiny_data(tmp / "data")
    run = tmp / "run"
    cfg = tiny_config(
        data,
        world=2,
        train_iters=ITERS,
        eval_interval=6,
        eval_iters=1,
        log_interval=LOG_INTERVAL,
        save=str(run / "checkpoints"),
        checkpoint_factor=6,
        tensorboard_dir=str(run / "tensorboard"),
        log_dir=str(run / "logs"),
        use_wandb=True,
        wandb_project="neox-forge-test",
        log_grad_norm=True,
        peak_theoretical_tflops=1.0,
        master_port=free_port(),
    )
    out = deepy_train(cfg, tmp / "observe.yml", world=2)
    assert f"training finished at iteration {ITERS}" in out
    return run, out


def test_log_lines_carry_eta_and_per_rank_memory(two_rank_run: tuple[Path, str]) -> None:
    run, out = two_rank_run
    lines = [ln for ln in out.splitlines() if re.match(rf"^iteration\s+\d+/\s+{ITERS} \|", ln)]
    assert len(lines) == ITERS // LOG_INTERVAL
    etas = []
    for line in lines:
        h, m, s = map(int, re.search(r"\| ETA: (\d+):(\d\d):(\d\d) \|", line).groups())
        etas.append(3600 * h + 60 * m + s)
        mem = re.search(r"\| memory \(GB\) rss/peak: r0 ([\d.]+)/([\d.]+) r1 ([\d.]+)/([\d.]+) \|", line)
        assert mem, line
        rss0, peak0, rss1, peak1 = map(float, mem.groups())
        assert 0.05 < rss0 <= peak0 < 64 and 0.05 < rss1 <= peak1 < 64  # a torch process: >50 MB, <64 GB
    assert etas[-1] == 0  # nothing left at the last iteration

    tb = tensorboard_scalars(run / "tensorboard")
    eta = tb["runtime/eta_seconds"]
    assert [s for s, _ in eta] == list(range(LOG_INTERVAL, ITERS + 1, LOG_INTERVAL))
    assert eta[-1][1] == 0.0 and all(v >= 0 for _, v in eta)
    assert eta[0][1] > 0  # 9 iterations left after the first interval
    for line, (_, value) in zip(lines, eta):  # the console shows the logged value, rounded to seconds
        h, m, s = map(int, re.search(r"ETA: (\d+):(\d\d):(\d\d)", line).groups())
        assert abs(3600 * h + 60 * m + s - value) <= 0.5 + 1e-6
    for key in ("rss_gb", "peak_rss_gb"):
        rank_values = [tb[f"memory/rank{r}/{key}"] for r in (0, 1)]
        assert all(len(v) == len(lines) for v in rank_values)
        largest = [max(a[1], b[1]) for a, b in zip(*rank_values)]
        assert [v for _, v in tb[f"memory/{key}"]] == pytest.approx(largest)
    (wandb_file,) = find_run_files(run / "logs")  # the same scalars in (offline) W&B
    rows = [r for r in read_wandb_history(wandb_file) if "runtime/eta_seconds" in r]
    assert [r["_step"] for r in rows] == [s for s, _ in eta]
    assert [r["runtime/eta_seconds"] for r in rows] == pytest.approx([v for _, v in eta], rel=1e-6)
    assert [r["memory/rank1/peak_rss_gb"] for r in rows] == pytest.approx(
        [v for _, v in tb["memory/rank1/peak_rss_gb"]], rel=1e-6
    )
    first = re.search(r"r0 ([\d.]+)/([\d.]+) r1", lines[-1]).groups()
    assert float(first[0]) == pytest.approx(tb["memory/rank0/rss_gb"][-1][1], abs=0.006)
    assert float(first[1]) == pytest.approx(tb["memory/rank0/peak_rss_gb"][-1][1], abs=0.006)


def test_end_of_run_summary_line(two_rank_run: tuple[Path, str]) -> None:
    run, out = two_rank_run
    (summary,) = [ln for ln in out.splitlines() if ln.startswith("run summary |")]
    fields = dict(part.split(": ", 1) for part in summary.split(" | ")[1:])
    assert fields["steps"] == f"{ITERS} (iterations 0 to {ITERS})"
    assert fields["tokens seen"] == f"{ITERS * 8 * 32:,}"  # iterations x global batch (2 ranks x 4) x seq 32
    assert re.fullmatch(r"\d+:\d\d:\d\d", fields["wall time"])
    assert float(fields["mean tokens/sec"]) > 0
    tb = tensorboard_scalars(run / "tensorboard")
    mfu = [v for _, v in tb["runtime/model_flops_utilization"]]
    assert float(fields["mean MFU (%)"]) == pytest.approx(sum(mfu) / len(mfu), abs=0.006)
    best = min(v for _, v in tb["validation/lm_loss"])
    assert float(fields["best validation lm_loss"]) == pytest.approx(best, rel=1e-5)
    assert fields["last checkpoint"] == str(run / "checkpoints" / f"global_step{ITERS}")
    assert (run / "checkpoints" / f"global_step{ITERS}").is_dir()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_run_report_matches_logged_values(two_rank_run: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = two_rank_run
    tb = tensorboard_scalars(run / "tensorboard")
    out = run_command([PYTHON, "tools/plot_run.py", str(run), "--out", str(tmp_path / "r.png")]).stdout
    assert f"run report written to {tmp_path / 'r.png'}" in out
    png = tmp_path / "r.png"
    assert png.stat().st_size > 30_000  # six panels of lines and text, not an empty canvas
    assert _png_size(png) == (1500, 850)

    # the same report in-process: every series in the figure equals what the run logged
    runs = [read_run(run)]
    fig = build_figure(runs)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    name = runs[0].name
    for tag in ("train/lm_loss", "train/learning_rate", "train/grad_norm", "runtime/tokens_per_sec",
                "runtime/model_flops_utilization", "memory/peak_rss_gb", "memory/rss_gb"):  # fmt: skip
        steps, values = lines[f"{name}|{tag}|raw"].get_data()
        assert list(steps) == [s for s, _ in tb[tag]], tag
        assert list(values) == pytest.approx([v for _, v in tb[tag]], rel=1e-6), tag
    steps, values = lines[f"{name}|validation/lm_loss|points"].get_data()
    last_per_step = dict(tb["validation/lm_loss"])  # iteration 12 has two: in the loop and the final validation
    assert list(steps) == [6, 12]
    assert list(values) == pytest.approx([last_per_step[6], last_per_step[12]], rel=1e-6)
    _, smoothed = lines[f"{name}|train/lm_loss|smoothed"].get_data()
    assert list(smoothed) == pytest.approx(smooth([v for _, v in tb["train/lm_loss"]]), rel=1e-6)
    assert smoothed[-1] < smoothed[0]  # the loss falls
    assert len(tb["train/lm_loss"]) == ITERS


def test_plot_run_overlays_runs_and_writes_self_contained_html(two_rank_run: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = two_rank_run
    runs = [read_run(run, "a"), read_run(run / "tensorboard", "b")]
    fig = build_figure(runs)
    loss_ax = fig.axes[0]
    gids = {line.get_gid() for line in loss_ax.get_lines()}
    assert {"a|train/lm_loss|raw", "b|train/lm_loss|raw", "a|validation/lm_loss|points"} <= gids
    colours = {line.get_gid(): line.get_color() for line in loss_ax.get_lines()}
    assert colours["a|train/lm_loss|raw"] != colours["b|train/lm_loss|raw"]
    assert write_report(fig, runs, tmp_path / "inproc.html").read_text().count("<h2>") == 2
    html = tmp_path / "report.html"  # the CLI, two folders of one run: legend names numbered
    run_command([PYTHON, "tools/plot_run.py", str(run), str(run / "tensorboard"), "--out", str(html)])
    page = html.read_text()
    assert "<h2>run</h2>" in page and "<h2>run (2)</h2>" in page
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "http://" not in page.split("<svg", 1)[0] and "<script src" not in page  # nothing fetched
    step, value = tensorboard_scalars(run / "tensorboard")["train/lm_loss"][-1]
    assert page.count(f"<td>{value:.6g} (iteration {step})</td>") == 2  # both runs' tables
    assert math.isfinite(value)


def test_plot_run_refuses_a_folder_without_event_files(tmp_path: Path) -> None:
    result = run_command([PYTHON, str(REPO_ROOT / "tools/plot_run.py"), str(tmp_path)], check=False, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"plot_run.py: error: {tmp_path}: no TensorBoard event files " + (
        "(events.out.tfevents.*) in it or below it"
    )
    assert list(tmp_path.iterdir()) == []  # no partial report
