"""Checkpoints in DeepSpeed's layout with GPT-NeoX's names, schedule, retention and resume rules.

```
<save>/latest                                   "global_step<N>" (written by DeepSpeed)
<save>/global_step<N>/
  configs/<yaml basename>, configs/resolved_config.json
  mp_rank_XX_model_states.pt                    engine state + our client state (iteration, args, rng, data position)
  layer_LL-model_TT-model_states.pt             pipe models only
  [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt   ZeRO optimizer shards
  manifest.json                                 written last by rank 0: sizes/sha256 of every file, iteration,
                                                consumed samples, layout, resolved config
```

Saves are crash-safe and loads fall back to the newest valid checkpoint (``checkpoint_commit``). ``load``: a
missing folder is an error unless it is ``save`` or ``auto`` (auto-resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron import mpu
from megatron.checkpoint.autoreshard import plan_load_for_engine
from megatron.checkpoint.bias_layout import ROW_BIAS_KEY, row_biases_on_disk, stored_layout, written_layout
from megatron.checkpoint.layout import ZERO3_RE, CheckpointError, checkpoint_folder, read_latest
from megatron.checkpoint.manifest import verify_checkpoint, write_manifest
from megatron.checkpoint.optimizer_carry import NO_LOAD_OPTIM_HINT, carry_optimizer_state, load_mode
from megatron.checkpoint.reader import read_checkpoint
from megatron.checkpoint.reshard import gather_full_optimizer_state
from megatron.checkpoint.safe_load import is_unsafe_error, safe_loading, safe_torch_load, unsafe_message
from megatron.checkpoint.tags import checkpoint_dirs, checkpoint_tag
from megatron.checkpoint.tokenizer_identity import check_tokenizer
from megatron.config_utils import NeoXValues, from_schema, neox_overrides, schema_defaults
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments.sections.training import CHECKPOINT_SCALES
from megatron.training import checkpoint_commit as commit_lib
from megatron.training import state_checks
from megatron.training.checkpoint_commit import delete_old_checkpoints
from megatron.training.learning_rates import AnnealingLR

logger = logging.getLogger(__name__)

LR_SCHEDULER_KEY = "lr_scheduler"  # where DeepSpeed writes an engine's LR schedule in mp_rank_XX_model_states.pt
CHECKPOINT_ARG_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "padded_vocab_size",
    "tokenizer_type",
    "model_parallel_size",
)
AUTO = "auto"


@dataclass
@schema_defaults
class CheckpointConfig:
    """GPT-NeoX checkpoint keys."""

    save: str | None = from_schema()
    load: str | None = from_schema()
    checkpoint_factor: int | float | None = from_schema()
    checkpoint_scale: CHECKPOINT_SCALES = from_schema()
    extra_save_iters: list | None = from_schema()
    keep_last_n_checkpoints: int | None = from_schema()
    no_save_optim: bool = from_schema()
    no_save_rng: bool = from_schema()
    no_load_optim: bool = from_schema()
    no_load_rng: bool = from_schema()
    finetune: bool = from_schema()
    iteration: int | None = from_schema()
    gpt_j_residual: bool = (
        from_schema()
    )  # decides how row-parallel biases are stored at TP > 1 (checkpoint.bias_layout)
    load_verify_checksums: bool = from_schema()
    load_allow_tokenizer_change: bool = from_schema()

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> CheckpointConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        if "save" in values:
            values["save"] = str(values["save"])  # NeoXArgs' save is also callable (args.save(path)): keep the str
        values["extra_save_iters"] = [int(i) for i in values.get("extra_save_iters", [])]
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError for inconsistent keys."""
        if self.checkpoint_scale not in ("linear", "log"):
            raise CheckpointError(f"checkpoint_scale must be 'linear' or 'log', got {self.checkpoint_scale!r}")
        if self.checkpoint_factor is not None:
            if self.checkpoint_scale == "linear" and (
                float(self.checkpoint_factor) != int(self.checkpoint_factor) or int(self.checkpoint_factor) < 1
            ):
                raise CheckpointError(
                    f"checkpoint_factor must be a positive integer with linear scale, got {self.checkpoint_factor}"
                )
            if self.checkpoint_scale == "log" and float(self.checkpoint_factor) <= 1:
                raise CheckpointError(f"checkpoint_factor must be > 1 with log scale, got {self.checkpoint_factor}")
        if self.save and self.checkpoint_factor is None and not self.extra_save_iters:
            raise CheckpointError("save is set but neither checkpoint_factor nor extra_save_iters says when to save")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise CheckpointError(f"keep_last_n_checkpoints must be >= 1, got {self.keep_last_n_checkpoints}")


