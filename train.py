"""Pretrain a GPT model as configured (GPT-NeoX's ``train.py``); launched on every rank by ``deepy.py``.

``main(input_args=None, overwrite_values=None)`` has GPT-NeoX's signature: called with arguments (the list
``NeoXArgs.get_deepspeed_main_args()`` returns, and key overrides) it trains in this process and raises on errors,
as GPT-NeoX's own tests use it; run as a script it prints user errors in one line and ends the rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.training.startup_signals import STOPPED_EXIT_CODE, StartupSignals, StoppedBeforeTraining, stop_in_chain


def main(input_args: list[str] | None = None, overwrite_values: dict[str, Any] | None = None) -> int:
    """Parse the worker arguments, train; returns the exit code (see the module docstring for the two modes)."""
    if input_args is None and overwrite_values is None:
        # first: a stop signal while the rank starts ends it with STOPPED_EXIT_CODE, not the default action's status
        startup = StartupSignals().install()
        try:
            from megatron.train_entry import run_script

            return run_script(startup)
        except (StoppedBeforeTraining, RuntimeError) as e:  # before the process group formed: nothing to save
            if stop_in_chain(e) is None:  # RuntimeError: only the stop wrapped by a class creation during an import
                raise
            from megatron.launcher.exit_reports import report_exit

            report_exit(STOPPED_EXIT_CODE)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STOPPED_EXIT_CODE)  # no interpreter finalisation over a half-finished import
        finally:  # reached only where shutdown_and_exit returns (tests); a rank ends inside it
            startup.uninstall()
    from megatron.train_entry import setup_logging, train

    setup_logging()
    return train(input_args, overwrite_values, tee=False)


if __name__ == "__main__":
    sys.exit(main())
