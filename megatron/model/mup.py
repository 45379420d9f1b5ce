"""muP (maximal update parametrisation) as GPT-NeoX defines it: the one owner of ``use_mup`` and the ``mup_*`` keys.

GPT-NeoX delegates to Microsoft's ``mup`` package; the facts carried over (checked against mup 1.0.0 by
``tests/unit/test_mup.py`` on fixtures made with it) are:

* **base shapes**: a YAML file mapping each parameter name to its base shape, a number for a *width* dimension (one
  that grows with ``hidden_size``) and ``null`` for a finite one, written after mup's three-line comment header. A
  dimension is a width where the base model (the configured ``hidden_size``) and the *delta* model (``hidden_size ·
  mup_width_scale``) differ. GPT-NeoX writes and reads one file per rank, ``{base_shapes_file}.{rank}``.
* **width multiplier** of a parameter: ``dim / base_dim`` of its last width dimension (1 without one); ``ninf`` is its
  number of width dimensions: 2 = matrix-like (hidden weights), 1 = vector-like (embeddings, readout, biases, norms).
* **initialisation**: the weights of the parallel linear and embedding layers are drawn as in standard
  parametrisation, matrix-like ones with their std times ``width_mult ** -0.5``, and all of them times
  ``mup_init_scale``.
* **optimizer** (``MuAdam``/``MuSGD``): Adam: matrix-like parameters get ``lr / width_mult`` and ``weight_decay ·
  width_mult``; SGD: vector-like ``lr · width_mult``, ``weight_decay / width_mult``, matrix-like ``lr / r``,
  ``weight_decay · r`` with ``r`` = fan-in multiplier / fan-out multiplier. Each such group carries ``width_mult``, the
  divisor the LR schedule applies to every new learning rate (``AnnealingLR``).
* **forward**: attention scores scaled by ``1 / (head_dim · mup_attn_temp)`` instead of ``1 / sqrt(head_dim)``; the
  embedding output times ``mup_embedding_mult``; learned/sinusoidal position embeddings times
  ``mup_rp_embedding_mult``; the readout input times ``1 / (width_mult · mup_output_temp)`` (mup's ``MuReadout``).
  The model reads the first three from ``GPTModelConfig``; :func:`apply_mup` sets the readout's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron import mpu
from megatron.config_utils import NeoXValues, from_schema, neox_values, schema_defaults
from megatron.neox_arguments.errors import ConfigError

# mup's header of a base shapes file (mup.shape.__BSH_COMMENT__), so that the files are byte for byte mup's.
BASE_SHAPES_HEADER = (
    "# This is a base shape file encoded in yaml\n"
    '# - `null` indicates a dimension is "finite", i.e. a non-"width" dimension\n'
    '# - a number indicates the base dimension of an "infinite" dimension, i.e. some notion of "width"\n'
)
ADAM_LIKE = ("adam",)  # GPT-NeoX: with use_mup the optimizer must be adam (MuAdam) or sgd (MuSGD)
SGD_LIKE = ("sgd",)
# Initialisers whose draw is a normal with a width-independent std: muP's init is then the same draw rescaled.
MUP_INITS = ("normal", "scaled_normal", "wang_init", "small_init")

logger = logging.getLogger(__name__)

BaseShapes = dict[str, list[int | None]]


@dataclass
@schema_defaults
class MupConfig:
    """The muP keys the training side reads (the model's forward multipliers live in ``GPTModelConfig``)."""

    use_mup: bool = from_schema()
    coord_check: bool = from_schema()
    save_base_shapes: bool = from_schema()
    base_shapes_file: str | None = from_schema()
    mup_init_scale: float = from_schema()
    mup_output_temp: float = from_schema()
    mup_width_scale: int = from_schema()

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> MupConfig:
        """Read the keys; ``use_mup`` needs ``base_shapes_file`` (GPT-NeoX: the path the shapes are saved to/read)."""
        cfg = cls(**neox_values(cls, args))
        for key in ("save_base_shapes", "coord_check"):
            if getattr(cfg, key) and not cfg.use_mup:
                logger.warning("%s is ignored without use_mup: true (as in GPT-NeoX)", key)
        if cfg.use_mup and not cfg.base_shapes_file:
            raise ConfigError(
                "use_mup: true needs base_shapes_file (the base shapes to save with save_base_shapes, or read)"
            )
        return cfg

    def rank_file(self, rank: int) -> Path:
        """GPT-NeoX's per-rank base shapes file: ``{base_shapes_file}.{rank}``."""
        assert self.base_shapes_file is not None
        return Path(f"{self.base_shapes_file}.{rank}")


@dataclass(frozen=True)
class InfShape:
    """A parameter's shape with its base shape (``None`` = a finite dimension), as mup's ``InfShape``."""

    base: tuple[int | None, ...]
    dims: tuple[int, ...]

    @property
    def ninf(self) -> int:
        """How many width dimensions."""
        return sum(b is not None for b in self.base)

    def mult(self, i: int) -> float:
        """Width multiplier of dimension ``i`` (1 for a finite one)."""
        b = self.base[i]
        return 1.0 if b is None else self.dims[i] / b

    @property
    def width_mult(self) -> float:
        """The multiplier of the last width dimension (for a matrix, its fan-in), 1 without one."""
        widths = [i for i, b in enumerate(self.base) if b is not None]
        return self.mult(widths[-1]) if widths else 1.0

    @property
    def fanin_fanout_ratio(self) -> float:
        """``mult(fan-in) / mult(fan-out)`` of a ``[out, in]`` matrix (MuSGD's matrix-like ratio)."""
        return self.mult(1) / self.mult(0)


# ---------------------------------------------------------------------------------------------------- base shapes


def shapes_of(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name → shape of every parameter (``named_parameters``: a tied weight once)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def make_base_shapes(base: Mapping[str, Iterable[int]], delta: Mapping[str, Iterable[int]]) -> BaseShapes:
    """mup's ``make_base_shapes``: each dimension equal in both is finite (``None``), else a width (its base size)."""
    if set(base) != set(delta):
        raise ValueError(f"base and delta models differ in parameters: {sorted(set(base) ^ set(delta))}")
    out: BaseShapes = {}
    for name, shape in base.items():
        b, d = list(shape), list(delta[name])
        if len(b) != len(d):
            raise ValueError(f"{name}: base shape {b} and delta shape {d} differ in rank")
        out[name] = [x if x != y else None for x, y in zip(b, d, strict=True)]
    return out


def base_shapes_text(shapes: BaseShapes) -> str:
    """The file mup writes: its header, then ``yaml.dump(shapes, indent=4)`` (keys sorted, block lists)."""
    return BASE_SHAPES_HEADER + yaml.safe_dump(shapes, indent=4)


def write_base_shapes(path: Path, shapes: BaseShapes) -> None:
    """Write ``shapes`` to ``path`` atomically (a rename), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(base_shapes_text(shapes), encoding="utf-8")
    tmp.replace(path)


def read_base_shapes(path: Path) -> BaseShapes:
    """Read a base shapes file; a missing or malformed one raises ``ConfigError`` naming it."""
    if not path.is_file():
        raise ConfigError(
            f"base_shapes_file: {path} does not exist; write it first with save_base_shapes: true (same config)"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"base_shapes_file: {path} is not YAML: {e}") from None
    ok = isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(x is None or (isinstance(x, int) and x > 0) for x in v)
        for k, v in data.items()
    )
    if not ok:
        raise ConfigError(
            f"base_shapes_file: {path} is not a base shapes file (a mapping of parameter name to a list of "
            "positive integers or null)"
        )
    return data


def infshapes(model: torch.nn.Module, base: BaseShapes, source: str) -> dict[str, InfShape]:
    """Each parameter's ``InfShape`` from the base shapes (``source`` names the file in errors)."""
    shapes = shapes_of(model)
    if set(shapes) != set(base):
        missing, extra = sorted(set(shapes) - set(base)), sorted(set(base) - set(shapes))
        raise ConfigError(
            f"base_shapes_file: {source} does not describe this model (written for another architecture or "
            f"parallel layout?): missing {missing[:5]}, unknown {extra[:5]}; rewrite it with save_base_shapes: true"
        )
    out: dict[str, InfShape] = {}
    for name, dims in shapes.items():
        b = base[name]
        if len(b) != len(dims):
            raise ConfigError(f"base_shapes_file: {source}: {name} has base shape {b} for a parameter of shape {dims}")
        out[name] = InfShape(tuple(b), dims)
    return out


# ---------------------------------------------------------------------------------------------- model and optimizer


@dataclass
class MupShapes:
    """The ``InfShape`` of every parameter of a model after :func:`apply_mup`; splits the optimizer's groups."""

    shapes: dict[str, InfShape]
    names: dict[int, str]  # id(param) -> name

    def of(self, param: torch.nn.Parameter) -> InfShape:
        """The parameter's ``InfShape``."""
        return self.shapes[self.names[id(param)]]

    def param_groups(self, groups: list[dict[str, Any]], optimizer_type: str, lr: float) -> list[dict[str, Any]]:
        """Split each group by LR divisor as MuAdam (``adam``) or MuSGD (``sgd``) do; each new group has
        ``width_mult`` (the divisor of the learning rate), ``lr`` and its scaled ``weight_decay``."""
        if optimizer_type not in ADAM_LIKE + SGD_LIKE:
            raise ConfigError(
                f"use_mup: the optimizer must be one of {', '.join(ADAM_LIKE + SGD_LIKE)} (as GPT-NeoX: MuAdam, MuSGD); "
                f"got optimizer.type {optimizer_type!r}"
            )
        out: list[dict[str, Any]] = []
        for group in groups:
            buckets: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
            for p in group["params"]:
                buckets.setdefault(self._scaling(self.of(p), optimizer_type), []).append(p)
            for (divisor, wd_mult), params in buckets.items():
                new = {k: v for k, v in group.items() if k != "params"}
                new.update(
                    params=params,
                    width_mult=divisor,
                    lr=group.get("lr", lr) / divisor,
                    weight_decay=group.get("weight_decay", 0.0) * wd_mult,
                )
                out.append(new)
        return out

    @staticmethod
    def _scaling(shape: InfShape, optimizer_type: str) -> tuple[float, float]:
        """``(lr divisor, weight-decay multiplier)`` of one parameter."""
        if shape.ninf > 2:
            raise ConfigError(f"use_mup: a parameter of shape {shape.dims} has more than 2 width dimensions")
        if optimizer_type in ADAM_LIKE:
            return (shape.width_mult, shape.width_mult) if shape.ninf == 2 else (1.0, 1.0)
        if shape.ninf == 1:
            return 1.0 / shape.width_mult, 1.0 / shape.width_mult
        if shape.ninf == 2:
            return shape.fanin_fanout_ratio, shape.fanin_fanout_ratio
        return 1.0, 1.0


def check_init_methods(model_cfg: Any) -> None:
    """muP rescales normal draws; GPT-NeoX's xavier and orthogonal inits have other muP rules (or none)."""
    for key in ("init_method", "output_layer_init_method"):
        value = getattr(model_cfg, key)
        if value not in MUP_INITS:
            raise ConfigError(f"use_mup with {key}: {value} is not supported yet; use one of {', '.join(MUP_INITS)}")


def apply_mup(model: torch.nn.Module, cfg: MupConfig, model_cfg: Any, base: BaseShapes, source: str) -> MupShapes:
    """Give ``model`` muP's initialisation and readout multiplier from its base shapes; returns the shapes the
    optimizer's groups are split by. Call once, on a freshly initialised model (not after loading weights: a
    checkpoint is loaded afterwards and overwrites the weights, as in GPT-NeoX)."""
    check_init_methods(model_cfg)
    shapes = infshapes(model, base, source)
    names = {id(p): n for n, p in model.named_parameters()}
    mup = MupShapes(shapes, names)
    layers = (mpu.ColumnParallelLinear, mpu.RowParallelLinear, mpu.VocabParallelEmbedding)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, layers):
                weight = module.weight
                shape = mup.of(weight)
                scale = cfg.mup_init_scale * (shape.width_mult**-0.5 if shape.ninf == 2 else 1.0)
                if scale != 1.0:
                    weight.mul_(scale)
    for module in model.modules():
        readout = readout_weight(module)
        if readout is not None:
            module.mup_output_mult = 1.0 / (mup.of(readout).width_mult * cfg.mup_output_temp)  # type: ignore[assignment]
    return mup


def readout_weight(module: torch.nn.Module) -> torch.nn.Parameter | None:
    """The output layer's weight where ``module`` is the output layer (``final_linear``) or the embedding tied with
    it: the classes that declare ``mup_output_mult`` (``ParallelLinearPipe``, ``Embedding``; recognised by that
    attribute, so that this module imports no model layer: they import it)."""
    if not hasattr(type(module), "mup_output_mult"):
        return None
    final_linear: Any = getattr(module, "final_linear", None)
    if final_linear is not None:
        return final_linear.weight
    embedding: Any = module
    return embedding.word_embeddings.weight if embedding.cfg.tied_embeddings else None


def attention_scale(head_dim: int, use_mup: bool, attn_temp: float) -> float:
    """Softmax-input multiplier of q·k: ``1/sqrt(d)``, with muP ``1/(d · mup_attn_temp)``."""
    return 1.0 / (head_dim * attn_temp) if use_mup else 1.0 / math.sqrt(head_dim)
