"""Loading files a user hands us without running their code: ``weights_only`` unpickling and path confinement.

Every ``torch.load`` of a checkpoint, ours or DeepSpeed's own, runs with ``weights_only=True`` and an allow-list of
the few non-tensor types DeepSpeed and GPT-NeoX checkpoints hold (numpy RNG state, DeepSpeed's loss scaler, ZeRO
stage enum and fragment addresses, a universal checkpoint's sub-parameter shapes). DeepSpeed calls ``torch.load(..., weights_only=False)`` itself, so
:func:`safe_loading` also sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` while it is active, which makes torch ignore that
argument. A file that needs anything else is refused with a message naming the file and the type; a user who trusts
the file can allow full unpickling with ``--trust-checkpoint`` on the tools or ``NEOX_FORGE_TRUST_CHECKPOINT=1``
(logged as a warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRUST_ENV = "NEOX_FORGE_TRUST_CHECKPOINT"
FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(ValueError):
    """A file holds Python objects outside the allow-list (it could run code when unpickled)."""


def allowed_globals() -> list[Any]:
    """The non-tensor types of DeepSpeed / GPT-NeoX checkpoints that are safe to rebuild."""
    import numpy as np
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape  # a universal checkpoint's sub-param layout
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # numpy >= 2 has _core, 1.x only core; the stubs of either version lack the other
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct  # type: ignore[attr-defined]
    dtypes = [type(np.dtype(name)) for name in ("uint32", "int64", "float32", "float64", "bool")]
    return [
        *(reconstruct, np.ndarray, np.dtype, *dtypes),
        *(LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, SubparamShape),
    ]


def trusted() -> bool:
    """True when the user asked for full unpickling (``--trust-checkpoint`` / ``NEOX_FORGE_TRUST_CHECKPOINT=1``)."""
    return os.environ.get(TRUST_ENV) == "1"


def trust_checkpoints() -> None:
    """``--trust-checkpoint``: allow full unpickling of checkpoint files for this process (logged)."""
    os.environ[TRUST_ENV] = "1"
    logger.warning(
        "--trust-checkpoint: checkpoint files are fully unpickled and can run code; only for files you trust"
    )


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Every ``torch.load`` inside (also DeepSpeed's) is ``weights_only`` with the checkpoint allow-list."""
    if trusted():
        yield
        return
    previous = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = previous


def is_unsafe_error(error: BaseException) -> bool:
    """True for torch's refusal to unpickle a type outside the allow-list."""
    text = str(error)
    return "Weights only load failed" in text or "weights_only" in text


def unsafe_message(path: str | Path, error: BaseException) -> str:
    """One line: which file, which type, and how to allow it if the file is trusted."""
    text = str(error)
    detail = next((ln.strip() for ln in text.splitlines() if "GLOBAL" in ln or "Unsupported" in ln), text[:200])
    return (
        f"{path} holds Python objects outside the checkpoint allow-list ({detail}); it was not unpickled because "
        f"that could run code. If you trust this file, rerun with --trust-checkpoint (tools) or {TRUST_ENV}=1"
    )


def safe_torch_load(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load`` on CPU of a user file with the allow-list; unsafe content raises :class:`UnsafeCheckpointError`.

    ``mmap``: map the tensors' storage instead of reading it (only what is touched is read), for files in the zip
    format (torch >= 1.6); older files are read whole."""
    with safe_loading():
        try:
            if mmap and zipfile.is_zipfile(path):
                return torch.load(path, map_location="cpu", weights_only=not trusted(), mmap=True)
            return torch.load(path, map_location="cpu", weights_only=not trusted())
        except Exception as e:
            if is_unsafe_error(e):
                raise UnsafeCheckpointError(unsafe_message(path, e)) from None
            raise