def is_save_iter(iteration: int, cfg: CheckpointConfig) -> bool:
    """True when ``iteration`` is in ``extra_save_iters`` or on the ``checkpoint_factor`` schedule."""
    if iteration in (cfg.extra_save_iters or ()):
        return True
    if cfg.checkpoint_factor is None or iteration <= 0:
        return False
    if cfg.checkpoint_scale == "linear":
        return iteration % int(cfg.checkpoint_factor) == 0
    power = 1.0
    while int(power) <= iteration:  # log scale: iteration == int(factor ** k) for some k >= 0
        if int(power) == iteration:
            return True
        power *= float(cfg.checkpoint_factor)
    return False


def rng_state() -> dict[str, Any]:
    """The RNG states GPT-NeoX saves (python, numpy, torch, accelerator, model-parallel tracker)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states(),
    }
    return state


def set_rng_state(state: dict[str, Any], path: str) -> None:
    """Restore :func:`rng_state` output; a missing key is a clear error."""
    try:
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        if torch.cuda.is_available() and state["cuda_rng_state"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng_state"])
        mpu.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    except KeyError as e:
        raise CheckpointError(
            f"checkpoint {path} has no RNG state {e.args[0]!r}; set no_load_rng: true (or finetune) to load it"
        ) from None


def _write_configs(directory: Path, config_files: dict[str, str] | None, resolved: dict[str, Any] | None) -> None:
    configs = directory / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    for name, text in (config_files or {}).items():
        (configs / os.path.basename(name)).write_text(text)
    if resolved is not None:
        (configs / "resolved_config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True, default=str))


def _strip_optimizer_states(directory: Path, zero_stage: int) -> None:
    """``no_save_optim``: drop optimizer state written by this rank (weights stay loadable)."""
    rank = mpu.world_rank()
    if zero_stage >= 3:
        logger.warning("no_save_optim is ignored with ZeRO-3: the fp32 weights live in the optimizer shards")
        return
    for path in directory.glob("*optim_states.pt"):
        if f"zero_pp_rank_{rank}_" in path.name or (zero_stage == 0 and rank == 0):
            path.unlink(missing_ok=True)
    if rank == 0:
        for path in directory.glob("mp_rank_*_model_states.pt"):
            state = safe_torch_load(path)
            state["optimizer"] = None
            torch.save(state, path)


def save_checkpoint(
    engine: Any,
    lr_scheduler: AnnealingLR | None,
    iteration: int,
    cfg: CheckpointConfig,
    *,
    checkpoint_args: dict[str, Any],
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    config_files: dict[str, str] | None = None,
    resolved_config: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
    run_id: str = "",
) -> Path:
    """Save through ``engine.save_checkpoint`` under tag ``global_step<iteration>`` (all ranks must call), with the
    LR schedule's state in the model-states files' ``lr_scheduler`` entry, where DeepSpeed puts an engine's own.

    ``run_id`` (from the save folder's lock) names the temporary folder, and the cleanup before the save only
    removes this run's; without it every leftover temporary folder is removed.
    """
    if not cfg.save:
        raise CheckpointError("save_checkpoint needs the 'save' directory")
    tag = checkpoint_tag(iteration)
    client_state: dict[str, Any] = {
        "iteration": iteration,
        "args": dict(checkpoint_args),
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
    }
    if not cfg.no_save_rng:
        client_state.update(rng_state())
    client_state.update(extra_state or {})
    if lr_scheduler is not None:
        client_state[LR_SCHEDULER_KEY] = lr_scheduler.state_dict()
    tp = int(checkpoint_args.get("model_parallel_size") or 1)
    zero_stage = _zero_stage(engine)  # what the engine writes (its config's zero_optimization.stage)
    bias_layout = written_layout(cfg.gpt_j_residual, tp, zero_stage)
    client_state[ROW_BIAS_KEY] = bias_layout
    rank = mpu.world_rank()
    state_checks.check_state_before_save(engine, cfg.save, tag, optimizer=not cfg.no_save_optim or zero_stage >= 3)
    directory = Path(cfg.save) / commit_lib.partial_tag(tag, run_id)
    if rank == 0:
        commit_lib.clean_partials(cfg.save, run_id or None)
    mpu.barrier()
    with commit_lib.write_errors(cfg.save, tag):  # disk full: one line, the previous checkpoint stays
        with row_biases_on_disk(engine.module, bias_layout, tp):
            engine.save_checkpoint(cfg.save, tag=directory.name, client_state=client_state, save_latest=False)
        if cfg.no_save_optim:
            mpu.barrier()
            _strip_optimizer_states(directory, zero_stage)
        if rank == 0:
            _write_configs(directory, config_files, resolved_config)
        mpu.barrier()
        if rank == 0:
            world = mpu.world_size()
            meta = {"tag": tag, "iteration": iteration, "consumed_train_samples": consumed_train_samples}
            meta.update(consumed_valid_samples=consumed_valid_samples, layout=_layout(engine, world))
            meta[ROW_BIAS_KEY] = bias_layout
            write_manifest(directory, **meta, config=resolved_config)
            directory = commit_lib.commit(cfg.save, tag, run_id)
            if cfg.keep_last_n_checkpoints is not None:
                delete_old_checkpoints(cfg.save, cfg.keep_last_n_checkpoints, new=tag)
    mpu.barrier()
    directory = Path(cfg.save) / tag
    if rank == 0:
        logger.info("saved checkpoint %s at iteration %d", directory, iteration)
    return directory


def _zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def _layout(engine: Any, world: int) -> dict[str, int]:
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    dp = mpu.get_data_parallel_world_size() if mpu.model_parallel_is_initialized() else world
    zero = _zero_stage(engine)
    return {"world_size": world, "tp": tp, "dp": dp, "pp": max(world // max(tp * dp, 1), 1), "zero_stage": zero}


@dataclass
class LoadResult:
    """What a load restored."""

    iteration: int
    path: str | None
    consumed_train_samples: int | None = None
    consumed_valid_samples: int | None = None
    client_state: dict[str, Any] = field(default_factory=dict)


def resolve_tag(cfg: CheckpointConfig) -> str | None:
    """The tag to load: ``global_step<iteration>`` if requested, else ``latest``'s content, else None."""
    assert cfg.load is not None
    root = Path(cfg.load)
    if cfg.iteration is not None:
        tag = checkpoint_tag(int(cfg.iteration))
        if not (root / tag).is_dir():
            available = ", ".join(p.name for p in checkpoint_dirs(root)) or "none"
            raise CheckpointError(f"iteration {cfg.iteration}: no checkpoint {root / tag} (available: {available})")
        checkpoint_folder(root, tag, f"iteration {cfg.iteration}")
        verify_manifest(root / tag, checksums=cfg.load_verify_checksums)
        return tag
    named = read_latest(root)  # '.', '..', separators or a symlink out: one line before anything is read
    picked = commit_lib.select_checkpoint(root, checksums=cfg.load_verify_checksums)
    if picked is not None:  # also a folder picked without (or instead of) latest's must stay inside load
        what = f"{root / 'latest'}" if picked == named else f"the newest checkpoint in {root}"
        checkpoint_folder(root, picked, what)
    return picked


def verify_manifest(directory: Path, *, checksums: bool = False) -> None:
    """A checkpoint with our manifest must hold every file it lists at the recorded size, and with ``checksums``
    its sha256 (GPT-NeoX checkpoints have no manifest)."""
    problem = verify_checkpoint(directory, checksums=checksums)
    if problem:
        raise CheckpointError(f"checkpoint {directory} is incomplete: {problem}")


def resolve_load_dir(cfg: CheckpointConfig) -> CheckpointConfig:
    """``load: auto`` means ``save``; a missing ``load`` folder is an error unless it is ``save`` (auto-resume)."""
    load = cfg.load
    if load == AUTO:
        if not cfg.save:
            raise CheckpointError("load: auto resumes from the save directory, but save is not set")
        load = cfg.save
    assert load is not None
    if Path(load).is_dir():
        return dataclasses.replace(cfg, load=load)
    if cfg.load == AUTO or (cfg.save and Path(load).resolve() == Path(cfg.save).resolve()):
        if mpu.world_rank() == 0:
            logger.info("auto-resume: %s holds no checkpoint yet, starting from iteration 0", load)
        return dataclasses.replace(cfg, load=None)
    raise CheckpointError(
        f"load directory {load} does not exist; check the path, or set load equal to save (or load: auto) to "
        "resume when a checkpoint exists and start fresh otherwise"
    )


def _carry_optimizer_state(engine: Any, directory: Path, model: GPTModelConfig | None) -> None:
    """Load the checkpoint's optimizer state into a run of another DP size or ZeRO stage (optimizer_carry)."""
    with safe_loading():
        ckpt = read_checkpoint(directory, model=model)
        try:
            full, _ = gather_full_optimizer_state(ckpt)
        except CheckpointError as e:
            raise CheckpointError(
                f"the optimizer state of {directory} cannot be carried over ({e}); {NO_LOAD_OPTIM_HINT}"
            ) from None
    tp = mpu.get_model_parallel_world_size()
    carry_optimizer_state(engine, full, ckpt.cfg, tp, mpu.get_model_parallel_rank(), 0, 0)
    if mpu.world_rank() == 0:
        logger.info("optimizer state of %s carried over to ZeRO stage %d x %d data-parallel ranks", directory,
                    int(engine.zero_optimization_stage()), mpu.get_data_parallel_world_size())  # fmt: skip


@contextlib.contextmanager
def _zero3_tag_view(engine: Any, root: str, tag: str, load_optimizer_states: bool) -> Iterator[str]:
    """The folder to hand DeepSpeed. A ZeRO-3 engine that loads no optimizer state reads the weights with
    ``zero_to_fp32`` from the tag named by ``<root>/latest`` (whatever ``tag`` says) and from the shards of every
    model-parallel rank at once, and the client state from ``zero_pp_rank_<its DP rank>_…_model_states.pt`` (absent
    when the run has more DP ranks than the checkpoint). A scratch folder whose ``latest`` names ``tag`` and whose
    tag links this MP rank's optimizer shards and the other files, plus rank 0's model states for the missing DP ranks, makes
    it read the requested checkpoint."""
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
    if stage < 3 or load_optimizer_states:
        yield root
        return
    source = Path(root, tag).resolve()
    dp = int(getattr(engine, "dp_world_size", 1) or 1)
    with tempfile.TemporaryDirectory(prefix="neox-zero3-load-") as scratch:
        view = Path(scratch) / tag
        view.mkdir()
        mp_rank = mpu.get_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
        for item in source.iterdir():
            m = ZERO3_RE.match(item.name)
            if m is None or m.group(3) == "model" or int(m.group(2)) == mp_rank:  # DeepSpeed counts model files
                (view / item.name).symlink_to(item)
        for first in source.glob(f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"):
            for rank in range(1, dp):
                name = first.name.replace("zero_pp_rank_0_", f"zero_pp_rank_{rank}_", 1)
                if not (view / name).exists():
                    (view / name).symlink_to(first)
        (Path(scratch) / "latest").write_text(tag)
        yield scratch


def restore_lr_schedule(lr_scheduler: AnnealingLR, state: Any, iteration: int, path: str) -> None:
    """The schedule as saved (GPT-NeoX's policy keys decide between it and the config); a checkpoint without one
    (written by a converter) resumes the configured schedule at the loaded iteration."""
    if state is None:
        logger.warning(
            "checkpoint %s has no LR scheduler state: the configured schedule resumes at iteration %d", path, iteration
        )
        lr_scheduler.step(iteration)
        return
    keys = sorted(lr_scheduler.state_dict())  # GPT-NeoX's AnnealingLR keys
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else keys
    steps = state.get("num_iters") if isinstance(state, dict) else None
    if missing or not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        problem = f"missing {', '.join(missing)}" if missing else f"num_iters={steps!r} is not a step count"
        raise CheckpointError(
            f"checkpoint {path}: its {LR_SCHEDULER_KEY!r} entry is not an LR schedule's state ({problem}; expected a "
            f"dict with {', '.join(keys)}); to start from its weights with a fresh schedule, set finetune: true"
        )
    lr_scheduler.load_state_dict(state)


def check_checkpoint_args(saved: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """The model-shape args stored in the checkpoint must equal the config's."""
    bad = [
        f"{k}: checkpoint {saved[k]!r} vs config {current.get(k)!r}"
        for k in CHECKPOINT_ARG_KEYS
        if k in saved and k in current and saved[k] != current[k]
    ]
    if bad:
        raise CheckpointError(f"checkpoint {path} does not match the config: " + "; ".join(bad))


def load_checkpoint(
    engine: Any,
    lr_scheduler: AnnealingLR | None,
    cfg: CheckpointConfig,
    *,
    checkpoint_args: dict[str, Any],
    model: GPTModelConfig | None = None,
    load_module_strict: bool = True,
) -> LoadResult:
    """Load ``cfg.load`` into ``engine`` and ``lr_scheduler`` (its state unless only weights are loaded); a directory
    without ``latest`` means a fresh start (iteration 0).

    ``load_module_strict`` False lets the module lack parameters of the checkpoint and have new ones (a reward
    model, ``train_impl: rm``, starts from a language model: its rm_linear head is new, the LM head is dropped).

    With ``model`` (the run's model config), a checkpoint of another TP/PP layout is resharded on load
    (``megatron.checkpoint.autoreshard``); a weights-only reshard restores everything but the optimizer state.
    """
    if not cfg.load:
        return LoadResult(0, None)
    cfg = resolve_load_dir(cfg)
    if cfg.load is None:
        return LoadResult(0, None)
    if cfg.save and Path(cfg.load).resolve() == Path(cfg.save).resolve() and mpu.world_rank() == 0:
        commit_lib.clean_partials(cfg.load)
    tag = resolve_tag(cfg)
    if tag is None:
        logger.info("no checkpoint in %s yet: starting from iteration 0", cfg.load)
        return LoadResult(0, None)
    root, resharded, optimizer_missing, dropped = cfg.load, False, False, False
    if model is not None:
        plan = plan_load_for_engine(engine, cfg.load, tag, model=model)
        root, tag, resharded, optimizer_missing = plan.root, plan.tag, plan.resharded, plan.weights_only
        dropped = plan.optimizer_dropped
    verify_manifest(Path(root) / tag)
    weights_only = cfg.no_load_optim or cfg.finetune
    carry = False
    if not weights_only and not (optimizer_missing and not dropped):  # (a copy of a source without any state)
        carry = load_mode(engine, Path(root) / tag, weights_only_copy=dropped) == "carry"
    tp = int(checkpoint_args.get("model_parallel_size") or 1)
    bias_layout = stored_layout(Path(root) / tag, gpt_j_residual=cfg.gpt_j_residual, tp=tp)
    load_optim = not (weights_only or optimizer_missing or carry)
    try:
        with (
            safe_loading(),
            row_biases_on_disk(engine.module, bias_layout, tp),
            _zero3_tag_view(engine, root, tag, load_optim) as load_root,
        ):
            path, client = engine.load_checkpoint(
                load_root,
                tag=tag,
                load_optimizer_states=load_optim,
                load_lr_scheduler_states=False,  # the schedule is not the engine's: restored below
                load_module_only=weights_only,
                load_module_strict=load_module_strict,
            )
    except Exception as e:
        if is_unsafe_error(e):
            raise CheckpointError(unsafe_message(Path(root) / tag, e)) from None
        if not isinstance(e, (OSError, EOFError, RuntimeError, KeyError, pickle.UnpicklingError)):
            raise
        raise CheckpointError(f"checkpoint {Path(root) / tag} could not be loaded ({type(e).__name__}: {e})") from e
    if path is None or client is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {Path(root) / tag}")
    path = str(Path(root) / tag / Path(path).name) if load_root != root else path
    if carry:
        _carry_optimizer_state(engine, Path(root) / tag, model)
    state_checks.check_loaded_state_finite(
        engine, root, tag, optimizer="carried" if carry else "file" if load_optim else None
    )
    saved_args = dict(client.get("args", {}))
    if resharded:  # the layout (and with it the vocab padding) was converted on purpose
        saved_args.pop("model_parallel_size", None)
        saved_args.pop("padded_vocab_size", None)
    check_tokenizer(saved_args, checkpoint_args, path, cfg.load_allow_tokenizer_change)
    if cfg.load_allow_tokenizer_change:
        saved_args.pop("tokenizer_type", None)
    check_checkpoint_args(saved_args, checkpoint_args, path)
    if cfg.finetune:
        logger.info("finetune: loaded weights from %s, starting at iteration 0", path)
        return LoadResult(0, path, 0, 0, client)
    if "iteration" not in client and "total_iters" not in client:
        raise CheckpointError(
            f"checkpoint {path} has no iteration (client state 'iteration' or 'total_iters'); "
            "to start from its weights at iteration 0, set finetune: true"
        )
    iteration = int(client["iteration"] if "iteration" in client else client["total_iters"])
    if lr_scheduler is not None and not weights_only:  # no_load_optim: neither the optimizer nor the schedule
        restore_lr_schedule(lr_scheduler, client.get(LR_SCHEDULER_KEY), iteration, path)
    if not cfg.no_load_rng:
        set_rng_state(client, path)
    logger.info("loaded checkpoint %s at iteration %d", path, iteration)
    return LoadResult(
        iteration, path, client.get("consumed_train_samples"), client.get("consumed_valid_samples"), client
    )
