"""Where the process groups land on the nodes.

Ranks follow GPT-NeoX's (DeepSpeed's) topology: pipe outermost, then data, then tensor (model) innermost, so
``rank = (pipe · dp + data) · tp + tensor`` and node ``= rank // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GroupPlacement:
    """One parallelism axis: group size, rank stride, and how many nodes its widest group spans."""

    axis: str  # tensor, pipe or data
    size: int
    stride: int
    nodes_spanned: int

    @property
    def inside_node(self) -> bool:
        """Every group of this axis lives on one node."""
        return self.nodes_spanned == 1

    def to_dict(self) -> dict[str, object]:
        """Plain data."""
        return {**asdict(self), "inside_node": self.inside_node}


def widest_group(size: int, stride: int, world: int, gpus_per_node: int) -> int:
    """Nodes spanned by the widest group of ``size`` ranks ``stride`` apart, groups tiling ``world`` ranks.

    Closed form, O(min(groups, gpus_per_node)): members ``stride >= gpus_per_node`` apart each sit on their own
    node; closer ones cover consecutive nodes, so the group starting furthest into its node spans the most. The
    first members are ``a · stride · size + b`` (``b < stride``); their offsets inside a node repeat after
    ``gpus_per_node`` values of ``a``.
    """
    if size == 1:
        return 1
    if stride >= gpus_per_node:
        return size
    block = stride * size
    offset = 0  # the largest offset inside its node of a group's first member
    for a in range(min(world // block, gpus_per_node)):
        base = a * block % gpus_per_node
        offset = max(offset, gpus_per_node - 1 if base + stride > gpus_per_node else base + stride - 1)
    return (offset + (size - 1) * stride) // gpus_per_node + 1


def group_placements(tp: int, pp: int, dp: int, gpus_per_node: int) -> list[GroupPlacement]:
    """The tensor, pipe and data groups of a ``tp × pp × dp`` world on nodes of ``gpus_per_node``."""
    world = tp * pp * dp
    return [
        GroupPlacement(axis, size, stride, widest_group(size, stride, world, gpus_per_node))
        for axis, size, stride in (("tensor", tp, 1), ("pipe", pp, dp * tp), ("data", dp, tp))
    ]
