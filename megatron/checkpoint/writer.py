"""Shard a full GPT-NeoX state dict into any (tp, pp) layout and write it as a DeepSpeed checkpoint.

The output loads with ``engine.load_checkpoint`` (our training's ``load``) and with GPT-NeoX's tools:
``<root>/latest``, ``<root>/global_step<N>/mp_rank_XX_model_states.pt`` (pp=0: weights under ``module``;
pipe: engine state only) and ``layer_LL-model_TT-model_states.pt`` (pipe), ``configs/``, ``manifest.json``.
Everything is written to a staging directory next to ``root`` and renamed into place at the end, so a failure
never leaves a partial output directory behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.bias_layout import ROW_BIAS_KEY, is_row_bias, to_disk, written_layout
from megatron.checkpoint.layout import CheckpointError, layer_file, mp_rank_file
from megatron.checkpoint.manifest import write_manifest
from megatron.checkpoint.reader import FORMAT, FORMAT_KEY
from megatron.checkpoint.rules import layer_index, split_tensor
from megatron.checkpoint.tags import checkpoint_tag
from megatron.model.config import GPTModelConfig

logger = logging.getLogger(__name__)


@dataclass
class TargetLayout:
    """What to write: TP size, PP size (0 = sequential ``module`` files) and the DP size recorded for DeepSpeed."""

    tp: int = 1
    pp: int = 0
    dp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 0 or self.dp < 1:
            raise ValueError(f"invalid target layout tp={self.tp} pp={self.pp} (need tp >= 1, pp >= 0)")

    @property
    def stages(self) -> int:
        """Pipeline stages (1 for a sequential model)."""
        return max(self.pp, 1)


@contextlib.contextmanager
def staged_output(root: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging directory that becomes ``root`` on success and is removed on any failure."""
    root = Path(root)
    if root.exists() and not overwrite:
        raise CheckpointError(f"output directory {root} already exists (pass --overwrite to replace it)")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if root.exists():
        shutil.rmtree(root)
    staging.rename(root)


def check_divisible(cfg: GPTModelConfig, tp: int) -> None:
    """TP must divide heads, KV heads, the padded vocabulary and the MLP width."""
    problems = []
    for what, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_kv_heads", cfg.kv_heads),
        ("padded_vocab_size", cfg.vocab_rows),
        ("MLP width", cfg.mlp_sizes[1]),
    ):
        if value % tp:
            problems.append(f"{what}={value}")
    if problems:
        raise CheckpointError(f"tp={tp} does not divide {', '.join(problems)}")


