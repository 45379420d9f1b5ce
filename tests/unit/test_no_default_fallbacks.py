"""No ``or <default>`` fallback, and no ``int()``/``float()``/``bool()`` coercion, restates a config key's schema.

Every resolved config holds each key with its schema type (``NeoXArgs`` type-checks and fills in defaults; module
configs inherit the schema's keys with their types and defaults). So ``cfg.pipe_parallel_size or 0`` restates the
default 0 (and would hide a wrong value) and ``int(cfg.pipe_parallel_size)`` restates the type. The scan parses
``megatron/``, ``tools/`` and the top-level entry points with ``ast``; a key read is ``<obj>.<key>``,
``<values>["<key>"]`` or a function parameter named after a key. It flags:

* ``<read> or ...`` when the key has a value in every resolved config: its schema default is not ``None``, or its
  type excludes ``None`` (a required or derived key). Flags (``bool`` keys) are boolean logic, not fallbacks; an
  ``Optional`` key whose default is ``None`` means "unset", and its fallback says what unset means. The config layer
  (``megatron/neox_arguments/``) validates values before it knows every required and derived key is set, so there
  only keys with a real default count.
* ``int(<read>)`` / ``float(...)`` / ``bool(...)`` when the key's type is exactly that type (an ``Optional`` key's
  coercion after a ``None`` check is not detected: the scan does not follow narrowing).
* ``<x>.get("<key>", <literal>)``, ``<x>.pop("<key>", <literal>)`` and ``getattr(<x>, "<key>", <literal>)`` on a
  config object or values dict (``<x>`` one of ``CONFIG_NAMES``: not a Hugging Face config, a DeepSpeed state dict
  or lm-eval's keyword arguments, which share some key names) when the literal is the key's schema default (e.g.
  ``params.pop("lr", 0.001)``): the default is written a second time, and the copies can drift apart. Take the
  value from its owner (the resolved key) instead.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from typing import Any, NamedTuple

from megatron.neox_arguments.keys import FIELDS, HINTS
from tests.harness import REPO_ROOT

CONFIG_LAYER = "megatron/neox_arguments/"
COERCIONS = {"int": int, "float": float, "bool": bool}
# names of config objects and values dicts: args, module configs, the config layer's values, optimizer.params
CONFIG_NAMES = frozenset({"args", "neox_args", "cfg", "config", "v", "values", "params", "self"})
# "path key" -> why the read is right as it is. Keep it short: fix the read instead.
EXEMPT: dict[str, str] = {
    "megatron/planner/cli.py global_num_gpus": (
        "_default_gpus reads the merged files and command-line overrides before any type check (an override is a "
        "string) to pick the world size the config is then resolved with"
    ),
}


class Finding(NamedTuple):
    rel: str
    line: int
    key: str
    what: str

    def __str__(self) -> str:
        return f"{self.rel}:{self.line} {self.key}: {self.what}"


def _nullable(hint: Any) -> bool:
    return hint is Any or hint is type(None) or type(None) in typing.get_args(hint)


def _default(key: str) -> Any:
    f = FIELDS[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def always_set(key: str, *, config_layer: bool) -> bool:
    """Whether ``key`` holds a value in every resolved config (so an ``or`` after it is dead or wrong)."""
    if HINTS[key] is bool:
        return False  # a flag: `a or b` is boolean logic
    if _default(key) is not None:
        return True
    return not _nullable(HINTS[key]) and not config_layer


def _key_read(node: ast.expr, params: frozenset[str]) -> str | None:
    """The config key ``node`` reads: ``<obj>.<key>``, ``<name>["<key>"]``, or a parameter named after a key."""
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)  # a values dict; not e.g. an optimizer's param_groups[0]["lr"]
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        name = node.slice.value
    elif isinstance(node, ast.Name) and node.id in params:
        name = node.id
    else:
        return None
    return name if name in FIELDS else None


class _Scan(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel, self.config_layer = rel, rel.startswith(CONFIG_LAYER)
        self.params: frozenset[str] = frozenset()
        self.found: list[Finding] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        outer, a = self.params, node.args
        self.params = outer | {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
        self.generic_visit(node)
        self.params = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _never_none(self, key: str) -> bool:
        # a bool key always holds a bool; a required int may still be None in the config layer
        return HINTS[key] is bool or always_set(key, config_layer=self.config_layer)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if isinstance(node.op, ast.Or):
            for value in node.values[:-1]:
                key = _key_read(value, self.params)
                if key is not None and always_set(key, config_layer=self.config_layer):
                    what = (
                        f"`{ast.unparse(node)}` falls back although {key} always has a value "
                        f"(type {HINTS[key]}, default {_default(key)!r})"
                    )
                    self.found.append(Finding(self.rel, node.lineno, key, what))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in COERCIONS and len(node.args) == 1 and not node.keywords:
            key = _key_read(node.args[0], self.params)
            if key is not None and HINTS[key] is COERCIONS[func.id] and self._never_none(key):
                what = f"`{ast.unparse(node)}` converts a value that is already {func.id}"
                self.found.append(Finding(self.rel, node.lineno, key, what))
        restated = _restated_default(node)
        if restated is not None:
            what = f"`{ast.unparse(node)}` restates the schema default of {restated} ({_default(restated)!r})"
            self.found.append(Finding(self.rel, node.lineno, restated, what))
        self.generic_visit(node)


def _restated_default(node: ast.Call) -> str | None:
    """The key whose schema default ``node`` writes out again: ``x.get("key", default)``, ``x.pop(...)``,
    ``getattr(x, "key", default)`` with a literal equal to the key's default."""
    func, args = node.func, node.args
    if isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and len(args) == 2:
        owner, (key_node, fallback) = func.value, args
    elif isinstance(func, ast.Name) and func.id == "getattr" and len(args) == 3:
        owner, key_node, fallback = args
    else:
        return None
    if not (isinstance(owner, ast.Name) and owner.id in CONFIG_NAMES):
        return None
    if not (isinstance(key_node, ast.Constant) and isinstance(key_node.value, str) and key_node.value in FIELDS):
        return None
    try:
        value = ast.literal_eval(fallback)
    except ValueError:
        return None
    key = key_node.value
    default = _default(key)
    same = value == default and type(value) is type(default)
    return key if same and default is not None and not isinstance(default, bool) else None


