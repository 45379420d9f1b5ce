"""Fuzz test of the YAML/CLI config loader through the entry the CLI uses: ``deepy.main([script, file, "--dry-run",
...])`` in-process (merge, overrides, type/range/syntax checks, cross-key validation; launches nothing).

Seeds are the repository's configs and GPT-NeoX's (``shared/reference/gpt-neox-configs``); each case mutates one
with a fixed seed: values of another type, huge/negative/non-finite numbers, unicode, deep nesting, duplicate
keys, truncation, anchors and aliases (bombs and recursion), binary garbage, hostile ``--key value`` overrides. The
outcome must be success (0) or the project's config error (status 2, ``deepy.py: error: ...``, no traceback, no
line longer than ``MAX_LINE``), within ``CASE_SECONDS``, with every input file unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import signal
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml

import deepy
from tests import shared_files

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "train.py")
REFERENCE = shared_files.SHARED / "reference" / "gpt-neox-configs"
CASES = 400
CASE_SECONDS = 10
MAX_LINE = 2000  # a hostile value is shown shortened, never in full
HOSTILE_NUMBERS: list[Any] = [0, -1, -(2**63), 2**63, 2**64 + 1, 10**400, 1e308, -1e308, float("nan"), float("inf"),
                              float("-inf"), -0.0, 1e-320, 0.5, True, False]  # fmt: skip
HOSTILE_TEXT = ["", " ", "\u202e\u0645\u0631\u062d\u0628\u0627", "\U0001f600" * 50, "a\u0000b", "\ufeffkey", "~",
                "null", "NaN", ".inf", "0x10", "1_000", "1e999", "-", "..", "/", "${HOME}", "%s%n", "x" * 100_000,
                "\ud7ff\ue000\uffff", "line\nbreak", "'quote", "{a: [b", "&a", "*a", "!!python/object:os.system",
                "nan,1,1", "1e400,1,0", "type:(", "host:99999999999999999999"]  # fmt: skip
HOSTILE_FLAGS = [
    ["--train_iters", "1e999"], ["--hidden_size", "-1"], ["--lr", "nan"], ["--seq_length", "9" * 400],
    ["--train_iters", "0x10"], ["--num_layers", "[1, 2]"], ["--optimizer", '{"type": 5}'], ["--hidden_size"],
    ["--unknown_key_\u00e9", "1"], ["--extra_save_iters", "[0, &a]"], ["--attention_config", "[" * 3000],
    ["--zero_optimization", "{stage: 99}"], ["--seed", "-5"], ["--log_dir", "/proc/forbidden/x"],
    ["--train_micro_batch_size_per_gpu", "\U0001f600"], ["--precision", "fp8"], ["--iteration", "abc"],
    ["--tokenizer_type", ""], ["--split", "1,2,3,4"], ["--data_path", "\x00"], ["--lr", "1e-400"],
    ["--weight_decay", ".inf"], ["--", "--x"], ["--train_iters=5"], ["--checkpoint_factor", "[]"],
    ["--deepspeed_extra_args", "{a: &a [*a, *a]}"], ["--num_gpus", "99999999999999999999"],
]  # fmt: skip


def _seeds() -> list[Path]:
    files = sorted((REPO / "configs").rglob("*.yml")) + sorted(REFERENCE.rglob("*.yml"))
    assert len(files) >= 30, "seed configs missing"  # GPT-NeoX's join them when shared/ is there
    return files


def _nested(depth: int, rnd: random.Random) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if rnd.random() < 0.5 else {"k": value}
    return value


def _hostile_value(rnd: random.Random, old: Any) -> Any:
    pick = rnd.randrange(8)
    if pick == 0:
        return rnd.choice(HOSTILE_NUMBERS)
    if pick == 1:
        return rnd.choice(HOSTILE_TEXT)
    if pick == 2:
        return _nested(rnd.choice([3, 30, 200, 2000]), rnd)
    if pick == 3:
        return [old] * rnd.choice([0, 2, 10_000]) if rnd.random() < 0.5 else {"nested": old, str(old)[:20]: [old]}
    if pick == 4:
        try:
            return str(old)  # the right value in the wrong type
        except RecursionError:  # an earlier mutation nested it deeply
            return "x"
    if pick == 5:
        return None
    if pick == 6:
        return -old if isinstance(old, (int, float)) else [old, None]
    return {rnd.choice(HOSTILE_TEXT)[:50]: rnd.choice(HOSTILE_NUMBERS)}


def _dump(data: Any) -> str:
    """YAML text of ``data`` (JSON-style flow, unicode as is; Python's JSON writes NaN/Infinity, YAML reads them as
    strings; huge integers stay integers)."""
    return yaml.safe_dump(data, allow_unicode=True, default_flow_style=None, width=10**6, sort_keys=False)


def _structured(rnd: random.Random, text: str) -> str:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(data, dict) or not data:
        return text
    for _ in range(rnd.choice([1, 1, 2, 3])):
        key = rnd.choice(list(data))
        roll = rnd.random()
        if roll < 0.25 and isinstance(data[key], dict) and data[key]:  # inside a dict-valued key
            inner = data[key]
            while rnd.random() < 0.5 and any(isinstance(v, dict) and v for v in inner.values()):
                inner = rnd.choice([v for v in inner.values() if isinstance(v, dict) and v])
            name = rnd.choice(list(inner))
            inner[name] = _hostile_value(rnd, inner[name])
        elif roll < 0.7:
            data[key] = _hostile_value(rnd, data[key])
        elif roll < 0.85:
            data[rnd.choice([key.upper(), key + "_", "k\u00e9y", "", "  ", "1", "__class__"])] = data.pop(key)
        else:
            data[rnd.choice(HOSTILE_TEXT)[:50] or "x"] = _hostile_value(rnd, 1)
    try:
        return _dump(data)
    except (yaml.YAMLError, RecursionError, ValueError):
        return text


def _block(text: str) -> str:
    """The seed as block-style YAML, so that appended lines extend its mapping (most seeds are one JSON-like
    ``{...}`` flow mapping, after which any appended key is a syntax error)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return _dump(data) if isinstance(data, dict) else text


