"""Block layouts of GPT-NeoX's sparse attention types (``attention_config``: ``sparse_fixed``, ``sparse_variable``,
``bigbird``, ``bslongformer``, ``local``), under the rules of DeepSpeed's ``sparsity_config.py`` classes (Fixed,
Variable, BigBird, BSLongformer, LocalSlidingWindow), which GPT-NeoX builds from its ``sparsity_config`` key.

A layout is a ``[heads][blocks][blocks]`` nested list of 0/1: entry ``[h][r][c]`` is 1 when the queries of block
``r`` may attend to the keys of block ``c`` in head ``h`` (causality inside a block is the attention's job). Plain
Python, so that the config layer checks a config's layouts without torch; the model makes tensors of them
(``megatron/model/sparse_attention.py``).
Every builder raises ``ValueError`` where DeepSpeed's class raises; ``tests/fixtures/deepspeed/`` holds the layouts
DeepSpeed's own classes produce over a grid of options (``tests/unit/test_sparse_layouts.py``). Random blocks are
drawn by DeepSpeed's rule (``sample(range(n), k)`` per block row, heads in order) from the ``random.Random`` given,
so a generator seeded like Python's global one gives DeepSpeed's exact layout.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Grid = list[list[int]]  # [blocks][blocks] of one head
Layout = list[Grid]  # [heads][blocks][blocks]

DIRECTIONS = ("unidirectional", "bidirectional")
SPARSE_TYPES = ("sparse_fixed", "sparse_variable", "bigbird", "bslongformer", "local")

# GPT-NeoX's settings per attention type: sparsity_config key -> default (megatron/model/utils.py of GPT-NeoX);
# every type reads `block` (16). GPT-NeoX always passes attention="unidirectional" and no horizontal global attention.
GPT_NEOX_DEFAULTS: dict[str, dict[str, Any]] = {
    "sparse_fixed": {
        "different_layout_per_head": False,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "num_different_global_patterns": 1,
    },
    "sparse_variable": {
        "different_layout_per_head": False,
        "num_random_blocks": 0,
        "local_window_blocks": [4],
        "global_block_indices": [0],
        "global_block_end_indices": None,
    },
    "bigbird": {
        "different_layout_per_head": False,
        "num_random_blocks": 1,
        "num_sliding_window_blocks": 3,
        "num_global_blocks": 1,
    },
    "bslongformer": {
        "different_layout_per_head": False,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
    },
    # `local` reads num_local_blocks, else num_sliding_window_blocks, else 4
    "local": {"num_local_blocks": None, "num_sliding_window_blocks": 4},
}
BLOCK_DEFAULT = 16
MAX_BLOCKS = 4096  # blocks a row: the layouts are plain Python lists (4096² entries a distinct head)
SPARSITY_KEYS = frozenset({"block"}.union(*GPT_NEOX_DEFAULTS.values()))


def _heads(num_heads: int, num_blocks: int, per_head: bool, draw: Callable[[int, Grid], None]) -> Layout:
    """Head ``h``'s grid filled by ``draw(h, empty grid)`` for every head (``per_head``) or head 0, copied to all."""
    grids = []
    for h in range(num_heads if per_head else 1):
        grid = [[0] * num_blocks for _ in range(num_blocks)]
        draw(h, grid)
        grids.append(grid)
    return grids if per_head else [grids[0]] * num_heads  # one shared grid (layouts are read, never written)


def _fill(grid: Grid, rows: slice, cols: slice) -> None:
    """Set ``grid[rows, cols]`` to 1, with Python's (and torch's) slice semantics (a negative start wraps)."""
    n = len(grid)
    for r in range(n)[rows]:
        for c in range(n)[cols]:
            grid[r][c] = 1


def _lower(grid: Grid) -> None:
    """Keep the lower triangle (diagonal included)."""
    for r, row in enumerate(grid):
        row[r + 1 :] = [0] * (len(row) - r - 1)


