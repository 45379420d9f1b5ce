"""deepy.py's command line: ``deepy.py SCRIPT [-d DIR] a.yml [b.yml ...] [--key value ...] [--dry-run]``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.keys import HINTS, KNOWN_KEYS
from megatron.neox_arguments.loader import normalize_key, unknown_key_message
from megatron.neox_arguments.types import parse_cli_value


@dataclass
class DeepyArgs:
    """What the deepy command line asked for."""

    user_script: str
    config_files: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    run_dir: str | None = None


def _iteration(text: str) -> int:
    """``--iteration``: an integer, refused in a short message when too long to be one (argparse would echo it)."""
    if len(text.strip()) > 20 or not text.strip().lstrip("+-").isdigit():
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(f"expected a checkpoint iteration (an integer), got {shown!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepy.py",
        allow_abbrev=False,
        description="Validate GPT-NeoX configs and launch SCRIPT on every rank through DeepSpeed. "
        "Any config key can be overridden with --key value.",
    )
    p.add_argument("user_script", help="script to run on every rank (train.py, generate.py, eval.py)")
    p.add_argument("conf_file", nargs="+", help="config files, merged in order (.yml appended when missing)")
    p.add_argument("-d", "--conf_dir", default=None, help="directory prefixed to every config file")
    p.add_argument("-H", "--hostfile", default=None, help="hostfile (hostname slots=N per line)")
    p.add_argument("-i", "--sample_input_file", default=None, help="prompts file for generation")
    p.add_argument("-o", "--sample_output_file", default=None, help="output file for generation")
    p.add_argument("--wandb_group", default=None)
    p.add_argument("--wandb_run_name", default=None)
    p.add_argument("--wandb_team", default=None)
    p.add_argument("--eval_tasks", nargs="+", default=None, help="lm-eval tasks or local task directories")
    p.add_argument("--iteration", type=_iteration, default=None, help="checkpoint iteration to load")
    p.add_argument("--eval_results_prefix", default=None)
    p.add_argument(
        "--autotuning",
        choices=["tune", "run"],
        default=None,
        help="run DeepSpeed's autotuner (docs/planner.md)",
    )
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="validate, print, don't launch")
    p.add_argument("--run_dir", default=None, help="folder for the resolved config (default under log_dir or runs/)")
    return p


def _config_path(name: str, conf_dir: str | None) -> str:
    if not name.endswith((".yml", ".yaml", ".json")):
        name += ".yml"
    return os.path.join(conf_dir, name) if conf_dir else name


def _parse_overrides(extra: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` / bare ``--flag`` (true) pairs, values typed by the key."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or tok == "--":
            problems.append(f"unexpected argument {tok!r} on the command line; overrides are written --key value")
            i += 1
            continue
        raw, eq, text = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                text, i = extra[i + 1], i + 1
            else:
                text = "true"
        i += 1
        key = normalize_key(raw)
        if key not in KNOWN_KEYS:
            problems.append(unknown_key_message(f"--{raw}", "the command line", {f"--{k}" for k in KNOWN_KEYS}))
            continue
        try:
            out[key] = parse_cli_value(text, HINTS[key])
        except ConfigError as e:  # a value the parser refuses (an integer too long to convert, an alias bomb)
            problems.append(f"--{raw} on the command line: {e}")
    if problems:
        raise ConfigError(problems)
    return out


def parse_deepy_args(argv: list[str]) -> DeepyArgs:
    """Parse deepy's argv (without the program name). Raises ConfigError on bad input."""
    parser = _parser()
    ns, extra = parser.parse_known_args(argv)
    if not os.path.isfile(ns.user_script):
        raise ConfigError(f"script not found: {ns.user_script}")
    overrides = _parse_overrides(extra)
    eval_tasks = ns.eval_tasks
    if eval_tasks and len(eval_tasks) == 1 and eval_tasks[0].lstrip().startswith("["):
        # `--eval_tasks '["lambada"]'`: a list literal, as any other list key is written on this command line
        eval_tasks = parse_cli_value(eval_tasks[0], HINTS["eval_tasks"])
    named = {
        "hostfile": ns.hostfile,
        "sample_input_file": ns.sample_input_file,
        "sample_output_file": ns.sample_output_file,
        "wandb_group": ns.wandb_group,
        "wandb_run_name": ns.wandb_run_name,
        "wandb_team": ns.wandb_team,
        "eval_tasks": eval_tasks,
        "iteration": ns.iteration,
        "eval_results_prefix": ns.eval_results_prefix,
        "autotuning_run": ns.autotuning,
    }
    overrides.update({k: v for k, v in named.items() if v is not None})
    overrides["user_script"] = ns.user_script
    files = [_config_path(c, ns.conf_dir) for c in ns.conf_file]
    return DeepyArgs(ns.user_script, files, overrides, ns.dry_run, ns.run_dir)
