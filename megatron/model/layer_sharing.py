"""Parameter sharing across transformer layers (``num_unique_layers``, ``param_sharing_style``).

``num_layers`` positions reuse ``num_unique_layers`` (U) distinct layers, in GPT-NeoX's documented orders
(for 4 layers and U = 2): ``grouped`` uses unique layers [1, 2, 1, 2] and ``spaced`` [1, 1, 2, 2].

A shared layer is one module, built once per pipeline stage under the seed of the first position that uses it (so
its weights do not depend on the partition), and run at every position that uses it: autograd sums its gradient
over the positions of a stage, and DeepSpeed's tied-layer all-reduce (``TiedLayerSpec`` with every parameter of the
layer as a tied weight) sums it over the stages. Checkpoints hold it under every position's name (a pipeline's
``layer_XX`` file per position, a sequential model's ``sequential.{idx}.`` keys), identical copies, so the files are
those of an unshared model with equal layers.
"""

from __future__ import annotations

from typing import Any, Protocol

from deepspeed.pipe import LayerSpec, TiedLayerSpec

SHARING_STYLES = ("grouped", "spaced")


class SharingConfig(Protocol):
    """What sharing reads of ``GPTModelConfig`` (which imports this module for its checks)."""

    num_layers: int
    num_unique_layers: int | None
    param_sharing_style: str

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The attention type of each layer."""
        ...

    @property
    def is_moe(self) -> bool:
        """Some layers are MoE layers."""
        ...


def is_shared(cfg: SharingConfig) -> bool:
    """True when some transformer layers share their parameters."""
    return cfg.num_unique_layers is not None and cfg.num_unique_layers < cfg.num_layers


def unique_layer(cfg: SharingConfig, position: int) -> int:
    """The unique layer (0-based) that transformer position ``position`` (0-based) runs."""
    if not is_shared(cfg):
        return position
    unique = int(cfg.num_unique_layers or cfg.num_layers)
    if cfg.param_sharing_style == "grouped":
        return position % unique
    return position // (cfg.num_layers // unique)


def first_position(cfg: SharingConfig, unique: int) -> int:
    """The first position that runs unique layer ``unique``: the layer is built as that position's layer."""
    return next(i for i in range(cfg.num_layers) if unique_layer(cfg, i) == unique)


def sharing_problems(cfg: SharingConfig) -> list[str]:
    """Why the sharing settings cannot be built (empty when they can)."""
    if cfg.param_sharing_style not in SHARING_STYLES:
        return [f"param_sharing_style={cfg.param_sharing_style!r} is not one of {', '.join(SHARING_STYLES)}"]
    if cfg.num_unique_layers is None:
        return []
    unique = cfg.num_unique_layers
    if unique < 1 or cfg.num_layers % unique:
        return [f"num_unique_layers={unique} must be >= 1 and divide num_layers={cfg.num_layers}"]
    out = []
    for i in range(cfg.num_layers):
        first = first_position(cfg, unique_layer(cfg, i))
        if cfg.layer_types[i] != cfg.layer_types[first]:
            out.append(
                f"num_unique_layers: layers {first} and {i} share parameters but attention_config gives them "
                f"different types ({cfg.layer_types[first]}, {cfg.layer_types[i]}); shared layers need one type"
            )
    other = sorted({kind for kind in cfg.layer_types if kind in ("mamba", "gmlp", "amlp")})
    if other and is_shared(cfg):
        out.append(
            f"not supported yet: num_unique_layers={unique} with {', '.join(other)} layers (parameter sharing is "
            "built for transformer layers)"
        )
    if cfg.is_moe and is_shared(cfg):
        out.append(f"not supported yet: num_unique_layers={unique} with MoE layers (moe_num_experts > 1)")
    return out


class SharedLayerSpec(TiedLayerSpec):
    """A ``TiedLayerSpec`` whose tied weights are all the parameters of the module it builds (known once built;
    DeepSpeed reads ``tied_weight_attr`` right after ``build``)."""

    def build(self, log: bool = False) -> Any:
        """Build the module and tie every one of its parameters."""
        module = super().build(log=log)
        # not the relative position bias every layer of the stage shares (pos_emb rpe): it is no part of the layer
        self.tied_weight_attr = [name for name, _ in module.named_parameters() if ".rpe." not in f".{name}"]
        return module


def transformer_layer_spec(cfg: SharingConfig, position: int, layer_cls: type, **kwargs: Any) -> LayerSpec:
    """The spec of transformer position ``position`` (spec index ``position + 2``): its own layer, or the shared
    unique layer (key ``layer_{unique}``) built as the layer of the unique layer's first position."""
    if not is_shared(cfg):
        return LayerSpec(layer_cls, cfg, position, position + 2, **kwargs)
    unique = unique_layer(cfg, position)
    first = first_position(cfg, unique)
    return SharedLayerSpec(f"layer_{unique}", layer_cls, cfg, first, first + 2, tied_weight_attr=[], **kwargs)


class CacheAt:
    """The KV cache as seen by one position: a shared layer runs at several positions, and the cache (keyed by the
    attention's layer index) must keep one entry per position."""

    def __init__(self, cache: Any, position: int) -> None:
        self._cache = cache
        self._position = position

    def past_length(self, layer: int) -> int:
        """Tokens cached for this position."""
        return int(self._cache.past_length(self._position))

    def update(self, layer: int, k: Any, v: Any) -> Any:
        """Append this position's keys and values."""
        return self._cache.update(self._position, k, v)