def _direction(attention: str) -> bool:
    """True for unidirectional; ValueError for anything but the two directions."""
    if attention not in DIRECTIONS:
        raise ValueError(f"attention={attention!r}: only {' / '.join(DIRECTIONS)} attention is supported")
    return attention == "unidirectional"


def _window_blocks(grid: Grid, start: int, stop: int, causal: bool) -> None:
    """Blocks ``[start, stop)`` attend to each other (to earlier ones only when ``causal``)."""
    for row in range(start, stop):
        _fill(grid, slice(row, row + 1), slice(start, row + 1 if causal else stop))


def _sliding(grid: Grid, window: int, causal_end: bool) -> None:
    """Row ``r`` attends blocks ``[r - window//2, r + window//2]`` (up to ``r`` only with ``causal_end``)."""
    n = len(grid)
    if n < window:
        raise ValueError(f"num_sliding_window_blocks={window} is larger than the {n} blocks of a row")
    w = window // 2
    for row in range(n):
        _fill(grid, slice(row, row + 1), slice(max(0, row - w), row + 1 if causal_end else min(row + w + 1, n)))


def _random_rows(grid: Grid, k: int, rng: random.Random, causal: bool) -> None:
    """``k`` random blocks per row, drawn with ``rng.sample`` (from the blocks up to the row when ``causal``)."""
    n = len(grid)
    if n < k:
        raise ValueError(f"num_random_blocks={k} is larger than the {n} blocks of a row")
    for row in range(n):
        population = range(row + 1) if causal else range(n)
        if k > len(population):
            raise ValueError(
                f"num_random_blocks={k}: block row {row} of unidirectional attention has only {len(population)} "
                "earlier blocks to draw from"
            )
        for c in rng.sample(population, k):
            grid[row][c] = 1


