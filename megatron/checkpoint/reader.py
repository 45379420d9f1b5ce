"""Read a GPT-NeoX / DeepSpeed checkpoint of any TP/PP layout into one full state dict in GPT-NeoX names.

Full keys are ``sequential.<spec idx>.<name>`` (the tp=1, pp=0 layout): embedding 0, layer ``i`` at ``i + 2``,
final norm ``L + 3``, untied output layer ``L + 4``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron import mpu
from megatron.checkpoint import config_io
from megatron.checkpoint.bias_layout import SPLIT, is_row_bias, stored_layout
from megatron.checkpoint.finite import nonfinite_message, nonfinite_tensor
from megatron.checkpoint.layout import CheckpointError, CheckpointLayout, detect_layout, resolve_checkpoint_dir
from megatron.checkpoint.rules import merge_tensor, rename_legacy
from megatron.checkpoint.safe_load import UnsafeCheckpointError, safe_loading, safe_torch_load
from megatron.checkpoint.structure import checkpoint_structure
from megatron.checkpoint.tags import tag_iteration
from megatron.model import build_sequential_model
from megatron.model.config import GPTModelConfig
from megatron.model.tp_sharding import partition_spec
from megatron.tokenizer.tokenizer import TokenizerConfig

logger = logging.getLogger(__name__)

FORMAT_KEY = "checkpoint_format"
FORMAT = "neox-forge"
ENGINE_KEYS = ("module", "optimizer", "buffer_names")


def load_torch(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` on CPU with ``weights_only`` and the checkpoint allow-list (``safe_load``); a clear error for
    unreadable files and for files holding other Python objects. ``mmap``: see ``safe_torch_load``."""
    try:
        return safe_torch_load(path, mmap=mmap)
    except UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # any unpickling/IO error means a bad input file
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None


@dataclass
class NeoXCheckpoint:
    """A checkpoint read into memory: the full state dict plus what a writer needs to reproduce the rest."""

    state_dict: dict[str, torch.Tensor]
    cfg: GPTModelConfig
    layout: CheckpointLayout
    client_state: dict[str, Any]
    tokenizer: TokenizerConfig | None = None  # from the config files read (None when the caller gave the model)
    tp_shard: tuple[int, int] | None = None  # (rank, size) when state_dict holds one TP rank's tensors
    config_files: dict[str, str] = field(default_factory=dict)

    @property
    def iteration(self) -> int:
        """The training iteration the checkpoint was saved at (from its client state, else the tag)."""
        it = self.client_state.get("iteration", self.client_state.get("total_iters"))
        if it is None:
            return tag_iteration(self.layout.tag) or 0
        return int(it or 0)


def engine_state(layout: CheckpointLayout, mp_rank: int = 0, mmap: bool = False) -> dict[str, Any]:
    """``mp_rank_XX_model_states.pt`` of a checkpoint (empty dict when a pipe checkpoint has none). ``mmap``: its
    weights (a sequential checkpoint's ``module``) are read only where touched; for callers that are done with them
    before anything may rewrite the file (a mapped file truncated under its reader faults)."""
    if not layout.mp_files:
        return {}
    state = load_torch(layout.mp_files[mp_rank], mmap=mmap)
    if not isinstance(state, dict):
        raise CheckpointError(f"{layout.mp_files[mp_rank]} is not a DeepSpeed model-states dict")
    return state


def is_neox_forge(layout: CheckpointLayout, client_state: dict[str, Any]) -> bool:
    """Written by neox-forge (TP-invariant row-parallel biases) rather than by GPT-NeoX."""
    return client_state.get(FORMAT_KEY) == FORMAT or (layout.directory / "manifest.json").is_file()


EMBEDDING_KEY = "sequential.0.word_embeddings.weight"
KeyFilter = Callable[[str], bool]