def _duplicate_key(rnd: random.Random, text: str) -> str:
    text = _block(text)
    keys = [line.split(":")[0].strip().strip('"') for line in text.splitlines() if ":" in line and line[:1].isalpha()]
    key = rnd.choice(keys) if keys else "train_iters"
    return f"{text}\n{key}: 1\n"


def _truncate(rnd: random.Random, text: str) -> str:
    return text[: rnd.randrange(len(text) + 1)]


def _yaml_features(rnd: random.Random, text: str) -> str:
    bombs = [
        "deepspeed_extra_args:\n  a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"  {n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")),
        "deepspeed_extra_args: &r [*r]\n",
        "hidden_size: *missing\n",
        "base: &b {train_iters: 5}\nmerged:\n  <<: *b\n",
        "lr: &x 0.1\nmin_lr: *x\n",
        "train_iters: !!binary aGVsbG8=\n",
        "train_iters: !!python/name:os.system\n",
        "optimizer: !!set {a, b}\n",
        "seq_length: !!timestamp 2001-12-14\n",
        "? [1, 2]\n: 3\n",
        "? {a: 1}\n: 2\n",
        "2001-12-14: 1\n",
        "~: 1\n",
    ]
    return _block(text) + rnd.choice(bombs)


def _garbage(rnd: random.Random, data: bytes) -> bytes:
    pos = rnd.randrange(len(data) + 1)
    junk = bytes(rnd.randrange(256) for _ in range(rnd.choice([1, 8, 200])))
    if rnd.random() < 0.5:
        return data[:pos] + junk + data[pos:]
    return data[:pos] + junk + data[pos + len(junk) :]


def _whole_document(rnd: random.Random, text: str) -> str:
    return rnd.choice(["", "---\n", "[1, 2]\n", "42\n", "~\n", "\ufeff" + text, text.replace("\n", "\r\n"),
                       text.replace("  ", "\t"), "---\na: 1\n---\nb: 2\n", "{" * 5000, "%YAML 9.9\n---\n" + text,
                       json.dumps(_nested(500, rnd))])  # fmt: skip


TEXT_MUTATIONS: list[Callable[[random.Random, str], str]] = [
    _structured, _structured, _structured, _duplicate_key, _truncate, _yaml_features, _whole_document,
]  # fmt: skip


def _case(rnd: random.Random, seeds: list[Path]) -> tuple[str, bytes, list[str]]:
    """(description, file bytes, extra argv) of one case."""
    seed = rnd.choice(seeds)
    text = seed.read_text(encoding="utf-8")
    flags = rnd.choice(HOSTILE_FLAGS) if rnd.random() < 0.2 else []
    if rnd.random() < 0.15:
        return f"{seed.name} + garbage bytes", _garbage(rnd, text.encode()), flags
    mutation = rnd.choice(TEXT_MUTATIONS)
    return f"{seed.name} + {mutation.__name__}", mutation(rnd, text).encode("utf-8", "surrogatepass"), flags


@contextlib.contextmanager
def _time_limit(seconds: int, what: str) -> Iterator[None]:
    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{what}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _digest(paths: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _run(argv: list[str], what: str) -> tuple[int, str]:
    """deepy's status and stderr; SystemExit (argparse) counts as its code."""
    err = io.StringIO()
    with _time_limit(CASE_SECONDS, what), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = deepy.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def _check_outcome(rc: int, err: str, what: str) -> None:
    assert rc in (0, 2), f"{what}: exit status {rc}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{what}: traceback\n{err[-3000:]}"
    if rc == 2:
        errors = [line for line in err.splitlines() if "error: " in line]
        assert errors and errors[-1].startswith(("deepy.py: error: ", "deepy.py --plan: error: ")), f"{what}: {err}"
    long = [line[:200] for line in err.splitlines() if len(line) > MAX_LINE]
    assert not long, f"{what}: a {max(map(len, err.splitlines()))}-character line: {long[0]}..."


@pytest.mark.slow  # 400 mutated configs through deepy.main: about 12 s on 2 busy cores
def test_mutated_configs_are_accepted_or_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative log_dir a mutation leaves in place lands here
    seeds = _seeds()
    before = _digest(seeds)
    rnd = random.Random(36)
    outcomes = {0: 0, 2: 0}
    for i in range(CASES):
        what, data, flags = _case(rnd, seeds)
        path = tmp_path / f"case{i}.yml"
        path.write_bytes(data)
        rc, err = _run([SCRIPT, str(path), "--dry-run", *flags], f"case {i} ({what}, flags {flags})")
        _check_outcome(rc, err, f"case {i} ({what}, flags {[f[:80] for f in flags]})")
        assert path.read_bytes() == data, f"case {i} ({what}): the config file was changed"
        outcomes[rc] += 1
    assert _digest(seeds) == before
    assert outcomes[0] > 0 and outcomes[2] > CASES // 2, outcomes  # both outcomes are reached


@pytest.mark.parametrize("flags", HOSTILE_FLAGS, ids=lambda f: " ".join(f)[:40])
def test_hostile_flags_on_a_valid_config(flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = REPO / "configs" / "cpu" / "tiny.yml"
    before = config.read_bytes()
    rc, err = _run([SCRIPT, str(config), "--dry-run", *flags], f"flags {[f[:80] for f in flags]}")
    _check_outcome(rc, err, f"flags {[f[:80] for f in flags]}")
    assert config.read_bytes() == before


def test_hostile_values_for_every_planner_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rnd = random.Random(7)
    flags = ["--gpus", "--gpus-per-node", "--peak-tflops", "--hbm-GBps", "--vocab-size", "--kv-tokens", "--top"]
    values = ["0", "-1", "nan", "inf", "1e400", "9" * 400, "", "\U0001f600", "0x10", "1_0", " 8 ", "+8"]
    for _ in range(40):
        argv = ["--plan", SCRIPT, str(REPO / "configs/cpu/tiny.yml"), "--vocab-size", "512", "--json"]
        argv += [rnd.choice(flags), rnd.choice(values)]
        rc, err = _run(argv, f"{argv[-2:]}")
        _check_outcome(rc, err, f"{argv[-2:]}")


def test_printable_keys_and_values_round_trip_through_the_loader(tmp_path: Path) -> None:
    """Sanity check of the generator itself: an unmutated seed dumped by ``_dump`` loads back unchanged."""
    seed = REPO / "configs" / "cpu" / "tiny.yml"
    data = yaml.safe_load(seed.read_text())
    assert yaml.safe_load(_dump(data)) == data
    assert all(c in string.printable for c in _dump(data))


# ---------------------------------------------------------------- what the fuzz found


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("? [1, 2]\n: 3\n", "a list cannot be a key; keys are names"),  # was a TypeError traceback
        ("deepspeed_extra_args:\n  ? {a: 1}\n  : 2\n", "a dict cannot be a key; keys are names"),
        ("split: 'nan,1,1'\n", "split='nan,1,1': needs finite non-negative parts"),  # was accepted: NaN fractions
        ("split: '1e400,1,0'\n", "split='1e400,1,0': needs finite non-negative parts"),
    ],
)
def test_fuzz_findings(text: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "found.yml"
    path.write_text(_dump(yaml.safe_load((REPO / "configs" / "cpu" / "tiny.yml").read_text())) + text)
    rc, err = _run([SCRIPT, str(path), "--dry-run"], text)
    _check_outcome(rc, err, text)
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [  # were accepted with exit 0, to fail on the ranks
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": "abc"}}},
            "optimizer.params.betas='abc' must be two numbers in [0, 1)",
        ),
        (
            {"zero_optimization": {"stage": 1, "reduce_bucket_size": "5e8"}},
            "zero_optimization.reduce_bucket_size='5e8' must be an integer >= 1",
        ),
        (
            {"deepspeed_extra_args": {"zero_optimization": {"stage": "x"}}},
            "deepspeed_extra_args.zero_optimization.stage='x' must be 0, 1, 2 or 3",
        ),
    ],
)
def test_fuzz_findings_inside_nested_blocks(
    overrides: dict[str, Any], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "found.yml"
    config = {**yaml.safe_load((REPO / "configs" / "cpu" / "tiny.yml").read_text()), **overrides}
    path.write_text(json.dumps(config))  # JSON quotes strings: "5e8" stays a string (plain YAML 5e8 is a number)
    rc, err = _run([SCRIPT, str(path), "--dry-run"], str(overrides))
    _check_outcome(rc, err, str(overrides))
    assert rc == 2 and message in err, err
