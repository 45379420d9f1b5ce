"""Which tests start other processes: the rule behind the ``launches`` marker (see ``tests/conftest.py``).

A test *launches* when its function, a fixture it uses, or any function of the test tree these call (followed
through module-level helpers, methods reached by ``self.``, and names imported from ``tests.*`` modules such as
``tests.harness.run_distributed``) references a process-starting API: ``subprocess.run``/``Popen``/…,
``os.fork``/``os.system``/…, or anything of ``multiprocessing``/``torch.multiprocessing`` that starts workers,
except a call whose program is a literal that is no interpreter and no launcher (``subprocess.run(["git", …])``).
The scan reads source with :mod:`ast`; it never imports or runs the code it reads.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from tests.process_watch import is_launch_program
from tests.source_ast import dotted_name

REPO_ROOT = Path(__file__).resolve().parent.parent

# Dotted names (after resolving import aliases) that start a process.
PROCESS_APIS = frozenset(
    {
        *(f"subprocess.{n}" for n in ("run", "Popen", "call", "check_call", "check_output", "getoutput")),
        *(f"subprocess.{n}" for n in ("getstatusoutput",)),
        *(f"os.{n}" for n in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv")),
        *(f"os.{n}" for n in ("execve", "execvp", "spawnv", "spawnve", "spawnl", "spawnlp", "spawnvp")),
        "pty.spawn",
        "pty.fork",
        *(f"multiprocessing.{n}" for n in ("Process", "Pool", "get_context", "Manager", "set_start_method")),
        *(f"torch.multiprocessing.{n}" for n in ("spawn", "start_processes", "Process", "Pool", "get_context")),
        "concurrent.futures.ProcessPoolExecutor",
    }
)


@dataclass
class _Function:
    """What one function (or method) of a module references, with import aliases resolved."""

    processes: set[str] = field(default_factory=set)  # PROCESS_APIS it names directly
    calls: set[str] = field(default_factory=set)  # keys "path::qualname" of test-tree functions it names


def _module_path(dotted: str) -> Path | None:
    """``tests.e2e.shrink`` → its file, for modules of the test tree only."""
    if dotted != "tests" and not dotted.startswith("tests."):
        return None
    base = REPO_ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class ModuleScan:
    """One file's functions (``qualname`` → what it references)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self.aliases = self._aliases(tree)
        self.top_level: set[str] = set()
        self.functions: dict[str, _Function] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.top_level.add(node.name)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = self._function(node, cls=None)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.functions[f"{node.name}.{item.name}"] = self._function(item, cls=node.name)

    @staticmethod
    def _aliases(tree: ast.AST) -> dict[str, str]:
        """Local name → dotted origin, for imports anywhere in the file (function-level ones included)."""
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        aliases[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return aliases

    def _resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        origin = self.aliases.get(head)
        if origin is None:
            return dotted
        return f"{origin}.{rest}" if rest else origin

    def _harmless_program_calls(self, node: ast.AST) -> set[int]:
        """ids of the callee nodes of calls like ``subprocess.run(["git", ...])``: a process API given a literal
        program that is no interpreter, no shell and no launcher (``tests.process_watch.is_launch_program``)."""
        ids: set[int] = set()
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.List | ast.Tuple)):
                continue
            dotted = dotted_name(call.func)
            program = call.args[0].elts[0] if call.args[0].elts else None
            if (
                dotted is not None
                and self._resolve(dotted) in PROCESS_APIS
                and isinstance(program, ast.Constant)
                and isinstance(program.value, str)
                and not is_launch_program(program.value)
                and program.value not in ("sh", "bash")
            ):
                ids.add(id(call.func))
        return ids

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, cls: str | None) -> _Function:
        found = _Function()
        harmless = self._harmless_program_calls(node)
        for sub in ast.walk(node):
            if id(sub) in harmless:
                continue
            if isinstance(sub, ast.Attribute | ast.Name) and not (
                isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
            ):
                dotted = dotted_name(sub)
                if dotted is None:
                    continue
                if cls and dotted.startswith(("self.", "cls.")) and dotted.count(".") == 1:
                    found.calls.add(f"{self.path}::{cls}.{dotted.split('.', 1)[1]}")
                    continue
                resolved = self._resolve(dotted)
                if resolved in PROCESS_APIS:
                    found.processes.add(resolved)
                elif isinstance(sub, ast.Name) and sub.id in self.top_level and sub.id not in self.aliases:
                    found.calls.add(f"{self.path}::{sub.id}")
                elif "." in resolved:  # `from tests.harness import run_command` or `harness.run_command`
                    module, _, name = resolved.rpartition(".")
                    target = _module_path(module)
                    if target is not None:
                        found.calls.add(f"{target}::{name}")
        return found


class LaunchScanner:
    """Answers "does this function start a process, and through what?" for functions of the test tree."""

    def __init__(self, roots: tuple[Path, ...] = (REPO_ROOT / "tests",)) -> None:
        self._roots = roots  # only files below these are read
        self._modules: dict[Path, ModuleScan | None] = {}
        self._memo: dict[str, tuple[str, ...] | None] = {}

    def _module(self, path: Path) -> ModuleScan | None:
        if path not in self._modules:
            inside = path.is_file() and path.suffix == ".py" and any(root in path.parents for root in self._roots)
            self._modules[path] = ModuleScan(path) if inside else None
        return self._modules[path]

    def launch_chain(self, path: Path, qualname: str) -> tuple[str, ...] | None:
        """The call chain from ``qualname`` (in ``path``) to a process-starting API, or None when it starts none."""
        return self._chain(f"{Path(path).resolve()}::{qualname}", set())

    def _chain(self, key: str, visiting: set[str]) -> tuple[str, ...] | None:
        if key in self._memo:
            return self._memo[key]
        if key in visiting:
            return None
        visiting.add(key)
        path_text, _, qualname = key.partition("::")
        module = self._module(Path(path_text))
        fn = module.functions.get(qualname) if module else None
        chain: tuple[str, ...] | None = None
        if fn is not None:
            label = f"{Path(path_text).name}::{qualname}"
            if fn.processes:
                chain = (label, sorted(fn.processes)[0])
            else:
                for callee in sorted(fn.calls):
                    below = self._chain(callee, visiting)
                    if below is not None:
                        chain = (label, *below)
                        break
        visiting.discard(key)
        if chain is not None or not visiting:  # a "no" found while a caller is open may be a cut cycle
            self._memo[key] = chain
        return chain
