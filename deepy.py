#!/usr/bin/env python
"""GPT-NeoX's launcher: ``python deepy.py train.py [-d DIR] a.yml [b.yml ...] [--key value ...] [--dry-run]``.

``python deepy.py --plan train.py a.yml [--gpus N ...] [--json]`` prints a memory and throughput plan instead;
``python deepy.py --autotune train.py a.yml [--candidates N]`` measures the plan's best layouts (docs/planner.md).

Merges and validates the configs, writes the resolved config to a run folder and starts the script on every
rank through DeepSpeed's runner. Config errors are printed without a traceback and exit with status 2. SIGTERM,
SIGUSR1, SIGHUP and Ctrl-C reach every rank, deepy waits for them and exits with their status (42 after a
preemption save, 143 with one line when there was nothing to save yet; a second Ctrl-C within 5 s kills them):
docs/reliability.md, "Signals to deepy.py".
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.console import safe_console
from megatron.errors import UserError
from megatron.launcher.config import LauncherConfig
from megatron.launcher.exit_reports import ExitReports
from megatron.launcher.launch import (
    default_run_dir,
    launch,
    launch_wandb_group,
    plan_launch,
    run_cluster,
    write_run_dir,
)
from megatron.launcher.multinode import cluster_command, is_multinode
from megatron.launcher.secrets import install_log_redaction, redact
from megatron.launcher.supervise import SignalQueue, stopped_before_launch
from megatron.logging.comet import check_comet
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.size_checks import check_fits_machine


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    safe_console()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--plan" in argv:  # memory and throughput plan, no launch (docs/planner.md)
            # only the plan goes to stdout (``--json`` is read by machines); DeepSpeed's import-time log lines go to
            # stderr. DeepSpeed is imported here: not before deepy has set DS_ACCELERATOR.
            out = sys.stdout
            with contextlib.redirect_stdout(sys.stderr):
                from megatron.planner.cli import plan_main

                return plan_main(argv, out)
        if "--autotune" in argv:  # the planner's best layouts, each trained a few steps (docs/planner.md#autotune)
            from megatron.launcher.autotune import autotune_main

            return autotune_main(argv)
        signals = SignalQueue().install()  # a stop signal from here on is acted on, never a traceback or lost
        try:
            return _launch(argv, signals)
        finally:
            signals.uninstall()
    except UserError as e:  # the config, or a variable of the launch environment
        print(f"deepy.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an unwritable log_dir or run folder
        where = e.filename if e.filename is not None else "a file"
        print(f"deepy.py: error: cannot create or write {where}: {e.strerror or e}", file=sys.stderr)
        return 2


def _launch(argv: list[str], signals: SignalQueue) -> int:
    """Validate, write the run folder, start the ranks (or print the command for ``--dry-run``)."""
    cli = parse_deepy_args(argv)
    args = NeoXArgs.from_ymls(cli.config_files, cli.overrides)
    # Sized against this machine only when its ranks start here now (a dry run may check a GPU config on a laptop).
    launcher = LauncherConfig.from_neox_args(args)
    here = not (cli.dry_run or is_multinode(launcher) or args.deepspeed_slurm or args.launcher == "slurm")
    check_fits_machine(args, training=os.path.basename(cli.user_script) == "train.py", local=here)
    if not cli.dry_run and os.path.basename(cli.user_script) in ("train.py", "eval.py"):
        check_comet(args.use_comet)  # comet_ml and its API key, before any rank starts (the ranks check it again)
    group = launch_wandb_group(args.use_wandb, args.wandb_group)
    if group != args.wandb_group:  # fixed once per launch: resolved again, never changed after validation
        args = NeoXArgs.from_ymls(cli.config_files, {**cli.overrides, "wandb_group": group})
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)  # an unwritable log_dir fails here, not on every rank
    plan = plan_launch(launcher, cli.run_dir or default_run_dir(args.log_dir))
    print("-------------------- resolved configuration --------------------")
    print(args.format_config())
    for note in plan.notes:
        print(f"note: {note}")
    if plan.threads:
        print(plan.threads)
    cluster = cluster_command(launcher, plan.config_path, plan.run_dir) if is_multinode(launcher) else None
    for note in cluster.notes if cluster else []:
        print(f"note: {note}")
    print("-------------------- launch command --------------------")
    command = redact(shlex.join(cluster.argv)) if cluster else plan.command_line()
    print(command, flush=True)
    if cli.dry_run:
        return 0
    if signals.pending:  # asked to stop while reading the configs: nothing started, nothing written
        return stopped_before_launch(signals.pending[0])
    write_run_dir(args, plan, command)
    print(f"run folder: {plan.run_dir}", flush=True)
    reports = ExitReports(plan.run_dir, args.global_num_gpus)  # the ranks' own exit statuses
    return run_cluster(cluster, signals, reports) if cluster else launch(plan, signals, reports)


if __name__ == "__main__":
    sys.exit(main())
