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


def group_placements(tp: int, pp: int, dp: int, gpus_per_node: int) -> list[GroupPlacement]:
    """The tensor, pipe and data groups of a ``tp × pp × dp`` world on nodes of ``gpus_per_node``."""
    world = tp * pp * dp
    out = []
    for axis, size, stride in (("tensor", tp, 1), ("pipe", pp, dp * tp), ("data", dp, tp)):
        widest = 1
        for first in range(world):
            if (first // stride) % size:  # not the first member of its group
                continue
            nodes = {(first + i * stride) // gpus_per_node for i in range(size)}
            widest = max(widest, len(nodes))
        out.append(GroupPlacement(axis, size, stride, widest))
    return out
