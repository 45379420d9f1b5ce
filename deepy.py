#!/usr/bin/env python
"""GPT-NeoX's launcher: ``python deepy.py train.py [-d DIR] a.yml [b.yml ...] [--key value ...] [--dry-run]``.

``python deepy.py --plan train.py a.yml [--gpus N ...] [--json]`` prints a memory and throughput plan instead;
``python deepy.py --autotune train.py a.yml [--candidates N]`` measures the plan's best layouts (docs/planner.md).

Merges and validates the configs, writes the resolved config to a run folder and starts the script on every
rank through DeepSpeed's launcher (megatron/launcher/from_cli.py). Config errors are printed without a traceback and exit with status 2. SIGTERM,
SIGUSR1, SIGHUP and Ctrl-C reach every rank, deepy waits for them and exits with their status (42 after a
preemption save, 143 with one line when there was nothing to save yet; a second Ctrl-C within 5 s kills them):
docs/reliability.md, "Signals to deepy.py".
"""

from __future__ import annotations

import contextlib
import logging
import sys

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.console import safe_console
from megatron.errors import UserError
from megatron.launcher.from_cli import launch_from_cli
from megatron.launcher.secrets import install_log_redaction
from megatron.launcher.supervise import SignalQueue


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
            return launch_from_cli(argv, signals)
        finally:
            signals.uninstall()
    except UserError as e:  # the config, or a variable of the launch environment
        print(f"deepy.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an unwritable log_dir or run folder
        where = e.filename if e.filename is not None else "a file"
        print(f"deepy.py: error: cannot create or write {where}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
