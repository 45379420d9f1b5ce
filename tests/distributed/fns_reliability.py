"""Helpers for tests/e2e/test_train_reliability.py: NaN injection on gloo ranks, and train.py rank processes that
a test can signal or kill (started like torchrun would, output to files)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.distributed.fns_train import run_pretrain
from tests.harness import REPO_ROOT, free_port, subprocess_env


def run_with_nan(
    config: dict[str, Any], nan_iters: list[int], nan_rank: int, factor: float = float("nan")
) -> dict[str, Any]:
    """``run_pretrain`` with the training loss of ``nan_iters`` (1-based) multiplied by ``factor`` (NaN: replaced
    by NaN; a large factor: a loss spike) on rank ``nan_rank`` (under a pipeline: a rank of the last stage);
    returns the result plus the warnings logged, the abort message (if any), the learning rate each iteration's
    optimizer step was given (``lrs``) and whether each iteration's step was skipped (``step_skipped``)."""
    import torch.distributed as dist

    import megatron.model as model_lib
    from megatron.model import gpt2_model
    from megatron.training import step as step_mod

    state = {"iteration": 0}
    lrs: list[float] = []
    skips: list[bool] = []
    originals = {cls: cls.train for cls in (step_mod.SequentialStep, step_mod.PipeStep)}

    def counting(original: Any) -> Any:
        def counting_train(self: Any, data_iter: Any) -> Any:
            state["iteration"] += 1
            lrs.append(float(self.engine.optimizer.param_groups[0]["lr"]))
            result = original(self, data_iter)
            skips.append(result.skipped)
            return result

        return counting_train

    cross_entropy = model_lib.cross_entropy

    def poisoned(logits: torch.Tensor, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = cross_entropy(logits, targets, *args, **kwargs)
        if logits.requires_grad and state["iteration"] in nan_iters and dist.get_rank() == nan_rank:
            loss = loss * factor
        return loss

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megatron.train").addHandler(handler)
    for cls, original in originals.items():
        cls.train = counting(original)  # type: ignore[method-assign]
    model_lib.cross_entropy = poisoned  # the training step's loss (pretrain reads it when it builds the step)
    gpt2_model.cross_entropy = poisoned  # the pipeline model's loss_fn (bound when GPT2ModelPipe is built)
    try:
        out = {**run_pretrain(config), "abort": None}
    except ValueError as e:
        from megatron import mpu

        mpu.destroy_model_parallel()
        out = {"abort": f"{type(e).__name__}: {e}"}
    finally:
        for cls, original in originals.items():
            cls.train = original  # type: ignore[method-assign]
        model_lib.cross_entropy = cross_entropy
        gpt2_model.cross_entropy = cross_entropy
        logging.getLogger("megatron.train").removeHandler(handler)
    out["warnings"] = [r for r in records if "non-finite" in r or "loss spike" in r]
    out["lrs"], out["step_skipped"] = lrs, skips
    return out


def start_train_ranks(
    config_path: Path, world: int, log_dir: Path, slow_save_tag: str | None = None
) -> list[subprocess.Popen]:
    """train.py's ``main`` once per rank (own session each; see ``__main__`` below), stdout+stderr to
    ``log_dir/rank<N>.log``; every rank writes its losses to ``log_dir/rank<N>.json``. With ``slow_save_tag`` the
    ranks stall (60 s) inside the save of that checkpoint after writing ``log_dir/saving``."""
    port = str(free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = subprocess_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank)})
        env.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), RELIAB_DIR=str(log_dir))
        if slow_save_tag:
            env["RELIAB_SLOW_SAVE_TAG"] = slow_save_tag
        out = open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed by the child's exit
        cmd = [sys.executable, "-m", "tests.distributed.fns_reliability", "--neox_config", str(config_path)]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
        out.close()
    return procs


def write_neox_config(config: dict[str, Any], path: Path) -> Path:
    """The resolved config file deepy.py would hand to train.py."""
    from megatron.neox_arguments import NeoXArgs

    NeoXArgs.from_dict(config).save_config(str(path))
    return path


def streamed_losses(log_dir: Path, rank: int) -> list[float]:
    """The losses a rank streamed so far (one per finished step)."""
    path = log_dir / f"rank{rank}.steps"
    return [float(line) for line in path.read_text().splitlines()] if path.exists() else []


def rank_log(log_dir: Path, rank: int) -> str:
    path = log_dir / f"rank{rank}.log"
    return path.read_text() if path.exists() else ""


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        p.wait(timeout=30)


def run_with_nan_many(jobs: list[tuple]) -> list[dict[str, Any]]:
    """Several :func:`run_with_nan` runs one after the other on the same ranks."""
    return [run_with_nan(*job) for job in jobs]


def _worker_main() -> int:
    """train.py's ``main`` with test-only additions: losses dumped per rank (at the end, and per step to
    ``rank<N>.steps`` as they happen), and an optional stalled save."""
    import json
    import time

    from megatron.training import pretraining as pretrain_mod

    out_dir = Path(os.environ["RELIAB_DIR"])
    rank = int(os.environ["RANK"])
    original = pretrain_mod.pretrain

    def recording(args: Any, **kwargs: Any) -> Any:  # train_entry passes startup=
        result = original(args, **kwargs)
        record = {"start": result.start_iteration, "losses": result.train_losses, "preempted": result.preempted}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
        return result

    pretrain_mod.pretrain = recording
    from megatron.training import step as step_mod

    step_train = step_mod.SequentialStep.train

    def streaming(self: Any, data_iter: Any) -> Any:  # every step's loss, flushed, so that kill -9 keeps it
        result = step_train(self, data_iter)
        with open(out_dir / f"rank{rank}.steps", "a") as f:
            f.write(f"{result.lm_loss!r}\n")
        return result

    step_mod.SequentialStep.train = streaming  # type: ignore[method-assign]
    slow = os.environ.get("RELIAB_SLOW_SAVE_TAG")
    if slow:
        save = torch.save

        def stalled_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            save(obj, f, *args, **kwargs)
            if f".partial-{slow}" in str(f):
                (out_dir / "saving").write_text(str(f))
                time.sleep(60)

        torch.save = stalled_save
    sys.path.insert(0, str(REPO_ROOT))
    import train

    return train.main()


if __name__ == "__main__":
    sys.exit(_worker_main())
