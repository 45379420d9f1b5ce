"""Where the files of a GPT-NeoX / DeepSpeed checkpoint are, and which (TP, PP) layout they encode.

```
<root>/latest                                  "global_step<N>"
<root>/global_step<N>/
  mp_rank_XX_model_states.pt                   one per model-parallel slice (pp=0: TP rank; pipe: stage·tp + tp rank)
                                               pp=0: weights under "module" ("sequential.<idx>.<name>")
  layer_LL-model_TT-model_states.pt            pipe only: weights of spec LL on TP rank TT (no prefix)
  [bf16_]zero_pp_rank_D_mp_rank_XX_*.pt        ZeRO shards
  configs/                                     YAML files (+ resolved_config.json)
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed.runtime import utils as ds_utils

from megatron.checkpoint.partition import partition_balanced
from megatron.checkpoint.tags import checkpoint_dirs, checkpoint_tag
from megatron.errors import UserError
from megatron.model.config import GPTModelConfig
from megatron.model.pipe_partition import resolve_partition_method

MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
ZERO3_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written as asked (names the file and what would be valid)."""


def confined(root: str | Path, name: str, what: str) -> Path:
    """``root / name`` when it stays inside ``root`` (no ``..``, no absolute path, no symlink escape), else an error."""
    base = Path(root).resolve()
    if not name or "\0" in name or Path(name).is_absolute():
        raise CheckpointError(f"{what} names {name!r}, which is outside {root}; refusing to follow it")
    target = (base / name).resolve()
    if target != base and base not in target.parents:
        raise CheckpointError(f"{what} names {name!r}, which is outside {root}; refusing to follow it")
    return Path(root) / name


def checkpoint_folder(root: str | Path, tag: str, what: str) -> Path:
    """``root / tag`` for a tag read from ``latest`` or picked from ``root``'s folders: one plain folder name (not
    ``.``/``..``, no path separator) whose folder, followed through symlinks, stays inside ``root``."""
    if tag in ("", ".", "..") or "/" in tag or "\\" in tag or "\0" in tag or len(tag.encode()) > 255:
        shown = repr(tag) if len(tag) <= 80 else f"{tag[:60]!r}... ({len(tag)} characters)"
        raise CheckpointError(
            f"{what} names {shown}, which is not a checkpoint folder name (expected one folder inside {root}, "
            "e.g. global_step100)"
        )
    target = Path(root) / tag
    if target.is_symlink():
        base, resolved = Path(root).resolve(), target.resolve()
        if resolved != base and base not in resolved.parents:
            raise CheckpointError(
                f"checkpoint folder {target} ({what}) is a symlink to {resolved}, outside {root}; refusing to follow "
                "it (copy the checkpoint into the folder, or point load at its own folder)"
            )
    return confined(root, tag, what)


def read_latest(root: str | Path) -> str | None:
    """The tag ``root/latest`` names, checked with :func:`checkpoint_folder`; None without a ``latest`` file."""
    latest = Path(root) / "latest"
    if not latest.is_file():
        return None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {latest} ({type(e).__name__}: {e})") from None
    checkpoint_folder(root, tag, str(latest))
    return tag


def mp_rank_file(mp_rank: int) -> str:
    """DeepSpeed's name of the engine-state file of model-parallel slice ``mp_rank``."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def layer_file(spec_index: int, tp_rank: int) -> str:
    """DeepSpeed's name of the weights of pipeline spec ``spec_index`` on TP rank ``tp_rank``."""
    return f"layer_{spec_index:02d}-model_{tp_rank:02d}-model_states.pt"


