"""The training state a DeepSpeed engine holds must be finite: after a load (weights and, when loaded, the optimizer
state) and before a save (so a checkpoint that could not be resumed from is never committed).

A NaN in Adam's ``exp_avg_sq`` with clean weights is not caught by the step's non-finite guard (the loss and the
gradients stay finite): the first step writes NaN into every weight the moment touches. So the optimizer state is
checked like the weights: one fp32 sum per tensor (``megatron.checkpoint.finite``), the exact element-wise test only
for a tensor whose sum is not finite. Every rank checks its own part (ZeRO: its partition) and the ranks fail
together (a rank failing alone would leave the others waiting in a collective).

Flat ZeRO partitions are traced back to the parameter whose fragment holds the bad value: ZeRO-1/2 and the bf16
optimizer through DeepSpeed's ``_param_slice_mappings`` (what it saves as ``param_slice_mappings``), ZeRO-3 through
each sub-group's partitioned parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron import mpu
from megatron.checkpoint.finite import nonfinite_message, nonfinite_tensor
from megatron.checkpoint.layout import CheckpointError
from megatron.engine_protocol import Engine

MASTER = "fp32 master weights"
OPTIM_ADVICE = (
    "the optimizer state is damaged or was saved after the run diverged; set no_load_optim: true to load the "
    "weights with a fresh optimizer state, or load an earlier checkpoint (iteration: N)"
)


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer holding the state: the engine's own (ZeRO-0 fp32) or the one a DeepSpeed wrapper (ZeRO
    1-3, bf16, fp16) steps."""
    for _ in range(4):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _index_of(items: Any, tensor: torch.Tensor) -> int | None:
    return next((i for i, item in enumerate(items or ()) if item is tensor), None)


def _first_bad(value: torch.Tensor) -> int:
    return int((~torch.isfinite(value.reshape(-1))).nonzero()[0])


def _fragment(wrapper: Any, flat: torch.Tensor, value: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """(parameter name, its fragment of ``value``) for the first non-finite element of the state ``value`` of the
    flat partition ``flat``; None when ``flat`` is not a ZeRO / bf16 partition."""
    bad = _first_bad(value)
    mappings = getattr(wrapper, "_param_slice_mappings", None)
    for partitions in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):  # ZeRO-1/2, bf16
        group = _index_of(getattr(wrapper, partitions, None), flat)
        if group is not None and mappings is not None and group < len(mappings):
            for name, frag in mappings[group].items():
                if frag.start <= bad < frag.start + frag.numel:
                    return str(name), value.reshape(-1).narrow(0, frag.start, frag.numel)
    group = _index_of(getattr(wrapper, "fp32_partitioned_groups_flat", None), flat)  # ZeRO-3 sub-group
    if group is not None:
        names = getattr(wrapper, "param_names", {}) or {}
        offset = 0
        for param in wrapper.fp16_groups[group]:
            numel = int(param.ds_tensor.ds_numel)
            if offset <= bad < offset + numel:
                return str(names.get(param, "?")), value.reshape(-1).narrow(0, offset, numel)
            offset += numel
    return None


def _copy_names(wrapper: Any, module_names: dict[int, str]) -> dict[int, str]:
    """Parameter name of each per-parameter fp32 copy a ZeRO-0 fp16/bf16 wrapper steps (``fp32_groups[g][i]`` is
    the copy of ``fp16_groups[g][i]``)."""
    pairs = zip(getattr(wrapper, "fp32_groups", None) or (), getattr(wrapper, "fp16_groups", None) or ())
    return {
        id(copy): module_names[id(param)]
        for copies, params in pairs
        if isinstance(copies, list)
        for copy, param in zip(copies, params)
        if id(param) in module_names
    }


def nonfinite_optimizer_state(engine: Engine) -> tuple[str, str, int, int] | None:
    """``(parameter name, state key, non-finite count, numel)`` of the first non-finite tensor of the engine's
    optimizer state (moments such as ``exp_avg``/``exp_avg_sq``, and a wrapper's fp32 master weights), else None."""
    base = base_optimizer(getattr(engine, "optimizer", None))
    if base is None:
        return None
    module_names = {id(p): n for n, p in engine.module.named_parameters()}
    copies = _copy_names(engine.optimizer, module_names)
    # the state's own keys: ZeRO-3 empties the param groups between steps
    for param, state in list(base.state.items()):
        named = [(key, value) for key, value in state.items() if torch.is_tensor(value) and value.dim() > 0]
        if id(param) not in module_names:  # a wrapper's flat fp32 copy of the weights
            named.append((MASTER, param.detach()))
        found = nonfinite_tensor(named)
        if found is None:
            continue
        key, value = found[0], dict(named)[found[0]]
        if id(param) in module_names or id(param) in copies:
            return module_names.get(id(param)) or copies[id(param)], key, found[1], found[2]
        located = _fragment(engine.optimizer, param, value)
        if located is None:
            return f"flat partition of {value.numel()} values", key, found[1], found[2]
        name, fragment = located
        return name, key, int((~torch.isfinite(fragment)).sum()), fragment.numel()
    return None


