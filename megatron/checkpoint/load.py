"""Loading a training run's checkpoint into a DeepSpeed engine and LR schedule (resharded on load when the layout
differs, the optimizer state carried over to another DP size or ZeRO stage), with the shape, tokenizer and
finiteness checks. ``load``: a missing folder is an error unless it is ``save`` or ``auto`` (auto-resume,
``megatron.checkpoint.resume``).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron import mpu
from megatron.checkpoint import commit as commit_lib
from megatron.checkpoint import state_checks
from megatron.checkpoint.autoreshard import plan_load_for_engine
from megatron.checkpoint.bias_layout import row_biases_on_disk, stored_layout
from megatron.checkpoint.layout import ZERO3_RE, CheckpointError
from megatron.checkpoint.lr_state import LR_SCHEDULER_KEY, LRSchedule, restore_lr_schedule
from megatron.checkpoint.optimizer_carry import NO_LOAD_OPTIM_HINT, carry_optimizer_state, load_mode
from megatron.checkpoint.reader import load_torch, read_checkpoint
from megatron.checkpoint.reshard import gather_full_optimizer_state
from megatron.checkpoint.resume import resolve_load_dir, resolve_tag, verify_manifest
from megatron.checkpoint.rng import set_rng_state
from megatron.checkpoint.run_config import CHECKPOINT_ARG_KEYS, CheckpointConfig
from megatron.checkpoint.s3_download import download_for_load
from megatron.checkpoint.safe_load import is_unsafe_error, safe_loading, unsafe_message
from megatron.checkpoint.tokenizer_identity import check_tokenizer
from megatron.checkpoint.universal import check_universal_load, read_latest_universal
from megatron.engine_protocol import Engine
from megatron.model.config import GPTModelConfig
from megatron.model.layer_sharing import is_shared
from megatron.model.soft_prompt import check_prompt_checkpoint, soft_prompt_tokens
from megatron.neox_arguments.s3_checks import is_s3_url

logger = logging.getLogger(__name__)


def check_prompt_pipe_checkpoint(ckpt_dir: Path) -> None:
    """Before a pipeline checkpoint (``layer_XX-…`` files) loads into a prompt-tuned ``PipelineModule``: the prefix's
    file ``layer_01-…`` must be there (every layer then loads strictly)."""
    if not any(ckpt_dir.glob("layer_01-*model_states.pt")):
        raise CheckpointError(
            f"not supported yet: soft_prompt_tuning on the pipeline engine from a checkpoint without a prefix "
            f"({ckpt_dir} has no layer_01 file); start it with pipe_parallel_size: 0"
        )


@dataclass
class LoadResult:
    """What a load restored."""

    iteration: int
    path: str | None
    consumed_train_samples: int | None = None
    consumed_valid_samples: int | None = None
    client_state: dict[str, Any] = field(default_factory=dict)


def _carry_optimizer_state(engine: Engine, directory: Path, model: GPTModelConfig | None) -> None:
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
def _zero3_tag_view(engine: Engine, root: str, tag: str, load_optimizer_states: bool) -> Iterator[str]:
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


def check_checkpoint_args(saved: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """The model-shape args stored in the checkpoint must equal the config's."""
    bad = [
        f"{k}: checkpoint {saved[k]!r} vs config {current.get(k)!r}"
        for k in CHECKPOINT_ARG_KEYS
        if k in saved and k in current and saved[k] != current[k]
    ]
    if bad:
        raise CheckpointError(f"checkpoint {path} does not match the config: " + "; ".join(bad))


_SHARED_CARRY = (
    "not supported yet: carrying the optimizer state of shared layers (num_unique_layers) from {} to another layout "
    "or optimizer form; {}"
)


