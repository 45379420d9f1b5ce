"""``deepy.py --plan SCRIPT a.yml [b.yml ...] [--gpus N ...] [--json] [--key value ...]``: print the plan."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.loader import MergedConfig, apply_overrides, merge_config_files
from megatron.neox_arguments.neox_args import KNOWN_KEYS
from megatron.planner.calibrated import DEFAULT_FRAMEWORK, FRAMEWORKS
from megatron.planner.flags import add_flags, check_flags, check_gpus
from megatron.planner.gpus import GPU_TYPES, gpu_type
from megatron.planner.inputs import Hardware, parse_bytes
from megatron.planner.knobs import PLAN_ONLY_KEYS, read_plan_only_keys
from megatron.planner.plan import PlanInputs, build_plan
from megatron.planner.report import format_plan, plan_to_json, strict_json
from megatron.planner.search import (
    DEFAULT_HEADROOM,
    DEFAULT_SEARCH_SECONDS,
    KNOBS,
    VARY,
    check_fixed,
    check_varied,
    search_layouts,
)
from megatron.planner.search_report import format_search, search_to_json
from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size

FLAG_HELP = {
    "--gpus": "GPUs in all (default: the config's, else TP x PP)",
    "--gpus-per-node": "GPUs per node",
    "--peak-tflops": "peak TFLOP/s per GPU in the training dtype",
    "--intra-node-GBps": "GB/s between GPUs of a node",
    "--inter-node-GBps": "GB/s per GPU between nodes",
    "--hbm-GBps": "GPU memory bandwidth in GB/s",
    "--top": "with --search: how many layouts to list",
    "--memory-headroom": "with --search: fraction of memory kept free",
    "--search-seconds": "with --search: time budget; the best layouts found by then are listed",
    "--vocab-size": "tokenizer vocabulary (default: read the tokenizer)",
    "--kv-batch": "sequences for the generation KV-cache estimate",
    "--kv-tokens": "tokens per sequence (default: seq_length)",
}
FALLBACK_VOCAB = 50277  # the GPT-NeoX-20B tokenizer, which most GPT-NeoX configs use
GPU_NAMES = [g.name for g in GPU_TYPES.values()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepy.py --plan",
        usage="deepy.py --plan SCRIPT CONFIG [CONFIG ...] [planner flags] [--key value ...]",
        description="Print a memory and throughput plan for the configs (docs/planner.md); launches nothing.",
        allow_abbrev=False,
    )
    p.add_argument("--plan", action="store_true", help="plan instead of launching")
    p.add_argument("--gpu-type", default="A100-40GB", help=f"accelerator preset: {', '.join(GPU_NAMES)}")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 40GB, 80GiB (default: the preset's)")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit (docs/planner.md#search)")
    p.add_argument(
        "--search-fix",
        default=None,
        metavar="KNOBS",
        help=f"with --search: keep these knobs at the configured values, comma-separated: {', '.join(KNOBS)}",
    )
    p.add_argument(
        "--search-vary",
        default=None,
        metavar="KNOBS",
        help=f"with --search: also vary these layout knobs, comma-separated: {', '.join(VARY)}",
    )
    p.add_argument(
        "--framework",
        default=DEFAULT_FRAMEWORK,
        choices=list(FRAMEWORKS),
        help="whose engine the prediction applies (default: neox-forge's own; docs/planner.md#calibration)",
    )
    defaults = {"--gpus-per-node": 8, "--top": 5, "--memory-headroom": DEFAULT_HEADROOM, "--kv-batch": 1}
    add_flags(p, {**defaults, "--search-seconds": DEFAULT_SEARCH_SECONDS}, FLAG_HELP)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _merged(files: list[str], overrides: dict[str, Any]) -> MergedConfig:
    merged = merge_config_files(files, KNOWN_KEYS)
    apply_overrides(merged, overrides, KNOWN_KEYS, "the command line")
    return merged


def _default_gpus(merged: MergedConfig) -> int:
    v = merged.values
    try:
        if v.get("global_num_gpus"):
            return int(v["global_num_gpus"])
        if v.get("num_gpus"):
            return int(v["num_gpus"]) * max(int(v.get("num_nodes") or 1), 1)
        return int(v.get("model_parallel_size") or 1) * max(int(v.get("pipe_parallel_size") or 0), 1)
    except (TypeError, ValueError, OverflowError):
        keys = "global_num_gpus, num_gpus, num_nodes, model_parallel_size, pipe_parallel_size"
        raise ConfigError(f"--gpus not given and the config's {keys} are not all integers; pass --gpus N") from None


def _hardware(ns: argparse.Namespace, gpus: int) -> Hardware:
    """The preset of ``--gpu-type`` with the explicitly given flags on top."""
    g = gpu_type(ns.gpu_type)

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    return Hardware(
        gpus=gpus,
        gpus_per_node=ns.gpus_per_node,
        gpu_memory_bytes=g.memory_bytes if ns.gpu_memory is None else parse_bytes(ns.gpu_memory),
        peak_tflops=pick(ns.peak_tflops, g.peak_tflops),
        intra_node_GBps=pick(ns.intra_node_GBps, g.intra_node_GBps),
        inter_node_GBps=pick(ns.inter_node_GBps, g.inter_node_GBps),
        hbm_GBps=pick(ns.hbm_GBps, g.hbm_GBps),
    )


def resolve_vocab(tokenizer: TokenizerConfig, vocab_size: int | None = None) -> tuple[int, int, list[str]]:
    """``(vocab size, padded vocab size, notes)`` as training pads it (from the tokenizer unless ``vocab_size`` is
    given).

    A tokenizer that cannot be read (e.g. a vocab_file path on the training cluster) falls back to the
    GPT-NeoX-20B tokenizer's size; the returned note says so.
    """
    notes = []
    if vocab_size is None:
        try:
            vocab_size = int(build_tokenizer(tokenizer).vocab_size)
        except (OSError, ValueError) as e:
            notes.append(f"tokenizer not readable ({e}); assumed {FALLBACK_VOCAB} tokens, pass --vocab-size N")
            vocab_size = FALLBACK_VOCAB
    tp = tokenizer.model_parallel_size
    return vocab_size, padded_vocab_size(vocab_size, tokenizer.make_vocab_size_divisible_by, tp), notes


def _search(inputs: PlanInputs, hw: Hardware, vocab: int, ns: argparse.Namespace, out: TextIO) -> int:
    hw.check()
    try:
        fixed = check_fixed(ns.search_fix)
        varied = check_varied(ns.search_vary, fixed)
        result = search_layouts(
            inputs, hw, vocab, ns.memory_headroom, ns.search_seconds, ns.framework, fixed=fixed, varied=varied
        )
    except ValueError as e:  # the model config refuses the shape, or --search-fix/-vary names an unknown knob
        raise ConfigError(str(e)) from None
    text = strict_json(search_to_json(result, ns.top)) if ns.json else format_search(result, ns.top)
    print(text, file=out, flush=True)
    return 0


def plan_main(argv: list[str], out: TextIO | None = None) -> int:
    """Parse, plan, print to ``out`` (default stdout); raises ConfigError for bad input (deepy prints it, exits 2)."""
    ns, rest = _parser().parse_known_args(argv)
    check_flags(ns)
    cli = parse_deepy_args(rest)
    merged = _merged(cli.config_files, cli.overrides)
    gpus = ns.gpus or check_gpus(_default_gpus(merged), "the config")
    # The keys only the planner reads: checked here, left at their defaults for the launch's own checks (which
    # refuse them), and the context-parallel ranks taken out of the GPUs the data-parallel size derives from.
    plan_only = read_plan_only_keys(merged.values, merged.origins)
    cp = plan_only["context_parallel_size"]
    if gpus % cp:
        raise ConfigError(f"--gpus {gpus} is not divisible by context_parallel_size {cp}")
    overrides = {**cli.overrides, **PLAN_ONLY_KEYS, "global_num_gpus": gpus // cp}
    args = NeoXArgs.from_ymls(cli.config_files, overrides)
    hw = _hardware(ns, gpus)
    notes = [] if ns.gpus else [f"--gpus not given: planning for {gpus} GPUs"]
    vocab, padded, vocab_notes = resolve_vocab(TokenizerConfig.from_neox_args(args), ns.vocab_size)
    notes += vocab_notes
    try:
        inputs = PlanInputs.from_neox_args(args, padded, plan_only)
    except ValueError as e:  # the model config refuses the shape
        raise ConfigError(str(e)) from None
    for flag, value in (("--search-fix", ns.search_fix), ("--search-vary", ns.search_vary)):
        if value is not None and not ns.search:
            raise ConfigError(f"{flag}: only with --search")
    if ns.search:
        return _search(inputs, hw, vocab, ns, out or sys.stdout)
    try:
        plan = build_plan(inputs, hw, kv_batch=ns.kv_batch, kv_tokens=ns.kv_tokens, notes=notes, framework=ns.framework)
    except ValueError as e:  # the model config refuses the shape
        raise ConfigError(str(e)) from None
    print(strict_json(plan_to_json(plan)) if ns.json else format_plan(plan), file=out or sys.stdout, flush=True)
    return 0
