"""``deepy.py --autotune SCRIPT a.yml [b.yml ...] [--candidates N] [--steps N] [planner flags] [--key value ...]``.

The planner's search (:mod:`megatron.planner.search`) ranks the parallel layouts that fit this machine by their
predicted step time; the best ``--candidates`` of them are each trained for ``--warmup-steps + --steps`` real steps,
every one a separate ``deepy.py`` launch of the user's script (the launch path of any run), and the one with the
fastest measured step time is written out as a full config YAML. A table compares measured and predicted times.

Each trial runs a config written to its own folder (``<out>/trial-K/config.yml``, the merged user config with the
layout's keys and the measurement's keys: no checkpoints, no evaluation, a log line every step) and writes its
output to ``<out>/trial-K/deepy.log``; the step time is the median of the measured steps' ``elapsed time per
iteration`` (docs/planner.md#autotune).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, TextIO

import yaml

from megatron.launcher.threads import threads_per_rank
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.loader import apply_overrides, merge_config_files
from megatron.neox_arguments.neox_args import KNOWN_KEYS
from megatron.neox_arguments.precision import dtype_of_precision
from megatron.neox_arguments.ranges import Range
from megatron.planner.flags import Flag, add_flags, check_flags
from megatron.planner.gpus import gpu_type
from megatron.planner.inputs import Hardware, parse_bytes
from megatron.planner.plan import PlanInputs
from megatron.planner.search import DEFAULT_HEADROOM, Candidate, search_layouts

DEEPY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepy.py")
STEP_LINE = re.compile(r"^iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)", re.M)
# A CPU rank's links for the prediction: gloo over loopback / shared memory, and DRAM per rank (nominal figures:
# pass --intra-node-GBps / --hbm-GBps to change them)
CPU_LINK_GBPS = 5.0
CPU_DRAM_GBPS = 10.0
AUTOTUNE_FLAGS: tuple[Flag, ...] = (
    Flag("--candidates", Range(1, 64), integer=True),
    Flag("--steps", Range(1, 10**6), integer=True),
    Flag("--warmup-steps", Range(0, 10**6), integer=True),
    Flag("--trial-seconds", Range(1, 86400), integer=False),
)
HELP = {
    "--gpus": "ranks in all (default: the config's)",
    "--gpus-per-node": "ranks per node (default: all of them)",
    "--peak-tflops": "peak TFLOP/s per rank (CPU default: a GEMM calibration)",
    "--intra-node-GBps": f"GB/s between ranks of a node (CPU default: {CPU_LINK_GBPS})",
    "--inter-node-GBps": "GB/s per rank between nodes",
    "--hbm-GBps": f"memory bandwidth per rank in GB/s (CPU default: {CPU_DRAM_GBPS})",
    "--top": "unused by --autotune",
    "--memory-headroom": "fraction of memory kept free",
    "--search-seconds": "time budget of the planner's search",
    "--vocab-size": "tokenizer vocabulary (default: read the tokenizer)",
    "--kv-batch": "unused by --autotune",
    "--kv-tokens": "unused by --autotune",
    "--candidates": "layouts to measure: the planner's best that fit (default 3)",
    "--steps": "measured training steps per layout (default 5)",
    "--warmup-steps": "steps run before the measured ones (default 2)",
    "--trial-seconds": "time limit of one layout's launch (default 900)",
}


@dataclass
class Trial:
    """One measured layout."""

    candidate: Candidate
    folder: str
    exit_status: int | None = None
    step_times: list[float] | None = None  # seconds, the measured steps'
    problem: str | None = None

    @property
    def measured_s(self) -> float | None:
        """Median measured step time in seconds, None when the trial failed."""
        return statistics.median(self.step_times) if self.step_times else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepy.py --autotune",
        usage="deepy.py --autotune SCRIPT CONFIG [CONFIG ...] [--candidates N] [--steps N] [--key value ...]",
        description="Measure the planner's best layouts for a few real steps each and write the fastest as a config.",
        allow_abbrev=False,
    )
    p.add_argument("--autotune", action="store_true")
    p.add_argument("--gpu-type", default=None, help="accelerator preset on a GPU machine (default A100-40GB)")
    p.add_argument("--gpu-memory", default=None, help="memory per rank, e.g. 40GB (default: this machine's)")
    p.add_argument("--out", default=None, help="folder for the trials and the config (default: runs/autotune-TIME)")
    defaults: dict[str, float | None] = {"--memory-headroom": DEFAULT_HEADROOM, "--search-seconds": 30.0}
    add_flags(p, defaults, HELP)
    for flag, default in zip(AUTOTUNE_FLAGS, (3, 5, 2, 900.0), strict=True):
        p.add_argument(flag.name, default=str(default), help=HELP[flag.name])
    return p


def machine_hardware(ns: argparse.Namespace, ranks: int, precision: str) -> tuple[Hardware, str]:
    """The hardware the prediction assumes: this machine's GPUs (a preset) or its CPU ranks (RAM per rank, a GEMM
    calibration on each rank's threads, nominal links); returns it and a line saying where the figures came from."""
    import psutil
    import torch

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    per_node = ns.gpus_per_node or ranks
    if torch.cuda.is_available():
        g = gpu_type(ns.gpu_type or "A100-40GB")
        memory = torch.cuda.get_device_properties(0).total_memory
        hw = Hardware(ranks, per_node, memory, pick(ns.peak_tflops, g.peak_tflops), pick(ns.intra_node_GBps, g.intra_node_GBps),
                      pick(ns.inter_node_GBps, g.inter_node_GBps), pick(ns.hbm_GBps, g.hbm_GBps))  # fmt: skip
        source = f"{g.name} preset, {memory / 1e9:.1f} GB per GPU"
    else:
        from megatron.logging.peak_flops import calibrate_gemm_tflops

        threads, _ = threads_per_rank(min(ranks, per_node), os.environ)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            dtype = dtype_of_precision(precision)
            peak = ns.peak_tflops or calibrate_gemm_tflops(dtype)
        finally:
            torch.set_num_threads(before)
        memory = int(psutil.virtual_memory().available // min(ranks, per_node))
        hw = Hardware(ranks, per_node, memory, peak, pick(ns.intra_node_GBps, CPU_LINK_GBPS),
                      pick(ns.inter_node_GBps, CPU_LINK_GBPS), pick(ns.hbm_GBps, CPU_DRAM_GBPS))  # fmt: skip
        source = f"CPU ranks: {peak:.3f} TFLOP/s per rank ({threads} threads), {memory / 1e9:.1f} GB per rank"
    if ns.gpu_memory is not None:
        hw = replace(hw, gpu_memory_bytes=parse_bytes(ns.gpu_memory))
    hw.check()
    return hw, source


def layout_values(values: dict[str, Any], c: Candidate) -> dict[str, Any]:
    """``values`` (a merged config) with the layout of ``c``: TP, PP, ZeRO stage, micro-batch, accumulation,
    checkpointing; the global batch stays."""
    zero = dict(values.get("zero_optimization") or {})
    zero["stage"] = c.zero_stage
    out = {k: v for k, v in values.items() if k not in ("train_batch_size", "user_script")}
    out.update(
        model_parallel_size=c.tp,
        pipe_parallel_size=c.pp,
        zero_optimization=zero,
        train_micro_batch_size_per_gpu=c.micro_batch,
        gradient_accumulation_steps=c.gas,
        train_batch_size=c.micro_batch * c.gas * c.dp,
        checkpoint_activations=c.checkpoint_activations,
    )
    return out


def trial_values(values: dict[str, Any], c: Candidate, steps: int, folder: str) -> dict[str, Any]:
    """The layout's config for a measurement: ``steps`` iterations, a log line each, no checkpoint, evaluation,
    TensorBoard or W&B; the ranks' output teed into ``folder``."""
    out = layout_values(values, c)
    out.update(train_iters=steps, log_interval=1, steps_per_print=1, save=None, load=None, eval_interval=steps + 1,
               eval_iters=0, tensorboard_dir=None, use_wandb=False, log_dir=folder, eval_tasks=None)  # fmt: skip
    return out


def write_yaml(path: str, values: dict[str, Any], header: str = "") -> None:
    """Write ``values`` as YAML (``header``: comment lines first)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(values, f, sort_keys=True, default_flow_style=None)


def step_times(log: str, skip: int) -> list[float]:
    """Seconds per step of the logged iterations after the first ``skip``."""
    return [float(ms) / 1000 for it, ms in STEP_LINE.findall(log) if int(it) > skip]


def run_trial(script: str, trial: Trial, values: dict[str, Any], ns: argparse.Namespace, out: TextIO) -> None:
    """Launch one layout with ``deepy.py`` and read its step times from the output."""
    os.makedirs(trial.folder, exist_ok=True)
    config = os.path.join(trial.folder, "config.yml")
    total = ns.warmup_steps + ns.steps
    write_yaml(config, trial_values(values, trial.candidate, total, trial.folder))
    log_path = os.path.join(trial.folder, "deepy.log")
    argv = [sys.executable, DEEPY, script, config, "--run_dir", os.path.join(trial.folder, "run")]
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            trial.exit_status = proc.wait(timeout=ns.trial_seconds)
        except subprocess.TimeoutExpired:
            proc.terminate()  # deepy relays it to its ranks and waits for them
            trial.exit_status = proc.wait()
            trial.problem = f"stopped after {ns.trial_seconds:g} s (--trial-seconds)"
        except KeyboardInterrupt:
            proc.wait()  # the terminal's Ctrl-C reached deepy too: it stops its ranks
            raise
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    times = step_times(text, ns.warmup_steps)
    if trial.exit_status == 0 and len(times) >= ns.steps:
        trial.step_times = times
    elif trial.problem is None:
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["no output"]
        trial.problem = f"exit status {trial.exit_status}: {last[0][:200]} (see {log_path})"


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:#.4g}"  # significant digits: CPU steps can be milliseconds


def format_table(trials: list[Trial]) -> str:
    """Measured vs predicted step time of each layout, in the planner's order."""
    head = ("#", "TP", "PP", "DP", "ZeRO", "micro", "GAS", "ckpt", "predicted s", "measured s", "measured/predicted")
    rows = [head]
    for i, t in enumerate(trials, 1):
        c = t.candidate
        predicted = c.predicted.step_s if c.predicted else None
        ratio = f"{t.measured_s / predicted:.2f}" if t.measured_s and predicted else (t.problem or "-")
        rows.append((str(i), str(c.tp), str(c.pp), str(c.dp), str(c.zero_stage), str(c.micro_batch), str(c.gas),
                     "yes" if c.checkpoint_activations else "no", _fmt_s(predicted), _fmt_s(t.measured_s), ratio))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


def autotune_main(argv: list[str], out: TextIO | None = None) -> int:
    """Search, measure, write the fastest layout's config; 0 when one was written, 1 when every trial failed."""
    out = out or sys.stdout
    ns, rest = _parser().parse_known_args(argv)
    check_flags(ns)
    check_flags(ns, AUTOTUNE_FLAGS)
    cli = parse_deepy_args(rest)
    merged = merge_config_files(cli.config_files, KNOWN_KEYS)
    apply_overrides(merged, cli.overrides, KNOWN_KEYS, "the command line")
    args = NeoXArgs.from_ymls(cli.config_files, cli.overrides)
    ranks = ns.gpus or args.global_num_gpus
    if ranks != args.global_num_gpus:
        args = NeoXArgs.from_ymls(cli.config_files, {**cli.overrides, "global_num_gpus": ranks})
    hw, source = machine_hardware(ns, ranks, args.precision)
    from megatron.planner.cli import resolve_vocab
    from megatron.tokenizer import TokenizerConfig

    vocab, padded, _ = resolve_vocab(TokenizerConfig.from_neox_args(args), ns.vocab_size)
    try:
        result = search_layouts(
            PlanInputs.from_neox_args(args, padded), hw, vocab, ns.memory_headroom, ns.search_seconds
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not result.layouts:
        raise ConfigError(f"no layout of {ranks} ranks fits ({source}); see deepy.py --plan --search")
    folder = ns.out or os.path.join("runs", time.strftime("autotune-%Y%m%d-%H%M%S", time.gmtime()))
    picked = result.layouts[: ns.candidates]
    print(f"autotune: {len(picked)} of {len(result.layouts)} layouts that fit, on {source}", file=out, flush=True)
    trials = [Trial(c, os.path.join(folder, f"trial-{i}")) for i, c in enumerate(picked, 1)]
    for i, trial in enumerate(trials, 1):
        print(f"autotune: measuring layout {i}/{len(trials)} in {trial.folder}", file=out, flush=True)
        run_trial(cli.user_script, trial, merged.values, ns, out)
    table = format_table(trials)
    print(table, file=out)
    done = [t for t in trials if t.measured_s is not None]
    if not done:
        print("autotune: every layout failed; see the deepy.log of each trial", file=out, flush=True)
        return 1
    best = min(done, key=lambda t: t.measured_s or 0.0)
    path = os.path.join(folder, "autotuned.yml")
    header = f"written by deepy.py --autotune ({source})\n{table}"
    write_yaml(path, layout_values(merged.values, best.candidate), header)
    print(f"autotune: fastest measured layout #{trials.index(best) + 1}: {best.measured_s:.4f} s per step", file=out)
    print(f"autotune: config written to {path}", file=out, flush=True)
    return 0


__all__ = ["autotune_main", "format_table", "layout_values", "step_times", "trial_values"]
