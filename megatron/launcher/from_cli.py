"""What ``python deepy.py SCRIPT CONFIGS... [--key value ...] [--dry-run]`` does after its own set-up: validate the
configs, print the resolved configuration and the launch command, write the run folder, start the ranks and wait."""

from __future__ import annotations

import os
import shlex

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
from megatron.launcher.secrets import redact
from megatron.launcher.supervise import SignalQueue, stopped_before_launch
from megatron.logging.comet import check_comet
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.size_checks import check_fits_machine


def launch_from_cli(argv: list[str], signals: SignalQueue) -> int:
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