def engine_fields(target: TargetLayout, iteration: int, base: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's engine-state keys of an ``mp_rank`` file (copied from ``base`` where it has them)."""
    return {
        "lr_scheduler": base.get("lr_scheduler"),
        "data_sampler": base.get("data_sampler"),
        "random_ltd": base.get("random_ltd"),
        "sparse_tensor_module_names": base.get("sparse_tensor_module_names", set()),
        "skipped_steps": base.get("skipped_steps", 0),
        "global_steps": base.get("global_steps", iteration),
        "global_samples": base.get("global_samples", 0),
        "dp_world_size": target.dp,
        "mp_world_size": target.tp * target.stages,
        "checkpoint_parallel_dimensions": {"pp_degree": target.stages, "tp_degree": target.tp},
        "ds_config": base.get("ds_config"),
        "ds_version": base.get("ds_version"),
    }


def write_checkpoint(
    state_dict: dict[str, torch.Tensor],
    cfg: GPTModelConfig,
    root: str | Path,
    target: TargetLayout,
    *,
    iteration: int = 0,
    client_state: dict[str, Any] | None = None,
    rank_client_state: Callable[[int], dict[str, Any]] | None = None,
    optimizer_state: Callable[[int, int], dict[str, Any] | None] | None = None,
    config_files: dict[str, str] | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write ``state_dict`` (full layout) as a DeepSpeed checkpoint ``root/global_step<iteration>`` for ``target``.

    ``client_state``: GPT-NeoX client state (``args`` is updated for the new layout); ``rank_client_state(tp_rank)``
    adds per-TP-rank entries (RNG tracker states); ``optimizer_state(stage, tp_rank)`` gives the ``optimizer`` entry
    of that slice (None = weights only). ``extra_files`` are written at ``root`` (e.g. ``neox_config.yml``).
    Returns the checkpoint directory.
    """
    check_divisible(cfg, target.tp)
    base = dict(client_state or {})
    base.pop("module", None)
    base.pop("optimizer", None)
    args = dict(base.get("args") or {})
    args.update(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        padded_vocab_size=cfg.padded_vocab_size,
        model_parallel_size=target.tp,
    )
    base["args"] = args
    base["iteration"] = iteration
    base[FORMAT_KEY] = FORMAT
    bias_layout = written_layout(cfg.gpt_j_residual, target.tp)
    base[ROW_BIAS_KEY] = bias_layout
    tag = checkpoint_tag(iteration)
    # every tensor split once: shards[key][tp_rank]; row-parallel biases as GPT-NeoX stores them at this TP
    shards = {}
    for key, full in state_dict.items():
        parts = split_tensor(key, full, cfg, target.tp)
        if is_row_bias(key):
            parts = [to_disk(t, bias_layout, target.tp) for t in parts]
        shards[key] = [t.contiguous().clone() for t in parts]
    with staged_output(root, overwrite) as staging:
        directory = staging / tag
        directory.mkdir()
        if target.pp == 0:
            for tp_rank in range(target.tp):
                module = {key: parts[tp_rank] for key, parts in shards.items()}
                _write_mp_file(directory, tp_rank, module, target, iteration, base, rank_client_state, optimizer_state)
                if progress:
                    progress(mp_rank_file(tp_rank))
        else:
            by_layer: dict[int, list[str]] = {}
            for key in shards:
                by_layer.setdefault(layer_index(key), []).append(key)
            for idx, keys in sorted(by_layer.items()):
                prefix = f"sequential.{idx}."
                for tp_rank in range(target.tp):
                    sd = {key[len(prefix) :]: shards[key][tp_rank] for key in keys}
                    torch.save(sd, directory / layer_file(idx, tp_rank))
                if progress:
                    progress(f"layer_{idx:02d}")
            for stage in range(target.pp):
                for tp_rank in range(target.tp):
                    _write_mp_file(
                        directory,
                        stage * target.tp + tp_rank,
                        None,
                        target,
                        iteration,
                        base,
                        rank_client_state,
                        optimizer_state,
                        stage=stage,
                        tp_rank=tp_rank,
                    )
        configs = directory / "configs"
        configs.mkdir()
        for name, text in (config_files or {}).items():
            (configs / os.path.basename(name)).write_text(text)
        for name, text in (extra_files or {}).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)
        (staging / "latest").write_text(tag)
        layout = {"tp": target.tp, "pp": target.pp}
        write_manifest(directory, tag=tag, iteration=iteration, layout=layout, **{ROW_BIAS_KEY: bias_layout})
    logger.info("wrote %s checkpoint tp=%d pp=%d to %s", tag, target.tp, target.pp, root)
    return Path(root) / tag


def _write_mp_file(
    directory: Path,
    mp_rank: int,
    module: dict[str, torch.Tensor] | None,
    target: TargetLayout,
    iteration: int,
    base: dict[str, Any],
    rank_client_state: Callable[[int], dict[str, Any]] | None,
    optimizer_state: Callable[[int, int], dict[str, Any] | None] | None,
    *,
    stage: int = 0,
    tp_rank: int | None = None,
) -> None:
    tp_rank = mp_rank if tp_rank is None else tp_rank
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": [],
        "optimizer": optimizer_state(stage, tp_rank) if optimizer_state else None,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        **engine_fields(target, iteration, base),
    }
    for key, value in base.items():
        state.setdefault(key, value)
    if rank_client_state is not None:
        state.update(rank_client_state(tp_rank))
    torch.save(state, directory / mp_rank_file(mp_rank))
