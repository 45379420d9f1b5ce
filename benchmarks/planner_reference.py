"""The planner's slow paths, as it ran before its fast ones: the reference ``bench_planner.py`` times and
``tests/unit/test_planner_speed.py`` compares against (both import it from here).

The reference: DeepSpeed's own ``partition_balanced`` for the stage split, optionally recomputed on every call (no
``stage_bounds`` memo), and every stage's parameter names from a separate ``slice_param_names`` call that parses the
names again (the per-stage function as it was, :func:`main_slice_param_names`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron.checkpoint import layout as checkpoint_layout  # the reference switches the split's internals
from megatron.checkpoint import stage_bounds
from megatron.model import meta
from megatron.model.config import GPTModelConfig
from megatron.model.layer_sharing import first_position, is_shared, unique_layer
from megatron.planner import params as planner_params


def main_slice_param_names(cfg: GPTModelConfig, pp: int, stage: int, partition_method: str | None = None) -> list[str]:
    """``slice_param_names`` as it was before the fast paths (one stage, the names parsed per call)."""
    names = list(meta.meta_param_shapes(cfg))  # optimizer_state.model_param_names
    if pp == 0:
        return names
    parts = stage_bounds(cfg, pp, partition_method)
    lo, hi = parts[stage], parts[stage + 1]
    head = cfg.num_layers + 4
    owned = [n for n in names if lo <= int(n.split(".")[1]) < hi]
    if is_shared(cfg):
        run = {first_position(cfg, unique_layer(cfg, i)) + 2 for i in range(cfg.num_layers) if lo <= i + 2 < hi}
        layers = range(2, cfg.num_layers + 2)
        owned = [n for n in names if int(n.split(".")[1]) in run] + [
            n for n in owned if int(n.split(".")[1]) not in layers
        ]
    if not cfg.tied_embeddings:
        return owned
    embed = [n for n in names if n.startswith("sequential.0.")]
    rest = [n for n in owned if not n.startswith("sequential.0.")]
    return embed + rest if (lo <= 0 < hi or lo <= head < hi) else rest


class NoMemo(dict[tuple[str, int, str], list[int]]):
    """A ``stage_bounds`` memo that never holds anything: every call recomputes the split."""

    def __contains__(self, key: object) -> bool:
        return False


def deepspeed_partition(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's own ``partition_balanced`` (a Python loop over numpy scalars)."""
    from deepspeed.runtime import utils as ds_utils

    return [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=parts)]


def per_stage_param_names(cfg: GPTModelConfig, pp: int, method: str | None = None) -> list[list[str]]:
    """``stage_param_names`` by one :func:`main_slice_param_names` call per stage."""
    return [main_slice_param_names(cfg, pp, s, method) for s in range(max(pp, 1))]


@contextlib.contextmanager
def reference_paths(memo: bool = False) -> Iterator[None]:
    """The slow paths in place of the fast ones, restored on exit (``memo``: keep a fresh ``stage_bounds`` memo,
    else every call recomputes the split)."""
    saved = (checkpoint_layout.partition_balanced, checkpoint_layout._BOUNDS, planner_params.stage_param_names)
    checkpoint_layout.partition_balanced = deepspeed_partition  # type: ignore[assignment]
    checkpoint_layout._BOUNDS = {} if memo else NoMemo()
    planner_params.stage_param_names = per_stage_param_names  # type: ignore[assignment]
    try:
        yield
    finally:
        checkpoint_layout.partition_balanced, checkpoint_layout._BOUNDS, planner_params.stage_param_names = saved
