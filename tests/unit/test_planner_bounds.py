"""``deepy.py --plan``'s numeric flags are range-checked, ``--json`` is strict JSON alone on stdout, ``--search`` keeps
to its time budget, and the closed-form node placement equals counting the nodes of every group."""

from __future__ import annotations

import itertools
import json
import math
import time

import pytest

import deepy
from megatron.planner.layout import group_placements
from megatron.planner.report import finite_or_null, strict_json

TINY = ["configs/cpu/tiny.yml", "--vocab-size", "512"]


def _no_constants(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def _strict_loads(text: str) -> dict:
    return json.loads(text, parse_constant=_no_constants)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], "--gpus '0': must be an integer between 1 and 1048576"),
        (["--gpus", "-4"], "--gpus '-4': must be an integer between 1 and 1048576"),
        (["--gpus", "1e9"], "--gpus '1e9': must be an integer between 1 and 1048576"),
        (["--gpus", "1000000000"], "--gpus '1000000000': must be an integer between 1 and 1048576"),
        (["--gpus", "8.5"], "--gpus '8.5': must be an integer"),
        (["--gpus-per-node", "100000"], "--gpus-per-node '100000': must be an integer between 1 and 1024"),
        (["--peak-tflops", "inf"], "--peak-tflops 'inf': must be a finite number between 0.001 and 1000000"),
        (["--peak-tflops", "nan"], "--peak-tflops 'nan': must be a finite number"),
        (["--peak-tflops", "0"], "--peak-tflops '0': must be a finite number between 0.001"),
        (["--hbm-GBps", "-1"], "--hbm-GBps '-1': must be a finite number between 0.001 and 1000000"),
        (["--intra-node-GBps", "1e400"], "--intra-node-GBps '1e400': must be a finite number"),
        (["--inter-node-GBps", "fast"], "--inter-node-GBps 'fast': must be a finite number"),
        (["--vocab-size", "1e30"], "--vocab-size '1e30': must be an integer between 1 and 2147483647"),
        (["--vocab-size", "1" + "0" * 30], "--vocab-size '1000000000000000000000000000000': must be an integer"),
        (["--kv-batch", "0"], "--kv-batch '0': must be an integer between 1 and 1048576"),
        (["--kv-tokens", "99999999999"], "--kv-tokens '99999999999': must be an integer between 1 and 16777216"),
        (["--gpu-memory", "9" * 40 + "TB"], "expected a size between 1 byte and 1 PiB"),
        (["--gpu-memory", "0.1"], "--gpu-memory '0.1': expected a size between 1 byte and 1 PiB"),
        (["--search", "--search-seconds", "0"], "--search-seconds '0': must be a finite number between 0.01 and 86400"),
        (["--search", "--top", "-1"], "--top '-1': must be an integer between 1 and 1000000"),
    ],
)
def test_numeric_flags_out_of_range(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, *flags, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("deepy.py: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_every_bad_flag_is_listed_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, "--gpus", "0", "--peak-tflops", "inf"]) == 2
    err = capsys.readouterr().err
    assert "2 problems in the configuration" in err and "--gpus '0'" in err and "--peak-tflops 'inf'" in err


def test_config_gpu_count_is_bounded_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, "--global_num_gpus", "2000000"]) == 2
    assert "the config gives 2000000 GPUs: --gpus must be an integer between 1 and 1048576" in capsys.readouterr().err


def test_extreme_valid_flags_give_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    slow = [f"--{f}" for f in ("peak-tflops", "hbm-GBps", "intra-node-GBps", "inter-node-GBps")]
    for value in ("0.001", "1000000"):
        argv = [*TINY, "--gpus", "8", *itertools.chain(*[(f, value) for f in slow]), "--gpu-memory", "1", "--json"]
        assert deepy.main(["--plan", "train.py", *argv]) == 0
        plan = _strict_loads(capsys.readouterr().out)
        assert math.isfinite(plan["throughput"]["step_s"]) and plan["hardware"]["peak_tflops"] == float(value)


def test_non_finite_numbers_become_null() -> None:
    data = {"a": math.inf, "b": [1.5, math.nan, (-math.inf, 2)], "c": {"d": "x", "e": None}}
    assert finite_or_null(data) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": "x", "e": None}}
    assert _strict_loads(strict_json(data))["a"] is None


def test_search_stops_at_its_time_budget(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    argv = ["configs/20B.yml", "--vocab-size", "50277", "--gpus", "720720", "--search", "--search-seconds", "0.01"]
    argv += ["--top", "3"]
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    result = _strict_loads(capsys.readouterr().out)
    assert time.monotonic() - start < 30  # the full search: ~5,000 layouts, ~1 s once the model's shapes are known
    assert result["cut_short"] is True and result["search_seconds"] == 0.01
    assert result["candidates_evaluated"] < 4000 and len(result["layouts"]) <= 3
    assert deepy.main(["--plan", "train.py", *argv]) == 0
    assert "search cut short: the 0.01 s budget (--search-seconds) ran out after" in capsys.readouterr().out


def test_search_on_a_million_gpus_finishes(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    assert deepy.main(["--plan", "train.py", *TINY, "--gpus", "1048576", "--search", "--json"]) == 0
    result = _strict_loads(capsys.readouterr().out)
    assert time.monotonic() - start < 60 and result["cut_short"] is False and result["layouts_that_fit"] > 0


def _brute_force_spans(tp: int, pp: int, dp: int, gpus_per_node: int) -> list[int]:
    """Nodes spanned by the widest group of each axis, counted member by member."""
    world, out = tp * pp * dp, []
    for size, stride in ((tp, 1), (pp, dp * tp), (dp, tp)):
        firsts = [r for r in range(world) if (r // stride) % size == 0]
        out.append(max(len({(f + i * stride) // gpus_per_node for i in range(size)}) for f in firsts))
    return out


def test_group_placement_closed_form_matches_counting() -> None:
    sizes = itertools.product([1, 2, 3, 4, 8, 16], [1, 2, 3, 5, 12], [1, 2, 3, 7, 12, 24], [1, 2, 3, 4, 6, 8, 16])
    for tp, pp, dp, g in sizes:
        got = [p.nodes_spanned for p in group_placements(tp, pp, dp, g)]
        assert got == _brute_force_spans(tp, pp, dp, g), (tp, pp, dp, g)
    start = time.monotonic()
    assert [p.nodes_spanned for p in group_placements(8, 4, 2**15, 8)] == [1, 4, 2**15]
    assert time.monotonic() - start < 0.1  # a million ranks: not counted one by one