def read_tp_shards(
    layout: CheckpointLayout,
    progress: Callable[[str], None] | None = None,
    keep: KeyFilter | None = None,
    mmap: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], list[list[str]]]:
    """Per TP rank: the rank's tensors under full keys, and per mp_rank file the buffer names (sequential only).

    ``keep(full_key)`` (a test on the ``sequential.<idx>.`` prefix): pipeline layer files of rejected specs are not
    read and rejected tensors of the sequential files are dropped as each file is read (ZeRO-3 shards are
    consolidated whole; :func:`read_checkpoint` filters the merged result). ``mmap``: the model files are
    memory-mapped, so only the tensors the caller touches are read from disk.
    """
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tp)]
    buffers: list[list[str]] = []
    if layout.zero3_files:
        for tp_rank in range(layout.tp):
            if progress:
                progress(f"ZeRO-3 mp_rank {tp_rank:02d}")
            shards[tp_rank] = rename_legacy(zero3_state_dict(layout.zero3_files[tp_rank]))
        return shards, buffers
    if layout.is_pipe:
        for idx, files in layout.layer_files.items():
            if keep is not None and not keep(f"sequential.{idx}."):
                continue  # keep() decides by spec prefix: this stage's layers are not in this file
            for tp_rank, path in enumerate(files):
                if progress:
                    progress(path.name)
                sd = load_torch(path, mmap)
                if not isinstance(sd, dict):
                    raise CheckpointError(f"{path} is not a state dict")
                for key, value in rename_legacy(sd).items():
                    shards[tp_rank][f"sequential.{idx}.{key}"] = value
        return shards, buffers
    for tp_rank, path in enumerate(layout.mp_files):
        if progress:
            progress(path.name)
        state = load_torch(path, mmap)
        module = state.get("module") if isinstance(state, dict) else None
        if not isinstance(module, dict):
            raise CheckpointError(f"{path} has no 'module' weights (saved with ZeRO-3 or without a model?)")
        buffers.append(list(state.get("buffer_names") or []))
        for key, value in rename_legacy(module).items():
            if not torch.is_tensor(value):
                continue
            key = key.removeprefix("module.")
            if not key.startswith("sequential."):
                head, _, rest = key.partition(".")
                if not head.isdigit():
                    raise CheckpointError(f"{path}: unexpected tensor name {key!r} (expected sequential.<idx>.<name>)")
                key = f"sequential.{head}.{rest}"
            if keep is None or keep(key):
                shards[tp_rank][key] = value
        del state, module  # only the kept tensors of this file stay referenced
    return shards, buffers


def _rows(embedding: torch.Tensor | None) -> int | None:
    return None if embedding is None else int(embedding.size(0))


def _embedding_rows(layout: CheckpointLayout, mp0_state: dict[str, Any]) -> int | None:
    """Rows of TP rank 0's word-embedding shard, read without loading the rest of the model: from the layer-00
    file of a pipeline checkpoint (memory-mapped: only its metadata is read), else from ``mp_rank_00``'s module
    (already loaded)."""
    if layout.is_pipe:
        sd = load_torch(layout.layer_files[min(layout.layer_files)][0], mmap=True)
        return _rows(rename_legacy(sd).get("word_embeddings.weight")) if isinstance(sd, dict) else None
    module = mp0_state.get("module")
    if not isinstance(module, dict):
        return None
    for key, value in rename_legacy(module).items():
        if key.removeprefix("module.").removeprefix("sequential.") == "0.word_embeddings.weight":
            return _rows(value)
    return None


def zero3_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """The fp32 weights of one model-parallel rank of a ZeRO-3 checkpoint, via DeepSpeed's ``zero_to_fp32``.

    ``zero_to_fp32`` consolidates every shard in a directory, so this rank's files are linked into a scratch
    directory under the ``mp_rank_00`` names it expects.
    """
    import tempfile

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory(prefix="neox-zero3-") as tmp:
        tag_dir = Path(tmp) / "tag"
        tag_dir.mkdir()
        for path in files:
            name = re.sub(r"_mp_rank_\d+_", "_mp_rank_00_", path.name)
            (tag_dir / name).symlink_to(path.resolve())
        chatter = io.StringIO()  # zero_to_fp32 prints its progress
        try:
            with contextlib.redirect_stdout(chatter), safe_loading():
                sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="tag")
        except Exception as e:  # DeepSpeed raises assorted errors for incomplete shard sets
            raise CheckpointError(f"cannot consolidate ZeRO-3 shards {[p.name for p in files]}: {e}") from None
        logger.debug("zero_to_fp32: %s", chatter.getvalue())
    return {k.removeprefix("module."): v for k, v in sd.items() if torch.is_tensor(v)}