def optimizer_state_file(engine: Engine, root: str | Path, tag: str) -> Path:
    """The file of checkpoint ``root/tag`` this rank's optimizer state is loaded from: its ZeRO shard (ZeRO 1-3,
    bf16 optimizer), else its model-states file (ZeRO-0, where the torch optimizer's state dict lives)."""
    wrapper = getattr(engine, "optimizer", None)
    partitioned = any(hasattr(wrapper, a) for a in ("_param_slice_mappings", "fp32_partitioned_groups_flat"))
    try:
        name = engine._get_zero_ckpt_name(str(root), tag) if partitioned else engine._get_ckpt_name(str(root), tag)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # not a DeepSpeed engine: name the folder
        return Path(root) / tag
    return Path(name)


def optimizer_message(where: str | Path, found: tuple[str, str, int, int]) -> str:
    """One line: the file, the parameter and state key, how much of it, and the way out."""
    name, key, bad, numel = found
    return f"{where}: optimizer state {key} of {name} holds {bad} NaN/inf value(s) of {numel}; {OPTIM_ADVICE}"


def _weight_file(directory: Path, name: str, pipe: bool, zero3: bool) -> Path:
    """The file of ``directory`` that parameter ``name`` of this rank was read from (GPT-NeoX's layout)."""
    tp = mpu.get_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
    if zero3:
        dp = mpu.get_data_parallel_rank() if mpu.model_parallel_is_initialized() else 0
        return directory / f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"
    head = name.removeprefix("sequential.").split(".", 1)[0]
    if pipe and head.isdigit():
        return directory / f"layer_{int(head):02d}-model_{tp:02d}-model_states.pt"
    return directory / f"mp_rank_{tp:02d}_model_states.pt"


def weights_problem(engine: Engine, directory: Path) -> str | None:
    """This rank's first non-finite parameter (ZeRO-3: its partition) as a one-line message naming its file."""
    module = engine.module
    pipe = type(module).__name__ == "PipelineModule" or hasattr(module, "forward_funcs")
    named = [(n, getattr(p, "ds_tensor", p)) for n, p in module.named_parameters()]
    zero3 = any(hasattr(p, "ds_tensor") for _, p in module.named_parameters())
    found = nonfinite_tensor(named)
    return None if found is None else nonfinite_message(_weight_file(directory, found[0], pipe, zero3), found)


def first_problem_on_any_rank(problem: str | None) -> str | None:
    """The first rank's problem (every rank gets the same answer)."""
    return next((m for m in mpu.all_gather_objects(problem) if m is not None), None)


def check_loaded_state_finite(engine: Engine, root: str | Path, tag: str, *, optimizer: str | None) -> None:
    """After a load: every rank checks its optimizer state (``optimizer``: ``"file"`` when DeepSpeed read it from
    the checkpoint's files, ``"carried"`` when it was carried over from another layout, None when not loaded) and
    then its parameters; all ranks raise the first problem found."""
    directory = Path(root) / tag
    problem = None
    if optimizer is not None:
        found = nonfinite_optimizer_state(engine)
        if found is not None:
            where = optimizer_state_file(engine, root, tag) if optimizer == "file" else directory
            problem = optimizer_message(where, found)
    problem = first_problem_on_any_rank(problem or weights_problem(engine, directory))
    if problem is not None:
        raise CheckpointError(problem)


def check_state_before_save(engine: Engine, save: str, tag: str, *, optimizer: bool) -> None:
    """Before a save: a weight or (``optimizer``: it is saved) an optimizer tensor holding NaN/inf would make a
    checkpoint no run can resume from, which retention might then keep instead of the good ones: refuse it."""
    problem = None
    if optimizer:
        found = nonfinite_optimizer_state(engine)
        if found is not None:
            name, key, bad, numel = found
            problem = f"optimizer state {key} of {name} holds {bad} NaN/inf value(s) of {numel}"
    if problem is None:
        found_weight = nonfinite_tensor((n, getattr(p, "ds_tensor", p)) for n, p in engine.module.named_parameters())
        if found_weight is not None:
            problem = f"parameter {found_weight[0]} holds {found_weight[1]} NaN/inf value(s) of {found_weight[2]}"
    problem = first_problem_on_any_rank(problem)
    if problem is not None:
        raise CheckpointError(
            f"save {save}: not saving checkpoint {tag}: {problem} (a checkpoint no run could resume from); the "
            "previous checkpoint and 'latest' are intact"
        )