def resolve_checkpoint_dir(path: str | Path, iteration: int | None = None) -> Path:
    """The ``global_stepN`` directory for ``path``: itself, or the tag named by ``path/latest`` (or ``iteration``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if iteration is not None:
        target = path / checkpoint_tag(iteration)
        if not target.is_dir():
            raise CheckpointError(f"no checkpoint {target} (iteration {iteration})")
        return checkpoint_folder(path, target.name, f"iteration {iteration}")
    if any(MP_RE.match(p.name) or LAYER_RE.match(p.name) or ZERO3_RE.match(p.name) for p in path.iterdir()):
        return path
    tag = read_latest(path)
    if tag is not None:
        target = path / tag
        if not target.is_dir():
            raise CheckpointError(f"{path / 'latest'} names {tag!r} but {target} does not exist")
        return target
    steps = [p.name for p in checkpoint_dirs(path)]
    hint = f"; it has {', '.join(steps)}" if steps else ""
    raise CheckpointError(
        f"{path} is not a checkpoint: no mp_rank_XX_model_states.pt / layer_XX-model_XX-model_states.pt / "
        f"zero_pp_rank_X_mp_rank_XX_model_states.pt files and no 'latest' file{hint}"
    )


@dataclass
class CheckpointLayout:
    """The files of one checkpoint and the layout they encode (``pp == 0``: sequential model)."""

    directory: Path
    tp: int
    pp: int
    mp_files: list[Path]
    layer_files: dict[int, list[Path]] = field(default_factory=dict)
    zero3_files: dict[int, list[Path]] = field(default_factory=dict)  # mp rank -> its ZeRO-3 model+optim shards

    @property
    def is_pipe(self) -> bool:
        """Per-layer files (``layer_LL-model_TT``) rather than one ``module`` per TP rank."""
        return bool(self.layer_files)

    @property
    def tag(self) -> str:
        """The directory name (``global_stepN``)."""
        return self.directory.name

    def describe(self) -> str:
        """``tp=2 pp=2 (pipe)`` style summary."""
        kind = "pipe" if self.is_pipe else "sequential, ZeRO-3" if self.zero3_files else "sequential"
        return f"tp={self.tp} pp={self.pp} ({kind})"


def _numbered(files: list[Path], regex: re.Pattern[str], what: str, directory: Path) -> dict[int, Path]:
    out = {int(regex.match(p.name).group(1)): p for p in files}  # type: ignore[union-attr]
    missing = sorted(set(range(max(out) + 1)) - set(out)) if out else []
    if missing:
        raise CheckpointError(
            f"{directory}: {what} shard(s) {', '.join(f'{m:02d}' for m in missing)} missing "
            f"(found {', '.join(p.name for p in out.values())})"
        )
    return out


def detect_layout(directory: str | Path, pp_hint: int | None = None) -> CheckpointLayout:
    """Inspect a ``global_stepN`` directory; raise :class:`CheckpointError` for missing or inconsistent shards."""
    directory = Path(directory)
    names = [p for p in directory.iterdir() if p.is_file()]
    zero_models = [p for p in names if (m := ZERO3_RE.match(p.name)) and m.group(3) == "model"]
    if zero_models and not any(MP_RE.match(p.name) for p in names):
        return _zero3_layout(directory, names)
    mp = _numbered([p for p in names if MP_RE.match(p.name)], MP_RE, "mp_rank", directory)
    mp_files = [mp[i] for i in sorted(mp)]
    layer_paths = [p for p in names if LAYER_RE.match(p.name)]
    if not layer_paths:
        if not mp_files:
            raise CheckpointError(f"{directory} holds no mp_rank_XX_model_states.pt or layer_XX-*.pt files")
        return CheckpointLayout(directory, tp=len(mp_files), pp=0, mp_files=mp_files)
    by_layer: dict[int, dict[int, Path]] = {}
    for p in layer_paths:
        m = LAYER_RE.match(p.name)
        assert m is not None
        by_layer.setdefault(int(m.group(1)), {})[int(m.group(2) or 0)] = p
    tp = max(max(ranks) + 1 for ranks in by_layer.values())
    layer_files: dict[int, list[Path]] = {}
    for idx in sorted(by_layer):
        ranks = by_layer[idx]
        missing = sorted(set(range(tp)) - set(ranks))
        if missing:
            raise CheckpointError(
                f"{directory}: layer {idx:02d} lacks TP shard(s) {missing} (expected model_00..model_{tp - 1:02d})"
            )
        layer_files[idx] = [ranks[r] for r in range(tp)]
    if mp_files:
        if len(mp_files) % tp:
            raise CheckpointError(f"{directory}: {len(mp_files)} mp_rank files is not a multiple of TP size {tp}")
        pp = len(mp_files) // tp
    else:
        pp = pp_hint or 1
    return CheckpointLayout(directory, tp=tp, pp=pp, mp_files=mp_files, layer_files=layer_files)


def _zero3_layout(directory: Path, names: list[Path]) -> CheckpointLayout:
    """ZeRO-3: weights live partitioned in ``zero_pp_rank_D_mp_rank_XX_{model,optim}_states.pt`` (sequential only)."""
    by_mp: dict[int, list[Path]] = {}
    dp_ranks: dict[int, set[int]] = {}
    for p in names:
        m = ZERO3_RE.match(p.name)
        if m:
            by_mp.setdefault(int(m.group(2)), []).append(p)
            dp_ranks.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    tp = max(by_mp) + 1
    for mp in range(tp):
        if mp not in by_mp:
            raise CheckpointError(f"{directory}: ZeRO-3 shards of mp_rank {mp:02d} are missing")
        if dp_ranks[mp] != dp_ranks[0]:
            raise CheckpointError(f"{directory}: mp_rank {mp:02d} has ZeRO-3 shards of DP ranks {sorted(dp_ranks[mp])}")
    mp_files = [sorted(p for p in by_mp[mp] if p.name.endswith("_model_states.pt"))[0] for mp in range(tp)]
    return CheckpointLayout(
        directory, tp=tp, pp=0, mp_files=mp_files, zero3_files={k: sorted(v) for k, v in by_mp.items()}
    )


# ---------------------------------------------------------------------------------------------------------------
# pipeline stage partitioning (what DeepSpeed's PipelineModule does with our spec list)


def _spec_names(cfg: GPTModelConfig) -> list[tuple[str | None, Any]]:
    from deepspeed.pipe import LayerSpec

    from megatron.model.gpt2_model import build_layer_specs

    out: list[tuple[str | None, Any]] = []
    for spec in build_layer_specs(cfg):
        if isinstance(spec, LayerSpec):
            out.append((spec.typename.__name__, spec))
        else:
            out.append((getattr(spec, "__name__", None), spec))
    return out


_BOUNDS: dict[tuple[str, int, str], list[int]] = {}  # by the config's repr, the stages and the method


def stage_bounds(cfg: GPTModelConfig, pp: int, partition_method: str | None = None) -> list[int]:
    """Spec-index boundaries ``parts`` (stage ``s`` owns specs ``parts[s]:parts[s+1]``), as DeepSpeed computes them
    for the method the pipeline runs (:func:`resolve_partition_method`).

    Memoised (the planner asks once per stage and per candidate layout; ``parameters`` builds every layer).
    """
    from megatron import mpu

    method = resolve_partition_method(cfg, pp, partition_method).lower()
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1  # "parameters" counts
    key = (f"{tp}:{cfg!r}", pp, method)
    if key not in _BOUNDS:
        if len(_BOUNDS) > 256:
            _BOUNDS.clear()
        _BOUNDS[key] = _stage_bounds(cfg, pp, method)
    return list(_BOUNDS[key])


def _stage_bounds(cfg: GPTModelConfig, pp: int, method: str) -> list[int]:
    specs = _spec_names(cfg)
    if method == "uniform":
        return [int(x) for x in ds_utils.partition_uniform(num_items=len(specs), num_parts=pp)]
    if method.startswith("type:"):
        regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if name and regex.search(name) else 0 for name, _ in specs]
        if not any(weights):
            raise CheckpointError(f"pipe_partition_method {method!r} matches no layer")
        return partition_balanced(weights, pp)
    if method == "parameters":
        from deepspeed.pipe import LayerSpec

        counts = []
        for _, spec in specs:
            counts.append(sum(p.numel() for p in spec.build().parameters()) if isinstance(spec, LayerSpec) else 0)
        return partition_balanced(counts, pp)
    raise CheckpointError(f"pipe_partition_method {method!r}: supported are uniform, parameters, type:<regex>")