def _check_same_keys(shards: list[dict[str, torch.Tensor]], rank: int, where: str) -> None:
    """Every TP rank holds the same tensor names as ``rank``."""
    for other, sd in enumerate(shards):
        if set(sd) != set(shards[rank]):
            extra = sorted(set(sd) ^ set(shards[rank]))[:5]
            raise CheckpointError(f"{where}: TP rank {other} has different tensors than rank {rank} (e.g. {extra})")


def merge_shards(
    shards: list[dict[str, torch.Tensor]], cfg: GPTModelConfig, *, sum_row_biases: bool, where: str
) -> dict[str, torch.Tensor]:
    """Merge per-TP-rank tensors into the full layout with each tensor's rule."""
    _check_same_keys(shards, 0, where)
    keys = list(shards[0])
    full = {}
    for key in keys:
        try:
            full[key] = merge_tensor(key, [sd[key] for sd in shards], cfg, sum_row_biases=sum_row_biases)
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"{where}: cannot merge {key}: {e}") from None
    return full


def own_shard(
    shards: list[dict[str, torch.Tensor]], rank: int, cfg: GPTModelConfig, *, sum_row_biases: bool, where: str
) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s tensors as its model holds them: its own file's, except row-parallel biases stored as
    per-rank shares (``sum_row_biases``), which hold the sum over the ranks (as :func:`merge_shards` gives)."""
    _check_same_keys(shards, rank, where)
    mine = shards[rank]
    out = dict(mine)
    if sum_row_biases:
        for key in (k for k in mine if is_row_bias(k)):
            out[key] = merge_tensor(key, [sd[key] for sd in shards], cfg, sum_row_biases=True)
    return out


def full_shapes(cfg: GPTModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → full (tp=1) shape of every tensor of the model, also inside a run whose ``mpu`` is initialised."""
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    with torch.device("meta"):
        local = {k: list(v.shape) for k, v in build_sequential_model(cfg).state_dict().items()}
    for name, shape in local.items():
        dim = partition_spec(name, cfg)[0]
        if dim is not None and tp > 1:
            shape[dim] *= tp  # the layers were built as this rank's shard
    return {k: tuple(v) for k, v in local.items()}


