"""The one rule deciding which parameters get no weight decay (GPT-NeoX's: norms, biases, flagged parameters).

The optimizer's param groups (``megatron.training.optimizers.weight_decay_param_groups``) and the checkpoint
resharder, which rebuilds those groups from parameter names (``megatron.checkpoint.optimizer_state``), both ask
this module, so the two cannot disagree.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.config import GPTModelConfig
from megatron.model.gpt2_model import build_sequential_model
from megatron.model.norms import is_norm

_CACHE: dict[str, frozenset[str]] = {}


def no_weight_decay(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """Whether ``module``'s own parameter ``name`` is excluded from weight decay.

    Every parameter of a norm layer, every bias, a parameter flagged ``_no_weight_decay = True``, and the parameters
    a module class lists in its ``NO_WEIGHT_DECAY`` (Mamba's ``A_log`` and ``D``).
    """
    if is_norm(module) or name == "bias" or bool(getattr(param, "_no_weight_decay", False)):
        return True
    return name in getattr(type(module), "NO_WEIGHT_DECAY", ())


def no_weight_decay_names(model: nn.Module) -> frozenset[str]:
    """Full names (as ``model.named_parameters()`` gives them) of the parameters excluded from weight decay."""
    out = set()
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # a tied weight counts where named_parameters() first lists it
            seen.add(id(param))
            if no_weight_decay(module, name, param):
                out.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(out)


def model_no_weight_decay_names(cfg: GPTModelConfig) -> frozenset[str]:
    """:func:`no_weight_decay_names` of the sequential model of ``cfg`` (built on the meta device, cached)."""
    key = repr(cfg)
    if key not in _CACHE:
        with torch.device("meta"):
            model = build_sequential_model(cfg)
        if len(_CACHE) > 8:
            _CACHE.clear()
        _CACHE[key] = no_weight_decay_names(model)
    return _CACHE[key]
