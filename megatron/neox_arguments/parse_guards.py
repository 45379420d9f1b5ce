"""Limits on what a config file may ask the parser to build: YAML alias expansion, recursive aliases, integers too
long to convert, keys repeated inside one JSON object.

PyYAML shares the object an alias refers to, so a "billion laughs" document parses fast and small; it is everything
after (printing the config, copying it for DeepSpeed, writing it as JSON) that expands it exponentially. So the
composed node graph is measured before anything is constructed: the size it expands to, counted with memoisation,
must stay below ``MAX_VALUES``, and no alias may refer to a value that contains it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import yaml

# A real config has a few hundred values; a long list of data paths some thousands. Far above both.
MAX_VALUES = 1_000_000
_INT_TAG = "tag:yaml.org,2002:int"


def max_int_digits() -> int:
    """The longest decimal integer Python converts (``sys.set_int_max_str_digits``; 4300 by default)."""
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    return limit or 4300


def _children(node: yaml.Node) -> list[tuple[str | None, yaml.Node]]:
    """(key text or None, child) for each child node of ``node``; mapping keys are children too."""
    if isinstance(node, yaml.MappingNode):
        out: list[tuple[str | None, yaml.Node]] = []
        for k, v in node.value:
            out.append((None, k))
            out.append((str(k.value) if isinstance(k, yaml.ScalarNode) else None, v))
        return out
    if isinstance(node, yaml.SequenceNode):
        return [(None, c) for c in node.value]
    return []


def _key_path(node_id: int, parents: dict[int, tuple[int, str | None]]) -> str:
    parts: list[str] = []
    while node_id in parents:
        node_id, key = parents[node_id]
        if key is not None:
            parts.append(key)
    return ".".join(reversed(parts))


def yaml_graph_problem(root: yaml.Node) -> str | None:
    """What is wrong with a composed YAML document's node graph (``line N: ...``), or None.

    Walks the graph once (iteratively: the composer's own recursion bounds the depth, this walk adds none) and
    refuses an expanded size above ``MAX_VALUES``, an alias inside the value it names, and a decimal integer too long
    for Python to convert (it would raise deep inside the constructor).
    """
    sizes: dict[int, int] = {}
    parents: dict[int, tuple[int, str | None]] = {}
    expanding: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        nid = id(node)
        line = node.start_mark.line + 1
        if done:
            expanding.discard(nid)
            sizes[nid] = 1 + sum(sizes[id(c)] for _, c in _children(node))
            if sizes[nid] > MAX_VALUES:
                key = _key_path(nid, parents)
                return (
                    f"line {line}: {f'key {key!r}: ' if key else ''}the value expands to more than {MAX_VALUES:,} "
                    "values through aliases (*name); write the values out instead"
                )
            continue
        if nid in sizes:
            continue
        if isinstance(node, yaml.ScalarNode) and node.tag == _INT_TAG:
            digits = len(node.value.lstrip("+-").replace("_", ""))
            if digits > max_int_digits():
                key = _key_path(nid, parents)
                what = f"key {key!r}: " if key else ""
                return f"line {line}: {what}an integer of {digits} digits is too long (the limit is {max_int_digits()})"
        expanding.add(nid)
        stack.append((node, True))
        for child_key, child in _children(node):
            cid = id(child)
            if cid in expanding:
                return f"line {line}: an alias refers to a value that contains it (a recursive alias)"
            if cid not in sizes:
                parents.setdefault(cid, (nid, child_key))
                stack.append((child, False))
    return None


class LongInt:
    """Stand-in for a JSON integer too long to convert: reported with its key after parsing."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


class DuplicateKeys(dict):
    """A JSON object in which some keys were given more than once (``repeated``, in order)."""

    repeated: list[str]


def json_int(text: str) -> int | LongInt:
    """``parse_int`` for ``json.loads``: Python refuses to convert very long integers deep inside the decoder."""
    digits = len(text.lstrip("-"))
    return LongInt(digits) if digits > max_int_digits() else int(text)


def json_object(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` for ``json.loads``: a dict, marked when a key is repeated (the last would win)."""
    out: dict[str, Any] = {}
    repeated: list[str] = []
    for key, value in pairs:
        if key in out and key not in repeated:
            repeated.append(key)
        out[key] = value
    if not repeated:
        return out
    marked = DuplicateKeys(out)
    marked.repeated = repeated
    return marked


def _walk(data: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key path, value) of every dict, list item and leaf in ``data`` (a freshly parsed tree)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def json_tree_problems(data: Any) -> list[str]:
    """Repeated keys and over-long integers in a tree parsed with ``json_object`` / ``json_int``."""
    out: list[str] = []
    for path, value in _walk(data):
        if isinstance(value, DuplicateKeys):
            for key in value.repeated:
                where = f"{path}.{key}" if path else key
                out.append(f"key {where!r} is given twice in one object; keep one (the last would silently win)")
        elif isinstance(value, LongInt):
            out.append(
                f"key {path!r}: an integer of {value.digits} digits is too long (the limit is {max_int_digits()})"
            )
    return out