def _load_universal(
    engine: Engine,
    lr_scheduler: LRSchedule | None,
    cfg: CheckpointConfig,
    checkpoint_args: dict[str, Any],
    model: GPTModelConfig | None,
    load_module_strict: bool,
) -> LoadResult:
    """``load_universal``: DeepSpeed restores weights and optimizer state from ``<load>/<latest_universal>/zero``
    for this run's layout (``megatron.checkpoint.universal``); the client state comes from the copied
    model-states files."""
    assert cfg.load is not None
    if cfg.iteration is not None:
        raise CheckpointError(
            f"load_universal loads the universal checkpoint {cfg.load}/latest_universal names; iteration "
            f"{cfg.iteration} cannot pick another (convert it with tools/ckpts/convert_to_universal.py --iteration N)"
        )
    tag = read_latest_universal(cfg.load)
    directory = Path(cfg.load) / tag
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    check_universal_load(engine, directory, model, tp=tp, weights_only=cfg.no_load_optim or cfg.finetune)
    try:
        with safe_loading():
            path, client = engine.load_checkpoint(
                cfg.load,
                tag=tag,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,  # the schedule is not the engine's: restored from the client state
                load_module_strict=load_module_strict,
            )
    except Exception as e:
        if is_unsafe_error(e):
            raise CheckpointError(unsafe_message(directory, e)) from None
        if not isinstance(e, (OSError, EOFError, RuntimeError, KeyError, AssertionError, pickle.UnpicklingError)):
            raise
        raise CheckpointError(f"universal checkpoint {directory} could not be loaded ({type(e).__name__}: {e})") from e
    if path is None or client is None:
        raise CheckpointError(f"DeepSpeed could not load universal checkpoint {directory}")
    state_checks.check_loaded_state_finite(engine, cfg.load, tag, optimizer="carried")
    return _restore_client_state(client, path, cfg, lr_scheduler, checkpoint_args, layout_changed=True)


def load_checkpoint(
    engine: Engine,
    lr_scheduler: LRSchedule | None,
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
    if is_s3_url(cfg.load):  # downloaded into s3_cache_dir first
        cfg = download_for_load(cfg)
    cfg = resolve_load_dir(cfg)
    if cfg.load is None:
        return LoadResult(0, None)
    if cfg.load_universal:
        return _load_universal(engine, lr_scheduler, cfg, checkpoint_args, model, load_module_strict)
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
    has_state = not weights_only and not (optimizer_missing and not dropped)  # (a copy of a source without any state)
    shared = model is not None and is_shared(model)
    if has_state and shared and resharded:
        raise CheckpointError(_SHARED_CARRY.format(cfg.load, NO_LOAD_OPTIM_HINT))
    if has_state:
        carry = load_mode(engine, Path(root) / tag, weights_only_copy=dropped) == "carry"
    if carry and shared:
        raise CheckpointError(_SHARED_CARRY.format(cfg.load, NO_LOAD_OPTIM_HINT))
    tp = int(checkpoint_args.get("model_parallel_size") or 1)
    bias_layout = stored_layout(Path(root) / tag, gpt_j_residual=cfg.gpt_j_residual, tp=tp)
    load_optim = not (weights_only or optimizer_missing or carry)
    if model is not None and soft_prompt_tokens(model) and hasattr(engine.module, "load_state_dir"):
        check_prompt_pipe_checkpoint(Path(root) / tag)  # the pipeline engine: every layer file loads strictly
        load_module_strict = True
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
    if model is not None and soft_prompt_tokens(model) and not load_module_strict:  # all but the prefix were loaded
        check_prompt_checkpoint(set(load_torch(Path(path), mmap=True).get("module") or ()), engine.module, path)
    if carry:
        _carry_optimizer_state(engine, Path(root) / tag, model)
    state_checks.check_loaded_state_finite(
        engine, root, tag, optimizer="carried" if carry else "file" if load_optim else None
    )
    return _restore_client_state(client, path, cfg, lr_scheduler, checkpoint_args, layout_changed=resharded)


def _restore_client_state(
    client: dict[str, Any],
    path: str,
    cfg: CheckpointConfig,
    lr_scheduler: LRSchedule | None,
    checkpoint_args: dict[str, Any],
    *,
    layout_changed: bool,
) -> LoadResult:
    """After the engine's load: the args and tokenizer checks, the iteration, the LR schedule and the RNG state."""
    weights_only = cfg.no_load_optim or cfg.finetune
    saved_args = dict(client.get("args", {}))
    if layout_changed:  # the layout (and with it the vocab padding) was converted on purpose
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