def problems_in(source: str, rel: str) -> list[Finding]:
    """Every fallback or coercion in ``source`` (the file ``rel``) that restates the schema."""
    scan = _Scan(rel)
    scan.visit(ast.parse(source, rel))
    return scan.found


def all_problems() -> list[Finding]:
    files = sorted([*REPO_ROOT.glob("megatron/**/*.py"), *REPO_ROOT.glob("tools/**/*.py"), *REPO_ROOT.glob("*.py")])
    found = []
    for path in files:
        rel = path.relative_to(REPO_ROOT).as_posix()
        found += problems_in(path.read_text(encoding="utf-8"), rel)
    return found


def test_no_fallback_restates_the_schema() -> None:
    found = [f for f in all_problems() if f"{f.rel} {f.key}" not in EXEMPT]
    assert not found, (
        "these reads restate a key's schema default or type (read the key as it is; a fallback belongs only to an "
        "Optional key, where None means unset; EXEMPT in this file takes a reason):\n" + "\n".join(map(str, found))
    )


def test_every_exemption_is_still_needed() -> None:
    used = {f"{f.rel} {f.key}" for f in all_problems()}
    assert not set(EXEMPT) - used, f"exemptions that no longer match anything: {sorted(set(EXEMPT) - used)}"


_SNIPPET = """
def runs_model_parallel(model_parallel_size: int | None, pipe_parallel_size: int | None) -> bool:
    return int(model_parallel_size or 1) * max(int(pipe_parallel_size or 0), 1) > 1

def reads(args, cfg, v, env):
    gpus = int(args.global_num_gpus or 1)
    pp = int(cfg.pipe_parallel_size or 0)
    warmup = float(cfg.warmup or 0.0)
    mp = v["model_parallel_size"] or 1
    lr = float(cfg.lr)
    multi = cfg.force_multi or cfg.deepspeed_slurm
    hostfile = cfg.hostfile or env
    jitter = cfg.moe_jitter_eps if cfg.moe_jitter_eps is not None else 0.0
    base = float(cfg.rotary_emb_base)
    group_lr = float(engine.param_groups[0]["lr"])
    peak = params.pop("lr", 0.001)
    rest = params.pop("lr", None), params.get("lr", 0.5), getattr(cfg, "hidden_dropout", 0.0)
    foreign = getattr(hf_config, "hidden_dropout", 0.0), osd.get("zero_stage", 0)
"""


def test_the_scan_catches_each_kind() -> None:
    found = {(f.line, f.key, f.what.split("`")[2].split()[0]) for f in problems_in(_SNIPPET, "megatron/x.py")}
    assert found == {
        (3, "model_parallel_size", "falls"),
        (3, "pipe_parallel_size", "falls"),
        (6, "global_num_gpus", "falls"),  # derived: set in every resolved config
        (7, "pipe_parallel_size", "falls"),
        (8, "warmup", "falls"),
        (9, "model_parallel_size", "falls"),
        (10, "lr", "converts"),
        (16, "lr", "restates"),
        (17, "hidden_dropout", "restates"),
    }, found
    # the config layer may still see a required or derived key unset; a real default is restated there too
    layer = {(f.line, f.key) for f in problems_in(_SNIPPET, "megatron/neox_arguments/x.py")}
    assert (6, "global_num_gpus") not in layer and (7, "pipe_parallel_size") in layer
