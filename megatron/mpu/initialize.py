"""Process topology and the tensor- (model-), data-, pipe- and IO-parallel process groups.

Rank layout is DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``: axes pipe (outermost),
data, model (innermost), i.e. ``rank = pipe * (dp * mp) + data * mp + model``.

Before :func:`initialize_model_parallel` (or without ``torch.distributed``) every getter answers as a single
process would: rank 0, world size 1, group ``None``; model code therefore runs in a plain process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    """Pure rank arithmetic for a (pipe, data, model) grid; builds no process group."""

    world_size: int
    pipe: int
    data: int
    model: int
    topology: PipeModelDataParallelTopology = field(repr=False, compare=False)

    def model_groups(self) -> list[list[int]]:
        """Ranks of every tensor-parallel group (consecutive ranks)."""
        return self.topology.get_axis_comm_lists("model")

    def data_groups(self) -> list[list[int]]:
        """Ranks of every data-parallel group."""
        return self.topology.get_axis_comm_lists("data")

    def pipe_groups(self) -> list[list[int]]:
        """Ranks of every pipeline group (one rank per stage)."""
        return self.topology.get_axis_comm_lists("pipe")

    def io_groups(self) -> list[list[int]]:
        """Groups that build dataset indices together.

        With a pipeline: one group of the TP-rank-0 ranks of the first and last stage (the ranks that own
        data loaders). Without: the data-parallel groups.
        """
        if self.pipe <= 1:
            return self.data_groups()
        stages = {0, self.pipe - 1}
        ranks = [r for r in range(self.world_size) if self.coord(r)[2] == 0 and self.coord(r)[0] in stages]
        return [ranks]

    def coord(self, rank: int) -> tuple[int, int, int]:
        """``(pipe, data, model)`` coordinates of a global rank."""
        c = self.topology.get_coord(rank)
        return c.pipe, c.data, c.model


def build_layout(world_size: int, model_parallel_size: int = 1, pipe_parallel_size: int = 1) -> ParallelLayout:
    """Check the parallel sizes against ``world_size`` and return the rank layout.

    ``pipe_parallel_size`` 0 (GPT-NeoX's "no pipeline engine") counts as one stage.
    """
    for name, value in (("model_parallel_size", model_parallel_size), ("pipe_parallel_size", pipe_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if model_parallel_size == 0:
        raise ValueError("model_parallel_size must be >= 1, got 0")
    pp = max(pipe_parallel_size, 1)
    mp = model_parallel_size
    if world_size % (pp * mp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by pipe_parallel_size ({pp}) x model_parallel_size ({mp}); "
            f"use a world size that is a multiple of {pp * mp}"
        )
    dp = world_size // (pp * mp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)
    return ParallelLayout(world_size=world_size, pipe=pp, data=dp, model=mp, topology=topology)


@dataclass
class _State:
    layout: ParallelLayout
    rank: int
    model_group: Any = None
    data_group: Any = None
    pipe_group: Any = None
    io_group: Any = None
    data_group_ranks: list[int] = field(default_factory=list)


_STATE: _State | None = None
_FP32_ALLREDUCE = False


def initialize_model_parallel(model_parallel_size: int = 1, pipe_parallel_size: int = 1) -> None:
    """Build the topology and the TP, DP, PP and IO groups on every rank (collective over the world).

    Calling it again with the same sizes is a no-op; different sizes need :func:`destroy_model_parallel`
    first. Without an initialised ``torch.distributed`` only a 1-rank layout is possible (no groups).
    """
    global _STATE
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    layout = build_layout(world_size, model_parallel_size, pipe_parallel_size)
    if _STATE is not None:
        if (_STATE.layout.model, _STATE.layout.pipe, _STATE.layout.world_size) == (
            layout.model,
            layout.pipe,
            layout.world_size,
        ):
            return
        raise ValueError(
            f"model parallel already initialised with model_parallel_size={_STATE.layout.model}, "
            f"pipe_parallel_size={_STATE.layout.pipe}; call destroy_model_parallel() first"
        )
    state = _State(layout=layout, rank=rank)
    if distributed:
        # Every rank must create every group, in the same order.
        for ranks in layout.data_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                state.data_group, state.data_group_ranks = group, list(ranks)
        for ranks in layout.pipe_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                state.pipe_group = group
        for ranks in layout.model_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                state.model_group = group
        if layout.pipe > 1:
            for ranks in layout.io_groups():
                group = dist.new_group(ranks)
                if rank in ranks:
                    state.io_group = group
        else:
            state.io_group = state.data_group
    else:
        state.data_group_ranks = [0]
    _STATE = state
    if rank == 0:
        logger.info(
            "model parallel initialised: world %d = pipe %d x data %d x model %d",
            world_size,
            layout.pipe,
            layout.data,
            layout.model,
        )


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the topology and groups (the getters answer as a single process again)."""
    global _STATE, _FP32_ALLREDUCE
    _STATE = None
    _FP32_ALLREDUCE = False


def get_topology() -> PipeModelDataParallelTopology | None:
    """The DeepSpeed topology object (for ``PipelineModule(topology=...)``), or None before initialisation."""
    return _STATE.layout.topology if _STATE is not None else None


def _coord() -> tuple[int, int, int]:
    return _STATE.layout.coord(_STATE.rank) if _STATE is not None else (0, 0, 0)


# ---- tensor (model) parallel -------------------------------------------------------------------------------


def get_model_parallel_group() -> Any:
    """The tensor-parallel process group of this rank (None before initialisation)."""
    return _STATE.model_group if _STATE is not None else None


def get_model_parallel_rank() -> int:
    """This rank's index inside its tensor-parallel group."""
    return _coord()[2]


def get_model_parallel_world_size() -> int:
    """Tensor-parallel degree."""
    return _STATE.layout.model if _STATE is not None else 1


def get_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (TP is the innermost axis)."""
    if _STATE is None:
        return 0
    return _STATE.rank - get_model_parallel_rank()


# ---- data parallel -----------------------------------------------------------------------------------------


def get_data_parallel_group() -> Any:
    """The data-parallel process group of this rank (None before initialisation)."""
    return _STATE.data_group if _STATE is not None else None


def get_data_parallel_rank() -> int:
    """This rank's index inside its data-parallel group."""
    return _coord()[1]


def get_data_parallel_world_size() -> int:
    """Data-parallel degree."""
    return _STATE.layout.data if _STATE is not None else 1


def get_data_parallel_group_ranks() -> list[int]:
    """Global ranks of this rank's data-parallel group (DeepSpeed asks for it)."""
    return list(_STATE.data_group_ranks) if _STATE is not None else [0]


# ---- pipeline parallel -------------------------------------------------------------------------------------


def get_pipe_parallel_group() -> Any:
    """The pipeline process group of this rank (None before initialisation)."""
    return _STATE.pipe_group if _STATE is not None else None


def get_pipe_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _coord()[0]


def get_pipe_parallel_world_size() -> int:
    """Number of pipeline stages (1 without a pipeline)."""
    return _STATE.layout.pipe if _STATE is not None else 1


def get_pipe_parallel_group_ranks() -> list[int]:
    """Global ranks of this rank's pipeline group, stage 0 first."""
    if _STATE is None:
        return [0]
    return next(g for g in _STATE.layout.pipe_groups() if _STATE.rank in g)


def get_io_parallel_group() -> Any:
    """Group that builds dataset index files together (None on ranks outside it, or before initialisation)."""
    return _STATE.io_group if _STATE is not None else None


# ---- fp32 all-reduce ---------------------------------------------------------------------------------------


def set_fp32_allreduce(value: bool) -> None:
    """Make TP reductions of half-precision tensors run in fp32 (GPT-NeoX ``fp32_allreduce``)."""
    global _FP32_ALLREDUCE
    _FP32_ALLREDUCE = bool(value)


def get_fp32_allreduce() -> bool:
    """Whether TP reductions of half-precision tensors run in fp32."""
    return _FP32_ALLREDUCE


def comm_device() -> torch.device:
    """Device for tensors created for collectives: CUDA with NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- DeepSpeed's names -------------------------------------------------------------------------------------

get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_rank = get_model_parallel_rank
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_src_rank = get_model_parallel_src_rank
get_pipeline_model_parallel_group = get_pipe_parallel_group
get_pipeline_model_parallel_rank = get_pipe_parallel_rank
get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
