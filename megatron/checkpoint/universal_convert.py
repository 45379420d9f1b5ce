"""Writing a DeepSpeed universal checkpoint from one of ours with DeepSpeed's own converter (``ds_to_universal``).

The checks before it runs turn what the converter would fail on with an assertion or a traceback into one line:
no complete checkpoint, no ``universal_checkpoint_info`` (written by saves since ``load_universal`` exists), no
ZeRO / bf16 optimizer shards (a ZeRO-0 fp32 checkpoint keeps its optimizer state in a torch state dict the
converter cannot read). After it, every parameter folder is also linked under the name the other module structure
gives it, so a pipeline run loads a sequential model's universal checkpoint and the reverse.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron.checkpoint.layout import CheckpointError, resolve_checkpoint_dir
from megatron.checkpoint.manifest import verify_checkpoint
from megatron.checkpoint.safe_load import safe_loading, safe_torch_load
from megatron.checkpoint.universal import LATEST_UNIVERSAL, TIED_PREFIX, UNIVERSAL_INFO_KEY

UNIVERSAL_SUFFIX = "_universal"
SEQUENTIAL = "sequential."  # the sequential model's parameter names (pipe_parallel_size 0)


def _check_source(directory: Path) -> None:
    problem = verify_checkpoint(directory)
    if problem:
        raise CheckpointError(f"checkpoint {directory} is incomplete: {problem}")
    model_files = sorted(directory.glob("mp_rank_*_model_states.pt")) or sorted(
        directory.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")
    )
    if not model_files:
        raise CheckpointError(f"{directory} holds no mp_rank_*_model_states.pt: not a DeepSpeed checkpoint")
    state = safe_torch_load(model_files[0], mmap=True)
    if not isinstance(state, dict) or UNIVERSAL_INFO_KEY not in state:
        raise CheckpointError(
            f"{model_files[0]} has no {UNIVERSAL_INFO_KEY} (saved by GPT-NeoX or an older neox-forge): resume it "
            "with this neox-forge and save once, then convert that checkpoint"
        )
    if not any(directory.glob("*zero_pp_rank_*_optim_states.pt")):
        raise CheckpointError(
            f"{directory} has no ZeRO optimizer shards (*zero_pp_rank_*_optim_states.pt): DeepSpeed's universal "
            "converter reads ZeRO-1/2/3 or bf16-optimizer checkpoints only; resume this one with "
            "zero_optimization.stage 1 (the optimizer state is carried over) and save once"
        )


@contextlib.contextmanager
def _without_layer_files(source: Path) -> Iterator[Path]:
    """``source``, or for a pipeline checkpoint a scratch view of it without the ``layer_*`` files.

    DeepSpeed's converter takes a folder with ``layer_*`` files for Megatron-DeepSpeed's pipeline layout and then
    requires a ``layer_01*`` file, which GPT-NeoX's layout (embedding 0, transformer layers from 2) never has. It
    reads no weights from those files (parameters come from the ZeRO shards, the topology from the model-states
    files' ``checkpoint_parallel_dimensions``), so it converts the same checkpoint without them.
    """
    layer_files = [p for p in source.iterdir() if p.name.startswith("layer_")]
    if not layer_files:
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="neox-universal-src-") as scratch:
        view = Path(scratch) / source.name
        view.mkdir()
        for item in source.iterdir():
            if not item.name.startswith("layer_"):
                (view / item.name).symlink_to(item.resolve())
        yield view


def convert_to_universal(
    input_dir: str | Path,
    output_dir: str | Path | None = None,
    *,
    iteration: int | None = None,
    workers: int = 1,
    overwrite: bool = False,
) -> Path:
    """Run ``deepspeed.checkpoint.ds_to_universal`` on a checkpoint (a ``global_stepN`` folder, or a root with
    ``latest`` / ``iteration``); returns the universal folder, ``<root>/<tag>_universal`` by default. DeepSpeed's
    converter writes ``latest_universal`` naming it in the folder above: that folder is the ``load`` of a run with
    ``load_universal: true``. ``workers`` > 1 extracts and merges in that many processes."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    source = Path(resolve_checkpoint_dir(str(input_dir), iteration))
    _check_source(source)
    out = Path(output_dir) if output_dir is not None else source.parent / f"{source.name}{UNIVERSAL_SUFFIX}"
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ValueError(f"--output_dir {out} must not be the checkpoint {source} or inside it")
    if out.exists():
        if not overwrite:
            raise ValueError(f"--output_dir {out} already exists (pass --overwrite to replace it)")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    log = io.StringIO()
    try:
        with safe_loading(), contextlib.redirect_stdout(log), _without_layer_files(source) as folder:
            args.input_folder = str(folder)
            ds_to_universal.main(args)
    except (AssertionError, KeyError, IndexError, TypeError, ValueError, RuntimeError, OSError, EOFError) as e:
        shutil.rmtree(out, ignore_errors=True)
        detail = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"DeepSpeed's ds_to_universal failed on {source}: {type(e).__name__}: {detail}") from e
    if not (out / "zero").is_dir() or (out.parent / LATEST_UNIVERSAL).read_text().strip() != out.name:
        raise CheckpointError(f"DeepSpeed's ds_to_universal wrote no universal checkpoint at {out}")
    _link_other_names(out / "zero")
    return out


def _other_name(name: str, tied: bool) -> str | None:
    """A parameter's name in the other module structure: the sequential model (``sequential.<idx>.…``) or DeepSpeed's
    pipeline (``<idx>.…``; a tied embedding ``tied_modules.embed.…``)."""
    if name.startswith(SEQUENTIAL):
        rest = name[len(SEQUENTIAL) :]
        return TIED_PREFIX + "embed." + rest[2:] if tied and rest.startswith("0.") else rest
    if name.startswith(TIED_PREFIX + "embed."):
        return SEQUENTIAL + "0." + name[len(TIED_PREFIX + "embed.") :]
    if re.match(r"\d+\.", name):
        return SEQUENTIAL + name
    return None


def _link_other_names(zero: Path) -> None:
    """Name every parameter folder also as the other module structure names it (a relative symlink), so that a
    pipeline run (``pipe_parallel_size`` >= 1) loads a sequential model's checkpoint and the reverse: DeepSpeed's
    loader looks a parameter up by its name in the run's module."""
    names = [p.name for p in zero.iterdir() if p.is_dir()]
    tied = not any(".final_linear." in name for name in names)
    for name in names:
        other = _other_name(name, tied)
        if other is not None and not (zero / other).exists():
            (zero / other).symlink_to(name, target_is_directory=True)
