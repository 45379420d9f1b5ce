"""The import graph of ``megatron/``, read with ``ast``: every import statement is an edge.

Module-level, function-level and type-only (``if TYPE_CHECKING:``) imports alike: a type-level cycle still ties
two modules together (neither can be understood, moved or tested without the other). An import of a module's own
package or of an ancestor package (``import megatron``, ``from megatron import NeoXArgs``, ``import
megatron.training`` inside ``megatron/training/``) is an edge too (``from megatron import mpu`` names the module
``megatron.mpu``, not the root). A module is named by its dotted path (``megatron.data.indexed_dataset``); its
layer is the first component below ``megatron`` (``data``, ``mpu``, ``distributed`` for
``megatron/distributed.py``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str


def module_names(root: Path, package: str = "megatron") -> dict[str, Path]:
    """Dotted module name -> file, for every ``*.py`` of ``root/package`` (``__init__`` names the package)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` starts with (``megatron.x.Class`` -> ``megatron.x``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(root: Path, package: str = "megatron") -> list[Edge]:
    """Every import of one ``package`` module by another (self-imports left out)."""
    modules = module_names(root, package)
    edges: list[Edge] = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = source.split(".")[: len(source.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = _resolve(name, modules)
                if target and target != source:
                    where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                    edges.append(Edge(source, target, where))
    return edges


def layer(module: str) -> str:
    """``megatron.data.x`` -> ``data``; ``megatron`` itself -> ``megatron``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def graph(edges: list[Edge], *, by_layer: bool, ignore: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    """Adjacency sets of modules (or of layers), without the ``ignore``d (source, target) pairs."""
    out: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        s, t = (layer(e.source), layer(e.target)) if by_layer else (e.source, e.target)
        if s != t and (s, t) not in ignore:
            out[s].add(t)
    return out
