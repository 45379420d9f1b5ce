"""``train.py``'s work, kept out of the entry point (which stays GPT-NeoX-sized): logging set-up, the training run, and
the script mode that turns user errors into one line and ends the rank. Heavy modules are imported inside the
functions: ``train.py`` installs its start-up signal handlers before anything here imports torch, and a config or
launch-environment error is reported before torch and DeepSpeed are imported at all (a refusal takes a fraction of a
second, not the seconds of those imports).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from megatron.training.startup_signals import STOPPED_EXIT_CODE, StartupSignals, StoppedBeforeTraining, stop_in_chain


def train(
    input_args: list[str] | None,
    overwrite_values: dict[str, Any] | None,
    tee: bool,
    startup: StartupSignals | None = None,
) -> int:
    """Validate the config, train, and return the exit code (42 preempted after a save, 143 stopped before the first
    step, 0 done); ``startup``: the stop-signal handlers the script installed first."""
    from megatron.cluster.worker_env import launched_local_rank
    from megatron.errors import UserError
    from megatron.logging.tee import tee_output
    from megatron.neox_arguments import NeoXArgs
    from megatron.neox_arguments.size_checks import check_fits_machine

    # validated as deepy.py validates, whatever started this rank
    args = NeoXArgs.consume_neox_args(overwrite_values=overwrite_values, input_args=input_args)
    check_fits_machine(args)  # before any model is built: an impossible size is one line, not a failed allocation
    if args.log_dir and tee:  # in-process callers keep their own stdout
        try:
            assert args.rank is not None  # set by consume_neox_args (configure_distributed_args)
            tee_output(args.log_dir, args.rank, launched_local_rank())
        except OSError as e:
            raise UserError(f"log_dir {args.log_dir}: cannot write the log files ({e})") from None
    from megatron.training.preemption import REQUEUE_EXIT_CODE  # torch and DeepSpeed: only for a valid config
    from megatron.training.pretraining import pretrain

    result = pretrain(args, startup=startup)
    if result.stopped_before_training:  # a signal before the first step: nothing to save (the log line says so)
        return STOPPED_EXIT_CODE
    if args.rank == 0:
        print(f"training {'stopped' if result.preempted else 'finished'} at iteration {result.iteration}", flush=True)
    # saved at a step boundary: the job can be requeued and resumes from there
    return REQUEUE_EXIT_CODE if result.preempted else 0


def setup_logging() -> None:
    """Log lines to the current stdout (the rank's log file once teed), secrets redacted, library noise quiet."""
    from megatron.console import safe_console
    from megatron.launcher.secrets import install_log_redaction
    from megatron.logging.tee import CurrentStdout

    safe_console()  # a non-ASCII path on an ASCII console is escaped, not a UnicodeEncodeError
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=CurrentStdout())
    install_log_redaction()
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "wandb"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_script(startup: StartupSignals) -> int:
    """Run as a script: user errors in one line, then end the rank (the handlers of ``startup`` stay installed until
    the process exits, so a launcher's late SIGTERM cannot cut its last steps short)."""
    setup_logging()
    from megatron.cluster.peers import lost_peer_message
    from megatron.errors import UserError

    code = 0
    try:
        code = train(None, None, tee=True, startup=startup)
    except StoppedBeforeTraining:
        code = STOPPED_EXIT_CODE
    except UserError as e:  # configuration, data or checkpoint mistakes: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    except Exception as e:
        lost = lost_peer_message(e)
        code = 1
        if stop_in_chain(e) is not None:  # the start-up stop, wrapped by Python on its way (a class being created)
            code = STOPPED_EXIT_CODE
        elif lost:  # a node died or became unreachable, or another rank stopped first: one line naming it
            print(f"error: {lost}", file=sys.stderr, flush=True)
        else:  # a bug: keep the traceback
            logging.getLogger("megatron.train").exception("training failed")
    _end_rank(code)
    return code


def _end_rank(code: int) -> None:
    """``shutdown_and_exit`` once torch is loaded; a rank refused before that (its config or launch environment)
    has no process group to close, and ends without importing torch just to exit. The status is reported into
    deepy's run folder first (``megatron/launcher/exit_reports.py``)."""
    from megatron.launcher.exit_reports import report_exit

    report_exit(code)
    if "torch" in sys.modules:
        from megatron.distributed import shutdown_and_exit

        shutdown_and_exit(code)
        return  # reached only where shutdown_and_exit is replaced (tests)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