def _shard_shape(name: str, shape: tuple[int, ...], cfg: GPTModelConfig, tp: int) -> tuple[int, ...]:
    dim = partition_spec(name, cfg)[0]
    return shape if dim is None or tp == 1 else tuple(n // tp if d == dim else n for d, n in enumerate(shape))


BENIGN_EXTRAS = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def check_against_config(
    state_dict: dict[str, torch.Tensor],
    cfg: GPTModelConfig,
    where: str,
    keep: KeyFilter | None = None,
    tp: int = 1,
) -> dict[str, torch.Tensor]:
    """The merged tensors must be those of the configured model (names and shapes): catches a mismatched config.
    With ``keep``, only the model's tensors it accepts are expected; with ``tp`` > 1, one TP rank's shards.

    Returns ``state_dict`` without buffers the configured model does not persist (e.g. GPT-NeoX's saved rotary
    ``inv_freq``).
    """
    expected = {k: _shard_shape(k, v, cfg, tp) for k, v in full_shapes(cfg).items() if keep is None or keep(k)}
    rm_key = f"sequential.{cfg.num_layers + 4}.rm_linear.weight"
    if rm_key in state_dict:  # a reward model (train_impl: rm): rm_linear (hidden -> 1) replaces the LM head
        expected = {k: v for k, v in expected.items() if not k.endswith("final_linear.weight")}
        expected[rm_key] = _shard_shape(rm_key, (1, cfg.hidden_size), cfg, tp)
    state_dict = {k: v for k, v in state_dict.items() if k in expected or not k.endswith(BENIGN_EXTRAS)}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: checkpoint {got[k]} vs config {expected[k]}" for k in expected if k in got and got[k] != expected[k]
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch " + "; ".join(wrong[:4]))
        if missing:
            parts.append(f"missing {missing[:4]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}")
        raise CheckpointError(f"{where} does not match the model config: " + "; ".join(parts))
    return state_dict


def _source_file(layout: CheckpointLayout, key: str, tp_rank: int) -> str:
    """The file TP rank ``tp_rank``'s tensor ``key`` (``sequential.<idx>.<name>``) was read from."""
    if layout.zero3_files:
        return f"{layout.directory} (ZeRO-3 shards of mp_rank {tp_rank:02d})"
    if layout.is_pipe:
        return str(layout.layer_files[int(key.split(".")[1])][tp_rank])
    return str(layout.mp_files[tp_rank])


def check_finite_weights(
    full: dict[str, torch.Tensor], shards: list[dict[str, torch.Tensor]], layout: CheckpointLayout
) -> None:
    """The tensors returned hold no NaN/inf (merging keeps them); a bad one is traced to its file. Only what the
    caller gets is tested, so a selective (memory-mapped) read still touches only its own tensors."""
    found = nonfinite_tensor(full.items())
    if found is None:
        return
    key = found[0]
    for tp_rank, shard in enumerate(shards):
        in_file = nonfinite_tensor([(key, shard[key])]) if key in shard else None
        if in_file is not None:
            raise CheckpointError(nonfinite_message(_source_file(layout, key, tp_rank), in_file))
    raise CheckpointError(nonfinite_message(layout.directory, found))


def read_checkpoint(
    path: str | Path,
    *,
    config_files: list[str | Path] | None = None,
    model: GPTModelConfig | Callable[[int], GPTModelConfig] | None = None,
    iteration: int | None = None,
    row_bias: str = "auto",
    progress: Callable[[str], None] | None = None,
    keep_for: Callable[[GPTModelConfig], KeyFilter] | None = None,
    tp_shard: tuple[int, int] | None = None,
) -> NeoXCheckpoint:
    """Read the checkpoint at ``path`` (root with ``latest`` or a ``global_stepN`` dir) into a full state dict.

    The model config is ``model`` (its ``padded_vocab_size`` replaced by the checkpoint's; a function builds it for
    the checkpoint's padded vocabulary), else read from ``config_files``, else from the checkpoint's own ``configs/``. ``row_bias``: ``auto`` (the checkpoint's recorded layout, else GPT-NeoX's rule: summed over TP
    when ``gpt_j_residual``; see ``megatron.checkpoint.bias_layout``), ``effective`` or ``sum``.

    ``keep_for(model config)`` returns a key filter (see :func:`read_tp_shards`): only those tensors are read and
    merged, e.g. one pipeline stage's layers, so a rank never holds the whole model (not for ZeRO-3 shards, which
    are consolidated whole).

    ``tp_shard=(rank, size)``: when the checkpoint was saved at TP ``size`` (not ZeRO-3), return TP rank ``rank``'s
    own tensors as its model holds them (``NeoXCheckpoint.tp_shard`` set) instead of the merged ones: the files are
    memory-mapped and only that rank's tensors (and the other ranks' row-parallel biases, when they are summed) are
    read. Otherwise the full tensors are returned (``tp_shard`` None) for the caller to cut. Selective reads
    (``keep_for``, ``tp_shard``) return tensors backed by the memory-mapped files: copy them (``load_state_dict``)
    before anything rewrites those files.
    """
    if row_bias not in ("auto", "effective", "sum"):
        raise ValueError(f"row_bias={row_bias!r} must be auto, effective or sum")
    with checkpoint_structure(path):  # a pickled value of an unexpected type: one line naming the checkpoint
        return _read_checkpoint(path, config_files, model, iteration, row_bias, progress, keep_for, tp_shard)


def _read_checkpoint(
    path: str | Path,
    config_files: list[str | Path] | None,
    model: GPTModelConfig | Callable[[int], GPTModelConfig] | None,
    iteration: int | None,
    row_bias: str,
    progress: Callable[[str], None] | None,
    keep_for: Callable[[GPTModelConfig], KeyFilter] | None,
    tp_shard: tuple[int, int] | None,
) -> NeoXCheckpoint:
    directory = resolve_checkpoint_dir(path, iteration)
    layout = detect_layout(directory)
    own = tp_shard if tp_shard is not None and tp_shard[1] == layout.tp > 1 and not layout.zero3_files else None
    selective = (keep_for is not None or own is not None) and not layout.zero3_files
    state = engine_state(layout, mmap=selective)
    expected_mp = state.get("mp_world_size")
    if isinstance(expected_mp, int) and expected_mp != len(layout.mp_files):
        have = {p.name for p in layout.mp_files}
        missing = [
            f"mp_rank_{r:02d}_model_states.pt"
            for r in range(expected_mp)
            if f"mp_rank_{r:02d}_model_states.pt" not in have
        ]
        raise CheckpointError(
            f"{directory} was saved by {expected_mp} model-parallel ranks but has {len(layout.mp_files)} "
            f"mp_rank files; missing: {', '.join(missing) or 'none (extra files?)'}"
        )
    client = {k: v for k, v in state.items() if k not in ENGINE_KEYS}
    config = None
    if model is None:
        config = config_io.load_neox_args(config_files) if config_files else config_io.checkpoint_config_args(directory)
        if config is None:
            raise CheckpointError(f"{directory} has no configs/ to read the model from: pass the config file(s)")
    shards = [] if selective else read_tp_shards(layout, progress)[0]
    rows = _embedding_rows(layout, state) if selective else _rows(shards[0].get(EMBEDDING_KEY))
    if rows is None:
        raise CheckpointError(f"{directory}: no word embedding ({EMBEDDING_KEY}) found")
    try:
        if isinstance(model, GPTModelConfig):
            cfg = model.replace(padded_vocab_size=rows * layout.tp)
        elif model is not None:
            cfg = model(rows * layout.tp)
        else:
            assert config is not None
            cfg = config_io.model_config(config, padded_vocab_size=rows * layout.tp)
    except ValueError as e:
        raise CheckpointError(f"model config for {directory}: {e}") from None
    keep = keep_for(cfg) if keep_for is not None else None
    if selective:
        shards = read_tp_shards(layout, progress, keep, mmap=own is not None)[0]
    ckpt_args = client.get("args") or {}
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if key in ckpt_args and ckpt_args[key] != getattr(cfg, key):
            raise CheckpointError(
                f"{directory} was saved with {key}={ckpt_args[key]} but the config says {getattr(cfg, key)}"
            )
    stored = stored_layout(directory, gpt_j_residual=cfg.gpt_j_residual, tp=layout.tp, client_state=client)
    sum_biases = row_bias == "sum" or (row_bias == "auto" and stored == SPLIT and layout.tp > 1)
    if sum_biases:
        logger.info("row-parallel biases summed over %d TP ranks (GPT-NeoX's parallel-residual layout)", layout.tp)
    if own is not None:
        full = own_shard(shards, own[0], cfg, sum_row_biases=sum_biases, where=str(directory))
    else:
        full = merge_shards(shards, cfg, sum_row_biases=sum_biases, where=str(directory))
    if keep is not None:
        full = {k: v for k, v in full.items() if keep(k)}
    full = check_against_config(full, cfg, str(directory), keep, tp=layout.tp if own is not None else 1)
    check_finite_weights(full, shards, layout)
    return NeoXCheckpoint(
        tp_shard=own,
        state_dict=full,
        cfg=cfg,
        layout=layout,
        client_state=client,
        tokenizer=None if config is None else TokenizerConfig.from_neox_args(config),
        config_files=config_io.config_files_text(directory),
    )
