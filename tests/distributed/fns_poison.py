"""Rank functions for the poisoned-optimizer-state tests: checkpoints whose moments hold NaN, per ZeRO stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.loadable import named_tensors
from megatron.checkpoint.manifest import MANIFEST, _sha256, checkpoint_files
from tests.distributed.fns_train import run_pretrain


def rewrite_manifest(step: Path) -> None:
    """What a writer that damaged the files would also do: record the new sizes and checksums."""
    manifest = json.loads((step / MANIFEST).read_text())
    for path in checkpoint_files(step):
        manifest["files"][str(path.relative_to(step))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (step / MANIFEST).write_text(json.dumps(manifest))


def poison_moments(step: Path, key: str = "exp_avg_sq", count: int = 100) -> Path:
    """NaN into the first ``count`` values of the first optimizer tensor named ``key`` in ``step``'s files (the
    ZeRO-0 state dict in ``mp_rank_00``, else the ZeRO shard), manifest rewritten to match; returns the file."""
    for path in sorted(step.glob("*optim_states.pt")) + sorted(step.glob("mp_rank_*_model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        for name, tensor in named_tensors(state):
            if name.endswith(f".{key}") and tensor.numel() >= count:
                tensor.reshape(-1)[:count] = float("nan")
                torch.save(state, path)
                rewrite_manifest(step)
                return path
    raise AssertionError(f"no optimizer tensor {key} in {step}")


def poisoned_resume_per_stage(configs: list[dict[str, Any]], work: str) -> list[dict[str, Any]]:
    """For each config (one ZeRO stage): train and save, poison ``exp_avg_sq`` in a copy, resume from it (the
    error), resume with ``no_load_optim: true`` (the way out); and, on the good checkpoint, a save of an engine
    whose moments were poisoned in memory (refused, ``latest`` unchanged)."""
    from megatron import mpu
    from megatron.checkpoint.layout import CheckpointError
    from megatron.checkpoint.state_checks import base_optimizer
    from megatron.neox_arguments import NeoXArgs
    from megatron.training import gpt_neox_api

    out = []
    for i, config in enumerate(configs):
        root = Path(work) / f"run{i}"
        good, bad = root / "good", root / "bad"
        run_pretrain({**config, "save": str(good), "train_iters": 2, "checkpoint_factor": 2})
        shutil.copytree(good, bad)
        poisoned = poison_moments(bad / "global_step2")
        result: dict[str, Any] = {"file": str(poisoned)}
        try:
            resume = {**config, "load": str(bad), "save": str(bad), "train_iters": 4, "checkpoint_factor": 1}
            run_pretrain({**resume, "use_checkpoint_lr_scheduler": True})
            result["resume"] = "resumed"
        except CheckpointError as e:
            result["resume"] = str(e)
        except Exception as e:  # reported by the test with the stage
            result["resume"] = f"{type(e).__name__}: {e}"
        mpu.destroy_model_parallel()
        print(f"[poison] config {i}: {result}", flush=True)
        result["left"] = sorted(p.name for p in bad.iterdir() if p.name.startswith(("global_step", "latest")))
        way_out = {**config, "load": str(bad), "save": str(bad), "train_iters": 3, "checkpoint_factor": 1}
        result["way_out"] = run_pretrain({**way_out, "no_load_optim": True})["iteration"]
        mpu.destroy_model_parallel()

        args = NeoXArgs.from_dict(
            {**config, "load": str(good), "save": str(good), "train_iters": 2, "checkpoint_factor": 1}
        )
        engine, _, schedule = gpt_neox_api.setup_model_and_optimizer(args)
        base = base_optimizer(engine.optimizer)
        assert base is not None
        moments = [s["exp_avg_sq"] for s in base.state.values() if "exp_avg_sq" in s]
        if moments:  # ZeRO-0's torch optimizer has state once loaded
            moments[-1].reshape(-1)[-1] = float("inf")
            try:
                gpt_neox_api.save_checkpoint(args, 3, engine, None, schedule)
                result["save"] = "saved"
            except CheckpointError as e:
                result["save"] = str(e)
        result["after_save"] = sorted(p.name for p in good.iterdir() if p.name.startswith("global_step"))
        result["latest"] = (good / "latest").read_text()
        mpu.destroy_model_parallel()
        out.append(result)
    return out
