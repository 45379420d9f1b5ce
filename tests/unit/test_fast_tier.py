"""The fast tier's rule (tests/conftest.py): every test that starts a process is marked ``launches``, found by
reading the test code (tests/launch_scan.py) and, for what the code under test starts, at run time
(tests/process_watch.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_scan import REPO_ROOT, LaunchScanner
from tests.process_watch import ProcessWatch, is_launch_program

pytest_plugins = ["pytester"]

# tests/conftest.py's hooks and fixture, for a pytest session in a temporary folder
CONFTEST = "from tests.conftest import _fast_tier_starts_no_launcher, pytest_collection_modifyitems, pytest_configure\n"

SYNTHETIC = """
import subprocess as sp
import multiprocessing
import sys

PYTHON = sys.executable

import pytest

from tests import harness
from tests.harness import run_command as go


def _helper():
    return go(["x"])


def _indirect():
    _helper()


def test_via_helpers():
    _indirect()


def test_via_module_attribute():
    harness.run_distributed(print, 2)


def test_alias():
    sp.check_output([PYTHON, "-c", "pass"])  # not a literal: counts


def test_function_level_import():
    import subprocess

    subprocess.run([PYTHON, "-c", "pass"])


class TestMethods:
    def _start(self):
        multiprocessing.get_context("fork")

    def test_method(self):
        self._start()


def test_short_programs():
    sp.run(["git", "ls-files"])
    sp.Popen(("true",))


def test_a_shell_or_an_interpreter_by_literal():
    sp.run(["bash", "-c", "python3 train.py"])
    sp.run(["python3", "-c", "pass"])


def test_plain(monkeypatch) -> "subprocess.CompletedProcess":
    mp = monkeypatch
    mp.setenv("A", "1")
    return sp.CompletedProcess([], 0)
"""

# The helpers of tests/ that start ranks, programs or clusters: each must be recognised by the scan.
HARNESS_HELPERS = [
    ("harness.py", "run_distributed"),
    ("harness.py", "run_command"),
    ("harness.py", "run_ranks"),
    ("netns_cluster.py", "netns_cluster"),
    ("slurm_cluster.py", "single_host_slurm"),
    ("ssh_server.py", "loopback_sshd"),
]


def test_scan_follows_helpers_aliases_imports_and_methods(tmp_path: Path) -> None:
    module = tmp_path / "test_synthetic.py"
    module.write_text(SYNTHETIC)
    scanner = LaunchScanner(roots=(tmp_path, REPO_ROOT / "tests"))
    chain = scanner.launch_chain(module, "test_via_helpers")
    assert chain is not None and chain[:3] == (
        "test_synthetic.py::test_via_helpers",
        "test_synthetic.py::_indirect",
        "test_synthetic.py::_helper",
    )
    assert chain[3] == "harness.py::run_command" and chain[-1] == "subprocess.Popen"
    assert scanner.launch_chain(module, "test_via_module_attribute") is not None
    assert scanner.launch_chain(module, "test_alias") == ("test_synthetic.py::test_alias", "subprocess.check_output")
    assert scanner.launch_chain(module, "test_function_level_import") is not None
    assert scanner.launch_chain(module, "TestMethods.test_method") == (
        "test_synthetic.py::TestMethods.test_method",
        "test_synthetic.py::TestMethods._start",
        "multiprocessing.get_context",
    )
    assert scanner.launch_chain(module, "test_short_programs") is None  # git, true: no interpreter, no launcher
    assert scanner.launch_chain(module, "test_a_shell_or_an_interpreter_by_literal") is not None
    assert scanner.launch_chain(module, "test_plain") is None  # a monkeypatch named mp, a type: no process


@pytest.mark.parametrize(("module", "helper"), HARNESS_HELPERS)
def test_every_process_starting_helper_is_recognised(module: str, helper: str) -> None:
    assert LaunchScanner().launch_chain(REPO_ROOT / "tests" / module, helper) is not None


def test_fixtures_and_explicit_marks_put_a_test_in_the_launches_tier(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_tiers="""
import pytest

from tests.harness import run_command


@pytest.fixture(scope="module")
def reference_run():
    return run_command(["true"])


@pytest.fixture
def derived(reference_run):
    return reference_run


def test_through_fixtures(derived):
    pass


@pytest.mark.distributed
def test_distributed():
    pass


def test_unit():
    pass
"""
    )
    items, _ = pytester.inline_genitems()
    marks = {item.name: item.get_closest_marker("launches") for item in items}
    assert set(marks) == {"test_through_fixtures", "test_distributed", "test_unit"}
    reason = marks["test_through_fixtures"]
    assert reason is not None and reason.kwargs["reason"].startswith("fixture reference_run: ")
    assert marks["test_distributed"] is not None and marks["test_unit"] is None


def test_launch_programs() -> None:
    for program in (sys.executable, "python3", "/usr/bin/python3.11", "deepy.py", "mpirun", "srun", "pdsh", "ssh"):
        assert is_launch_program(program), program
    for program in ("git", "true", "/usr/bin/nvidia-smi"):
        assert not is_launch_program(program), program


def test_the_watch_records_interpreters_and_launchers_but_not_git() -> None:
    watch = ProcessWatch()
    watch.install()
    with watch.watching() as seen:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        subprocess.run(["sh", "-c", f"{sys.executable} -c pass"], check=True)
        subprocess.run(["git", "--version"], check=True, capture_output=True)
    assert seen == [f"subprocess.Popen: {sys.executable}"] * 2
    subprocess.run(["true"], check=True)  # outside watching(): not recorded
    assert len(seen) == 2


@pytest.mark.launches  # its inner test starts a Python interpreter
def test_an_unmarked_test_that_starts_python_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_hidden="""
from tests.process_watch import is_launch_program


def _product_code():  # stands for code under test: the scan does not read it
    import importlib

    importlib.import_module("subprocess").run([__import__("sys").executable, "-c", "pass"], check=True)


def test_hides_a_start():
    _product_code()
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_hides_a_start is in the fast tier but started subprocess.Popen*"])
