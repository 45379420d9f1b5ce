"""Pretrain a GPT model as configured (GPT-NeoX's ``train.py``); launched on every rank by ``deepy.py``."""

from __future__ import annotations

import logging
import os
import sys

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)


def main() -> int:
    """Parse the worker arguments, train, and end the rank cleanly; returns the exit code."""
    from megatron.launcher.secrets import install_log_redaction
    from megatron.logging.tee import CurrentStdout, tee_output

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=CurrentStdout())
    install_log_redaction()
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "wandb"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron.cluster.peers import lost_peer_message
    from megatron.distributed import shutdown_and_exit
    from megatron.errors import UserError
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.preemption import REQUEUE_EXIT_CODE
    from megatron.training.pretrain import pretrain

    code = 0
    args = None
    try:
        args = NeoXArgs.consume_neox_args()
        if args.log_dir:
            try:
                tee_output(args.log_dir, args.rank, int(os.environ.get("LOCAL_RANK", "0")))
            except OSError as e:
                raise UserError(f"log_dir {args.log_dir}: cannot write the log files ({e})") from None
        result = pretrain(args)
        if result.preempted:  # saved at a step boundary: the job can be requeued and resumes from there
            code = REQUEUE_EXIT_CODE
        if args.rank == 0:
            print(
                f"training {'stopped' if result.preempted else 'finished'} at iteration {result.iteration}", flush=True
            )
    except UserError as e:  # configuration, data or checkpoint mistakes: one line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    except Exception as e:
        lost = lost_peer_message(e, getattr(args, "distributed_timeout_minutes", None))
        if lost:  # a node died or became unreachable: not a bug, one line naming it
            print(f"error: {lost}", file=sys.stderr, flush=True)
        else:  # a bug: keep the traceback
            logging.getLogger("megatron.train").exception("training failed")
        code = 1
    shutdown_and_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
