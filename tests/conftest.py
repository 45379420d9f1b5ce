"""The fast tier: every test that starts ranks, launchers, clusters or other processes gets the ``launches``
marker here, so ``pytest -m "not launches and not slow"`` (``bash scripts/test.sh --fast``) runs the rest.

A test is marked when it is marked ``distributed``, lives in ``tests/distributed/``, or when
:mod:`tests.launch_scan` finds a process-starting call in its function, its fixtures or the test-tree helpers these
use. While an unmarked test runs, :mod:`tests.process_watch` fails it if it still starts a Python interpreter or a
launcher (through the code under test), so a test cannot slip into the fast tier by hiding the start.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_scan import REPO_ROOT, LaunchScanner
from tests.process_watch import ProcessWatch

_WATCH = pytest.StashKey[ProcessWatch]()
DISTRIBUTED_DIR = REPO_ROOT / "tests" / "distributed"


def _function_chain(scanner: LaunchScanner, fn: object) -> tuple[str, ...] | None:
    fn = inspect.unwrap(fn)  # type: ignore[arg-type]
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return scanner.launch_chain(Path(code.co_filename), fn.__qualname__)  # type: ignore[attr-defined]


def launch_reason(item: pytest.Item, scanner: LaunchScanner) -> str | None:
    """Why ``item`` belongs to the ``launches`` tier, or None when it belongs to the fast tier."""
    if item.get_closest_marker("distributed"):
        return "marked distributed"
    if DISTRIBUTED_DIR in Path(item.path).parents:
        return "in tests/distributed/"
    if not isinstance(item, pytest.Function):
        return None
    chain = _function_chain(scanner, item.function)
    if chain is not None:
        return " -> ".join(chain)
    name2defs = item._fixtureinfo.name2fixturedefs  # the fixtures this test uses, transitively
    for name in item.fixturenames:
        for fixturedef in name2defs.get(name, ()):
            chain = _function_chain(scanner, fixturedef.func)
            if chain is not None:
                return f"fixture {name}: " + " -> ".join(chain)
    return None


def pytest_configure(config: pytest.Config) -> None:
    watch = ProcessWatch()
    watch.install()
    config.stash[_WATCH] = watch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the test tree, and the root of a pytest session run elsewhere (tests/unit/test_fast_tier.py's pytester runs);
    # never the repository root, whose .venv holds pytest's own fixtures
    roots = (REPO_ROOT / "tests",) if config.rootpath == REPO_ROOT else (REPO_ROOT / "tests", config.rootpath)
    scanner = LaunchScanner(roots=roots)
    for item in items:
        if item.get_closest_marker("launches"):
            continue
        reason = launch_reason(item, scanner)
        if reason is not None:
            item.add_marker(pytest.mark.launches(reason=reason))


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_launcher(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("launches"):
        yield
        return
    with request.config.stash[_WATCH].watching() as seen:
        yield
    if seen:
        pytest.fail(
            f"{request.node.nodeid} is in the fast tier but started {', '.join(sorted(set(seen)))}: "
            "mark it @pytest.mark.launches (or start it through a tests/ helper that tests/launch_scan.py "
            "recognises)",
            pytrace=False,
        )
