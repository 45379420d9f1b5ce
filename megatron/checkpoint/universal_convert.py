"""Writing a DeepSpeed universal checkpoint from one of ours with DeepSpeed's own converter (``ds_to_universal``).

The checks before it runs turn what the converter would fail on with an assertion or a traceback into one line:
no complete checkpoint, no ``universal_checkpoint_info`` (written by saves since ``load_universal`` exists), no
ZeRO / bf16 optimizer shards (a ZeRO-0 fp32 checkpoint keeps its optimizer state in a torch state dict the
converter cannot read).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path

from megatron.checkpoint.layout import CheckpointError, resolve_checkpoint_dir
from megatron.checkpoint.manifest import verify_checkpoint
from megatron.checkpoint.safe_load import safe_loading, safe_torch_load
from megatron.checkpoint.universal import LATEST_UNIVERSAL, UNIVERSAL_INFO_KEY

UNIVERSAL_SUFFIX = "_universal"


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
        with safe_loading(), contextlib.redirect_stdout(log):
            ds_to_universal.main(args)
    except (AssertionError, KeyError, RuntimeError, FileNotFoundError) as e:
        shutil.rmtree(out, ignore_errors=True)
        raise CheckpointError(f"DeepSpeed's ds_to_universal failed on {source}: {type(e).__name__}: {e}") from e
    if not (out / "zero").is_dir() or (out.parent / LATEST_UNIVERSAL).read_text().strip() != out.name:
        raise CheckpointError(f"DeepSpeed's ds_to_universal wrote no universal checkpoint at {out}")
    return out
