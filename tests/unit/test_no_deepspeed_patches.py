"""No code in megatron/ outside training/deepspeed_adapter.py writes DeepSpeed internals: no assignment to a private
attribute of another object (``engine._x = ...``, ``setattr(engine, "_x", ...)``), no assignment to any attribute of
a DeepSpeed engine or optimizer, of a DeepSpeed class or module or of the accelerator (``SomeDSClass.method = ...``,
``type(get_accelerator()).x = ...``, ``deepspeed.comm.torch.build_shm_op = ...``, also through a module object
from ``importlib.import_module("deepspeed...")`` or ``sys.modules["deepspeed..."]``), except the writes listed in
``OUTSIDE_THE_ADAPTER`` with their reason. An AST scan, so comments and strings do not count and aliases are seen.

And DeepSpeed's optimizer internals (``ZERO_INTERNALS``: ZeRO's and the BF16 optimizer's partitions, gradients and
fragment maps) are read only in the files of ``ZERO_READERS``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "megatron/training/deepspeed_adapter.py"
# private attributes of objects that are not DeepSpeed's, set where they are made (path -> target, why)
NOT_DEEPSPEED = {
    "megatron/neox_arguments/loader.py": {"loader._root_node"},  # a PyYAML loader: the file it reads (messages)
    "megatron/neox_arguments/neox_args.py": {"obj._owner"},  # a config section: the NeoXArgs that owns it
}
DS_WORDS = ("engine", "optimizer", "accelerator", "deepspeed")
# writes into DeepSpeed outside the adapter: path -> {the target as written: why}
OUTSIDE_THE_ADAPTER: dict[str, dict[str, str]] = {
    "megatron/distributed.py": {
        "ds_torch_comm.build_shm_op": "process start-up on CPU: DeepSpeed's TorchBackend would JIT-build its "
        "shared-memory all-reduce op (~70 s), which training never uses; replaced for the whole process before "
        "deepspeed.init_distributed (the distributed layer sits below training and cannot import the adapter)",
    },
}
# DeepSpeed optimizer internals (attribute names), and the files that read them besides the adapter
ZERO_INTERNALS = frozenset(
    {
        "averaged_gradients",
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
        "fp32_partitioned_groups_flat_grad",
        "fp32_groups_flat_partition",
        "fp32_groups_gradients_flat",
        "bit16_groups",
        "bf16_groups",
        "fp16_groups",
        "_hp_mapping",
        "lp_fragment_address",
        "hp_fragment_address",
        "ds_numel",
    }
)
ZERO_READERS: dict[str, str] = {
    ADAPTER: "the step's needs (reduced gradients, fp32 ZeRO-3 partitions)",
    "megatron/training/memory_usage.py": "bytes of master weights, optimizer state and gradients a rank holds",
    "megatron/checkpoint/optimizer_carry.py": "carries a resharded optimizer state into ZeRO/bf16 partitions",
    "megatron/checkpoint/state_checks.py": "finiteness of the loaded / to-be-saved fp32 partitions, per parameter",
}


def _imports_deepspeed_module(node: ast.AST) -> bool:
    """``importlib.import_module("deepspeed...")``, ``__import__("deepspeed...")``, ``sys.modules["deepspeed..."]``."""
    for sub in ast.walk(node):
        text = None
        if isinstance(sub, ast.Call) and sub.args and isinstance(sub.args[0], ast.Constant):
            name = ast.unparse(sub.func)
            if name.endswith("import_module") or name == "__import__":
                text = sub.args[0].value
        elif isinstance(sub, ast.Subscript) and ast.unparse(sub.value).endswith("sys.modules"):
            if isinstance(sub.slice, ast.Constant):
                text = sub.slice.value
        if isinstance(text, str) and text.split(".")[0] == "deepspeed":
            return True
    return False


def _deepspeed_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "deepspeed")
        elif (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and node.value is not None
            and _imports_deepspeed_module(node.value)  # mod = importlib.import_module("deepspeed.comm.torch")
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _is_deepspeed(base: ast.expr, ds_names: set[str]) -> bool:
    """An engine, optimizer, accelerator or DeepSpeed name: ``engine``, ``self.engine.optimizer``, ``model_engine``,
    ``get_accelerator()``, ``type(x)``, a name imported from deepspeed (``step.optimizer_step`` is none)."""
    names = {n.id for n in ast.walk(base) if isinstance(n, ast.Name)}
    words = names | {n.attr for n in ast.walk(base) if isinstance(n, ast.Attribute)}
    called_type = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "type"
    ds_word = any(w.lower() == d or w.lower().endswith("_" + d) for w in words for d in DS_WORDS)
    return bool(names & ds_names) or called_type or ds_word or _imports_deepspeed_module(base)


def violations(source: str, path: str = "<src>") -> list[str]:
    """Every write into DeepSpeed internals in ``source`` (``path: line: target``)."""
    tree = ast.parse(source)
    ds_names = _deepspeed_names(tree)
    allowed = NOT_DEEPSPEED.get(path, set()) | set(OUTSIDE_THE_ADAPTER.get(path, {}))
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            # the attribute being set (``a.b = x``, each of ``a.b, c.d = ...``), not one read on the way
            # (``opt.state[p] = x`` writes into a dict)
            for sub in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
                if not isinstance(sub, ast.Attribute) or ast.unparse(sub) in allowed:
                    continue
                private = sub.attr.startswith("_") and not sub.attr.startswith("__")
                own = isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
                if (private and not own) or (not own and _is_deepspeed(sub.value, ds_names)):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(sub)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            obj, name = [*node.args, None, None][:2]
            private = isinstance(name, ast.Constant) and str(name.value).startswith("_")
            if obj is not None and (private or _is_deepspeed(obj, ds_names)):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_deepspeed_internals_are_written_outside_the_adapter() -> None:
    found = []
    for file in sorted((REPO / "megatron").rglob("*.py")):
        rel = file.relative_to(REPO).as_posix()
        if rel != ADAPTER:
            found += violations(file.read_text(), rel)
    assert not found, "DeepSpeed internals written outside " + ADAPTER + ":\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_write() -> None:
    samples = {
        "engine._take_model_step = wrapped": 1,
        "self.engine._global_grad_norm = norm": 1,
        "engine.skipped_steps += 1": 1,
        "engine.enable_backward_allreduce = False": 1,
        "setattr(engine, '_step_applied', False)": 1,
        "setattr(model_engine, name, value)": 1,
        "from deepspeed.runtime.zero.stage3 import Stage3 as S\nS._create = f": 1,
        "from deepspeed.accelerator import get_accelerator\ntype(get_accelerator()).is_fp16_supported = f": 1,
        "import deepspeed\ndeepspeed.runtime.engine.X = 1": 1,
        "a._x, engine.y = 1, 2": 2,
        "get_accelerator().x = f": 1,
        "self.engine.optimizer.overflow = True": 1,
        "layer.weight = w\nself._cache = {}\nstep.train = t\nlr_scheduler.optimizer = opt\nopt.optimizer.state[p] = {}": 0,
        "step.optimizer_step.stop_flag = f": 0,
        "import deepspeed.comm.torch as t\nt.build_shm_op = f": 1,
        "import deepspeed\ndeepspeed.comm.torch.build_shm_op = f": 1,
        "import importlib\nm = importlib.import_module('deepspeed.comm.torch')\nm.build_shm_op = f": 1,
        "import importlib\nm: Any = importlib.import_module('deepspeed.comm.torch')\nsetattr(m, 'build_shm_op', f)": 1,
        "import importlib\nimportlib.import_module('deepspeed.comm.torch').build_shm_op = f": 1,
        "import sys\nsys.modules['deepspeed.comm.torch'].build_shm_op = f": 1,
        "import importlib\nm = importlib.import_module('json')\nm.x = f": 0,
    }
    for source, count in samples.items():
        assert len(violations(source)) == count, (source, violations(source))


def test_each_listed_write_still_happens() -> None:
    for path, targets in OUTSIDE_THE_ADAPTER.items():
        tree = ast.parse((REPO / path).read_text())
        written = {ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets}
        assert set(targets) <= written, f"{path}: gone, remove from OUTSIDE_THE_ADAPTER: {set(targets) - written}"


def zero_internals_read(source: str) -> set[str]:
    """The ``ZERO_INTERNALS`` names ``source`` reads: as attributes or as strings (``getattr(opt, "x")``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ZERO_INTERNALS:
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and node.value in ZERO_INTERNALS:
            found.add(str(node.value))
    return found


def test_zero_internals_are_read_only_where_listed() -> None:
    readers = {}
    for file in sorted((REPO / "megatron").rglob("*.py")):
        rel = file.relative_to(REPO).as_posix()
        names = zero_internals_read(file.read_text())
        if names:
            readers[rel] = names
    outside = {rel: sorted(names) for rel, names in readers.items() if rel not in ZERO_READERS}
    assert not outside, f"DeepSpeed optimizer internals read outside {sorted(ZERO_READERS)}: {outside}"
    assert set(ZERO_READERS) <= set(readers), f"remove from ZERO_READERS: {set(ZERO_READERS) - set(readers)}"
    assert zero_internals_read("opt.averaged_gradients\ngetattr(lp, '_hp_mapping')\nx.grad") == {
        "averaged_gradients",
        "_hp_mapping",
    }