def _check_global_ranges(starts: list[int], ends: list[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_end_indices has {len(ends)} entries but global_block_indices has {len(starts)}")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global block range [{s}, {e}): the start must be smaller than the end")


def _global_ranges(starts: list[int], ends: list[int] | None, n: int) -> list[tuple[int, int]]:
    """The global block ranges ``[start, end)`` that begin inside the ``n`` blocks (ends clipped to ``n``)."""
    if ends is None:
        return [(s, s + 1) for s in starts if s < n]
    return [(s, min(e, n)) for s, e in zip(starts, ends) if s < n]


def fixed_layout(
    num_heads: int,
    num_blocks: int,
    *,
    different_layout_per_head: bool = False,
    num_local_blocks: int = 4,
    num_global_blocks: int = 1,
    attention: str = "bidirectional",
    horizontal_global_attention: bool = False,
    num_different_global_patterns: int = 1,
) -> Layout:
    """Sparse Transformer's "fixed" pattern: local windows of ``num_local_blocks`` blocks, and in every window
    ``num_global_blocks`` representative blocks (counted from the window's end; head ``h`` uses the
    ``h % num_different_global_patterns``-th group from the end) that every later block row attends to."""
    if num_local_blocks % num_global_blocks:
        raise ValueError(
            f"num_local_blocks={num_local_blocks} must be divisible by num_global_blocks={num_global_blocks}"
        )
    causal = _direction(attention)
    if horizontal_global_attention and causal:
        raise ValueError("horizontal_global_attention needs bidirectional attention")
    if num_different_global_patterns > 1 and not different_layout_per_head:
        raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head: true")
    if num_different_global_patterns > num_local_blocks // num_global_blocks:
        raise ValueError(
            f"num_different_global_patterns={num_different_global_patterns} is more than num_local_blocks / "
            f"num_global_blocks = {num_local_blocks // num_global_blocks}"
        )

    def draw(h: int, grid: Grid) -> None:
        n = num_blocks
        for start in range(0, n, num_local_blocks):
            _window_blocks(grid, start, min(start + num_local_blocks, n), causal)
        first = num_local_blocks - (1 + h % num_different_global_patterns) * num_global_blocks
        whole = n - n % num_local_blocks  # blocks in complete windows
        starts = list(range(first, whole, num_local_blocks))
        if whole < n:  # the short last window still gets its representatives (shifted back to fit)
            starts.append(min(whole + first, n - num_global_blocks))
        for s in starts:
            e = s + num_global_blocks
            _fill(grid, slice(s if causal else 0, None), slice(s, e))  # Python slices, as DeepSpeed's
            if horizontal_global_attention:
                _fill(grid, slice(s, e), slice(None))

    return _heads(num_heads, num_blocks, different_layout_per_head, draw)


def variable_layout(
    num_heads: int,
    num_blocks: int,
    rng: random.Random,
    *,
    different_layout_per_head: bool = False,
    num_random_blocks: int = 0,
    local_window_blocks: list[int] | None = None,
    global_block_indices: list[int] | None = None,
    global_block_end_indices: list[int] | None = None,
    attention: str = "bidirectional",
    horizontal_global_attention: bool = False,
) -> Layout:
    """ "Variable": random blocks (drawn from the whole row, whatever the direction), local windows of the given
    sizes (the last size repeats to the end), and global block columns (rows too with horizontal attention)."""
    windows = [4] if local_window_blocks is None else list(local_window_blocks)
    starts = [0] if global_block_indices is None else list(global_block_indices)
    ends = None if global_block_end_indices is None else list(global_block_end_indices)
    _check_global_ranges(starts, ends)
    causal = _direction(attention)
    if horizontal_global_attention and causal:
        raise ValueError("horizontal_global_attention needs bidirectional attention")
    if not windows:
        raise ValueError("local_window_blocks must list at least one window size")

    def draw(h: int, grid: Grid) -> None:
        n = num_blocks
        _random_rows(grid, num_random_blocks, rng, causal=False)
        start = 0
        for size in windows:
            _window_blocks(grid, start, min(start + size, n), causal)
            start += size
        for s in range(start, n, windows[-1]):
            _window_blocks(grid, s, min(s + windows[-1], n), causal)
        for s, e in _global_ranges(starts, ends, n):
            if horizontal_global_attention:
                _fill(grid, slice(s, e), slice(None))
            _fill(grid, slice(s if causal else 0, None), slice(s, e))

    return _heads(num_heads, num_blocks, different_layout_per_head, draw)


def bigbird_layout(
    num_heads: int,
    num_blocks: int,
    rng: random.Random,
    *,
    different_layout_per_head: bool = False,
    num_random_blocks: int = 1,
    num_sliding_window_blocks: int = 3,
    num_global_blocks: int = 1,
    attention: str = "bidirectional",
) -> Layout:
    """BigBird: random blocks per row, a sliding window, and the first ``num_global_blocks`` blocks global (rows
    and columns); unidirectional keeps the lower triangle."""
    causal = _direction(attention)

    def draw(h: int, grid: Grid) -> None:
        _random_rows(grid, num_random_blocks, rng, causal)
        _sliding(grid, num_sliding_window_blocks, causal_end=False)
        if num_blocks < num_global_blocks:
            raise ValueError(f"num_global_blocks={num_global_blocks} is larger than the {num_blocks} blocks of a row")
        _fill(grid, slice(None, num_global_blocks), slice(None))
        _fill(grid, slice(None), slice(None, num_global_blocks))
        if causal:
            _lower(grid)

    return _heads(num_heads, num_blocks, different_layout_per_head, draw)


def bslongformer_layout(
    num_heads: int,
    num_blocks: int,
    *,
    different_layout_per_head: bool = False,
    num_sliding_window_blocks: int = 3,
    global_block_indices: list[int] | None = None,
    global_block_end_indices: list[int] | None = None,
    attention: str = "bidirectional",
) -> Layout:
    """Block-sparse Longformer: a sliding window plus global blocks (rows and columns); unidirectional keeps the
    lower triangle."""
    starts = [0] if global_block_indices is None else list(global_block_indices)
    ends = None if global_block_end_indices is None else list(global_block_end_indices)
    _check_global_ranges(starts, ends)
    causal = attention == "unidirectional"  # DeepSpeed's class accepts any other value as bidirectional

    def draw(h: int, grid: Grid) -> None:
        _sliding(grid, num_sliding_window_blocks, causal_end=False)
        for s, e in _global_ranges(starts, ends, num_blocks):
            _fill(grid, slice(s, e), slice(None))
            _fill(grid, slice(None), slice(s, e))
        if causal:
            _lower(grid)

    return _heads(num_heads, num_blocks, different_layout_per_head, draw)


def local_layout(
    num_heads: int, num_blocks: int, *, num_sliding_window_blocks: int = 3, attention: str = "unidirectional"
) -> Layout:
    """A pure sliding window of blocks: ``num_sliding_window_blocks // 2`` blocks back (and forward when
    bidirectional); every head the same."""
    causal = attention != "bidirectional"  # DeepSpeed's class treats any other value as unidirectional

    def draw(h: int, grid: Grid) -> None:
        _sliding(grid, num_sliding_window_blocks, causal_end=causal)

    return _heads(num_heads, num_blocks, False, draw)


# ----------------------------------------------------------------------------------------------------------------
# GPT-NeoX's use: one layout per sparse layer, from the sparsity_config key


def gpt_neox_settings(kind: str, sparsity: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    """``(block, builder keyword arguments)`` GPT-NeoX passes DeepSpeed for attention type ``kind``."""
    sparsity = sparsity or {}
    block = sparsity.get("block", BLOCK_DEFAULT)
    opts = {k: sparsity.get(k, d) for k, d in GPT_NEOX_DEFAULTS[kind].items()}
    if kind == "local":
        window = opts.pop("num_local_blocks")
        opts["num_sliding_window_blocks"] = opts["num_sliding_window_blocks"] if window is None else window
    elif kind in ("sparse_fixed", "sparse_variable"):
        opts["horizontal_global_attention"] = False
    opts["attention"] = "unidirectional"
    return block, opts


def layout_rng(seed: int, layer_index: int) -> random.Random:
    """The generator of a layer's random blocks: the same on every rank and in every run of a config."""
    return random.Random(f"neox-forge sparse layout {seed} {layer_index}")


def gpt_neox_layout(
    kind: str, sparsity: dict[str, Any] | None, num_heads: int, seq_length: int, rng: random.Random
) -> tuple[int, Layout]:
    """``(block, layout [num_heads][seq_length // block][seq_length // block])`` of a layer of type ``kind``, as
    GPT-NeoX configures DeepSpeed (made once at ``seq_length``; shorter sequences use its top-left corner)."""
    if kind not in SPARSE_TYPES:
        raise ValueError(f"attention type {kind!r} has no block layout; sparse types: {', '.join(SPARSE_TYPES)}")
    block, opts = gpt_neox_settings(kind, sparsity)
    if type(block) is not int or block < 1:
        raise ValueError(f"sparsity_config.block={block!r} must be a positive integer")
    if seq_length % block:
        raise ValueError(f"seq_length={seq_length} must be divisible by sparsity_config.block={block}")
    n = seq_length // block
    if n > MAX_BLOCKS:
        raise ValueError(
            f"seq_length={seq_length} / sparsity_config.block={block} gives {n} blocks a row; at most {MAX_BLOCKS} "
            "are supported: use a larger block"
        )
    if kind == "sparse_fixed":
        return block, fixed_layout(num_heads, n, **opts)
    if kind == "sparse_variable":
        return block, variable_layout(num_heads, n, rng, **opts)
    if kind == "bigbird":
        return block, bigbird_layout(num_heads, n, rng, **opts)
    if kind == "bslongformer":
        return block, bslongformer_layout(num_heads, n, **opts)
    return block, local_layout(num_heads, n, **opts)
