"""The package import graph of ``megatron/`` has no cycles and keeps its layering.

The graph is read with ``ast`` from every import statement: module-level, function-level and type-only
(``if TYPE_CHECKING:``) imports alike, and imports of a package from inside it (``import megatron``,
``from megatron import NeoXArgs``), so a cycle cannot hide behind an import moved into a function body, under
``TYPE_CHECKING`` or behind a package's ``__getattr__``. The few exceptions are listed with their reason; a listed
exception that no longer exists fails the test too.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.harness import REPO_ROOT
from tests.import_graph import Edge, find_cycles, graph, import_edges, layer, module_names

# (importer layer, imported layer) left out of the package-cycle check, with the reason.
ALLOWED_LAYER_EDGES: dict[tuple[str, str], str] = {}

# Module cycles that are known and not yet broken, with the reason.
KNOWN_MODULE_CYCLES: dict[tuple[str, ...], str] = {}

# Imports of the package root ``megatron`` (its public face: GPT-NeoX's ``from megatron import NeoXArgs``) from
# inside it, with the reason. The root imports its subpackages on first use, so each of these closes a cycle.
ROOT_IMPORTS: dict[str, str] = {}

# What the lower layers may import (of megatron's own layers). A layer not listed here is constrained by the
# cycle check only. ``megatron/__init__.py`` (the package's public face) is not a layer.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "cluster": {"errors"},  # hostfiles and launcher rank variables
    "cpu_features": set(),
    "registry": set(),  # the name -> entry tables of optimizers, activations, norms, position embeddings
    "engine_protocol": set(),  # the DeepSpeed engine's type: training, checkpoint, post_training, evaluation use it
    "mpu": {"cluster"},  # collectives and process groups; the launcher's rank variables before the group exists
    "distributed": {"cluster"},
    "neox_arguments": {"errors", "cluster", "distributed"},  # not launcher, training, model, data, post_training
    "config_utils": {"neox_arguments"},
    "parallel_config": {"config_utils", "neox_arguments"},  # its keys: inherited from the schema
    "logging": {"cluster", "config_utils", "distributed", "mpu", "neox_arguments"},  # its keys: the schema's
    "model": {"config_utils", "mpu", "neox_arguments", "errors", "distributed", "registry"},  # not training, checkpoint
    "tokenizer": {"config_utils", "errors", "logging", "neox_arguments"},
    "data": {"config_utils", "errors", "logging", "mpu", "neox_arguments", "tokenizer"},  # not training, model
}


@functools.cache
def _all_edges() -> list[Edge]:
    return import_edges(REPO_ROOT)


@functools.cache
def _edges() -> list[Edge]:
    """The edges between modules below the root; imports of the root are checked by ``test_nothing_imports_the_root``
    (the root, GPT-NeoX's public face, imports its subpackages)."""
    return [e for e in _all_edges() if e.source != "megatron" and e.target != "megatron"]


def test_nothing_imports_the_root() -> None:
    found = {e.source: e.where for e in _all_edges() if e.target == "megatron"}
    new = sorted(f"{where}: {source} imports the package root" for source, where in found.items())
    new = [line for line in new if line.split(": ")[1].split()[0] not in ROOT_IMPORTS]
    assert not new, "import what you need from its module, not from megatron/__init__.py:\n" + "\n".join(new)
    assert set(ROOT_IMPORTS) <= set(found), f"gone, remove from ROOT_IMPORTS: {set(ROOT_IMPORTS) - set(found)}"


def test_module_graph_with_the_root_has_only_the_known_cycles() -> None:
    """With the root's edges (both ways) in, the only cycles are the known ones and those through ROOT_IMPORTS."""
    edges = [e for e in _all_edges() if e.target != "megatron" or e.source not in ROOT_IMPORTS]
    cycles = {tuple(c) for c in find_cycles(graph(edges, by_layer=False))}
    assert cycles <= set(KNOWN_MODULE_CYCLES), f"cycles through the root: {sorted(cycles - set(KNOWN_MODULE_CYCLES))}"


def test_no_package_cycles() -> None:
    edges = _edges()
    cycles = find_cycles(graph(edges, by_layer=True, ignore=set(ALLOWED_LAYER_EDGES)))
    where = {
        f"{layer(e.source)} -> {layer(e.target)}: {e.where}"
        for e in edges
        if any(layer(e.source) in c and layer(e.target) in c for c in cycles)
    }
    assert not cycles, f"package import cycles {cycles}; the imports on them:\n" + "\n".join(sorted(where))


def test_allowed_layer_edges_exist() -> None:
    """An exception that no longer happens is removed from the list, so the list stays true."""
    present = {(layer(e.source), layer(e.target)) for e in _edges()}
    assert set(ALLOWED_LAYER_EDGES) <= present, f"stale: {set(ALLOWED_LAYER_EDGES) - present}"


def test_no_module_cycles_but_the_known_ones() -> None:
    cycles = {tuple(c) for c in find_cycles(graph(_edges(), by_layer=False))}
    assert cycles <= set(KNOWN_MODULE_CYCLES), f"new module import cycles: {sorted(cycles - set(KNOWN_MODULE_CYCLES))}"
    assert set(KNOWN_MODULE_CYCLES) <= cycles, f"broken, remove from the list: {set(KNOWN_MODULE_CYCLES) - cycles}"


def test_lower_layers_import_only_what_is_below_them() -> None:
    bad = sorted(
        f"{e.where}: {layer(e.source)} imports {e.target}"
        for e in _edges()
        if layer(e.source) in MAY_IMPORT
        and layer(e.target) != layer(e.source)
        and layer(e.target) not in MAY_IMPORT[layer(e.source)]
    )
    assert not bad, "layering violations (see MAY_IMPORT):\n" + "\n".join(bad)
    assert set(MAY_IMPORT) <= {layer(m) for m in module_names(REPO_ROOT)}, "MAY_IMPORT names a layer that is gone"


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "megatron"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megatron.b.y import f\n")
    (pkg / "a" / "w.py").write_text("import megatron\nfrom megatron import a, helper\nimport megatron.a\n")
    (pkg / "b" / "y.py").write_text(
        textwrap.dedent(
            """\
            from typing import TYPE_CHECKING
            from . import z
            if TYPE_CHECKING:
                from megatron.a import x as typing_only
            def f():
                from megatron.a.x import g
            """
        )
    )
    (pkg / "b" / "z.py").write_text("")
    edges = {(e.source, e.target, e.where) for e in import_edges(tmp_path)}
    assert edges == {
        ("megatron.a.x", "megatron.b.y", "megatron/a/x.py:1"),
        ("megatron.a.w", "megatron", "megatron/a/w.py:1"),  # the package root
        ("megatron.a.w", "megatron.a", "megatron/a/w.py:2"),  # a subpackage by name
        ("megatron.a.w", "megatron", "megatron/a/w.py:2"),  # a name of the root (its __getattr__)
        ("megatron.a.w", "megatron.a", "megatron/a/w.py:3"),  # its own package
        ("megatron.b.y", "megatron.b.z", "megatron/b/y.py:2"),
        ("megatron.b.y", "megatron.a.x", "megatron/b/y.py:4"),  # type-only
        ("megatron.b.y", "megatron.a.x", "megatron/b/y.py:6"),  # function-level
    }
    assert find_cycles(graph(list(import_edges(tmp_path)), by_layer=True)) == [["a", "b"]]


def test_each_package_imports_alone() -> None:
    """Every layer imports in a fresh ``megatron`` (earlier imports purged), so no import works only by luck of order."""
    layers = sorted({m for m in module_names(REPO_ROOT) if m.count(".") == 1})
    script = textwrap.dedent(
        f"""\
        import importlib, sys
        for name in {layers!r}:
            for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
                del sys.modules[key]
            importlib.import_module(name)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_config_layer_loads_no_torch() -> None:
    """docs/architecture.md: the config layer imports no torch-level code (deepy.py resolves configs without it), so
    the schema keeps allowed values as ``Literal``s that tests/unit/test_registries.py compares with the registries."""
    script = "import sys, megatron.neox_arguments; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"importing megatron.neox_arguments loaded {done.stdout.strip()}"
