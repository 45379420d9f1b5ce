"""``preprocess_data_with_chat_template.py``: token/label/reward streams from chat JSONL with a local HF tokenizer."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import make_dataset
from tests.post_training_data import kto_rows, make_chat_tokenizer, pair_rows, sft_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "datasets" / "preprocess_data_with_chat_template.py"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def run_tool(*args: str, subprocess_run: bool = False) -> subprocess.CompletedProcess:
    """The tool's ``main`` in this process (fast), or as a real subprocess (exit code, no traceback)."""
    if subprocess_run:
        return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=ROOT)
    spec = importlib.util.spec_from_file_location("chat_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = module.main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _decode(tok_dir: Path, ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir)).decode([int(i) for i in ids])


def test_sft_labels_cover_exactly_the_assistant_answers(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(3))
    r = run_tool("--input", str(data), "--output-prefix", str(tmp_path / "sft"), "--tokenizer-path", str(tok_dir))
    assert r.returncode == 0, r.stderr
    tokens, labels = (
        make_dataset(str(tmp_path / "sft_messages_document")),
        make_dataset(str(tmp_path / "sft_messages_label_document")),
    )
    assert len(tokens.sizes) == 3 and np.array_equal(tokens.sizes, labels.sizes)
    for i, (answer, question) in enumerate([("It is noon, my lord.", "What is the time?"), ("Peace.", "Say a word.")]):
        t, lab = tokens.get(i), labels.get(i)
        trained = lab >= 0
        assert np.array_equal(lab[trained], t[trained])  # a label is the token id where trained
        text = _decode(tok_dir, t[trained])
        assert text == f"{answer}<|endoftext|>\n"  # the answer (+ EOS and newline), not its header
        assert question not in text and "Be brief" not in text and "<|assistant|>" not in text
        assert question in _decode(tok_dir, t)


def test_pairwise_for_rm_trains_only_the_appended_eos(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(2))
    args = ["--input", str(data), "--output-prefix", str(tmp_path / "rm"), "--tokenizer-path", str(tok_dir)]
    r = run_tool(*args, "--jsonl-keys", "chosen", "rejected", "--for-rm")
    assert r.returncode == 0, r.stderr
    for key in ("chosen", "rejected"):
        t = make_dataset(str(tmp_path / f"rm_{key}_document")).get(0)
        lab = make_dataset(str(tmp_path / f"rm_{key}_label_document")).get(0)
        assert (lab >= 0).sum() == 1 and lab[-1] == t[-1] == t[-3]  # EOS, newline, duplicated EOS


def test_rewards_keep_their_float_value(tok_dir: Path, tmp_path: Path) -> None:
    rows = kto_rows(2)
    rows[1]["reward"] = -0.25
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    args = ["--input", str(data), "--output-prefix", str(tmp_path / "k"), "--tokenizer-path", str(tok_dir)]
    assert run_tool(*args, "--reward-key", "reward").returncode == 0
    rewards = make_dataset(str(tmp_path / "k_messages_reward_document"))
    tokens = make_dataset(str(tmp_path / "k_messages_document"))
    assert rewards.dtype == np.float32 and np.array_equal(rewards.sizes, tokens.sizes)
    assert set(rewards.get(0).tolist()) == {1.0} and set(rewards.get(1).tolist()) == {-0.25}
    assert run_tool(*args, "--reward-key", "reward", "--binary-reward").returncode == 0
    assert set(make_dataset(str(tmp_path / "k_messages_reward_document")).get(1).tolist()) == {-1.0}


def test_binary_reward_signs_and_a_missing_reward(tok_dir: Path, tmp_path: Path) -> None:
    """--binary-reward: > 0 or true -> 1, <= 0 or false -> -1 (GPT-NeoX makes every truthy value 1, -1 included).
    A document without the reward (GPT-NeoX: KeyError) or with null (GPT-NeoX: -1) is a one-line error."""
    rows = kto_rows(5)
    for row, reward in zip(rows, [True, False, -1, 0, 0.5], strict=True):
        row["reward"] = reward
    args = ["--output-prefix", str(tmp_path / "k"), "--tokenizer-path", str(tok_dir), "--reward-key", "reward"]
    assert run_tool("--input", str(write_jsonl(tmp_path / "kto.jsonl", rows)), *args, "--binary-reward").returncode == 0
    rewards = make_dataset(str(tmp_path / "k_messages_reward_document"))
    assert [set(rewards.get(i).tolist()) for i in range(5)] == [{1.0}, {-1.0}, {-1.0}, {-1.0}, {1.0}]
    for name, bad in (("missing", {}), ("null", {"reward": None})):
        row = {"messages": rows[0]["messages"], **bad}
        data = write_jsonl(tmp_path / f"{name}.jsonl", [rows[0], row])
        out = ["--output-prefix", str(tmp_path / name), *args[2:], "--binary-reward"]
        r = run_tool("--input", str(data), *out)
        assert r.returncode == 1 and f"{data}:2: reward key 'reward' must be a number, got None" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not list(tmp_path.glob(f"{name}_*"))


def test_only_last_and_no_mask(tok_dir: Path, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "Say a word."}, {"role": "assistant", "content": "Peace."}] * 2}]
    data = write_jsonl(tmp_path / "two.jsonl", rows)
    args = ["--input", str(data), "--tokenizer-path", str(tok_dir)]
    assert run_tool(*args, "--output-prefix", str(tmp_path / "a")).returncode == 0
    assert run_tool(*args, "--output-prefix", str(tmp_path / "b"), "--only-last").returncode == 0
    t = make_dataset(str(tmp_path / "a_messages_document")).get(0)
    all_turns = make_dataset(str(tmp_path / "a_messages_label_document")).get(0)
    last = make_dataset(str(tmp_path / "b_messages_label_document")).get(0)
    assert _decode(tok_dir, t[all_turns >= 0]) == "Peace.<|endoftext|>\n" * 2
    assert _decode(tok_dir, t[last >= 0]) == "Peace.<|endoftext|>\n"
    assert (last >= 0).sum() * 2 == (all_turns >= 0).sum()
    assert run_tool(*args, "--output-prefix", str(tmp_path / "c"), "--no-mask").returncode == 0
    assert not (tmp_path / "c_messages_label_document.bin").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "bad.jsonl:2: invalid JSON"),
        ('{"messages": "hi"}', "bad.jsonl:2: 'messages' must be a non-empty list"),
        ('{"text": "x"}', "bad.jsonl:2: no key 'messages'"),
    ],
)
def test_bad_lines_name_file_and_line_and_leave_nothing(tok_dir: Path, tmp_path: Path, line: str, message: str) -> None:
    good = write_jsonl(tmp_path / "x.jsonl", sft_rows(1)).read_text()
    (tmp_path / "bad.jsonl").write_text(good + line + "\n")
    args = ["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "o"), "--tokenizer-path"]
    r = run_tool(*args, str(tok_dir), subprocess_run=line.startswith("{not"))
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("o_*"))


def test_tokenizer_without_chat_template_is_refused(tok_dir: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    raw = tok_dir / "tokenizer.json"
    PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="<|endoftext|>").save_pretrained(str(tmp_path / "plain"))
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(1))
    r = run_tool(
        "--input", str(data), "--output-prefix", str(tmp_path / "o"), "--tokenizer-path", str(tmp_path / "plain")
    )
    assert r.returncode == 1 and "has no chat_template" in r.stderr


LOOPING_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_template_with_huge_loops_is_stopped_in_bounded_time(tok_dir: Path, tmp_path: Path, workers: str) -> None:
    """10^10 loop steps (each range is within the jinja sandbox's limit): the render is stopped after
    --render-timeout, the error names file and line, and no output (partial or final) is left."""
    import json
    import shutil

    looping = tmp_path / "looping_tok"
    shutil.copytree(tok_dir, looping)
    config_path = looping / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LOOPING_TEMPLATE
    config_path.write_text(json.dumps(config))
    (looping / "chat_template.jinja").unlink(missing_ok=True)  # newer transformers keep the template here
    (looping / "chat_template.json").unlink(missing_ok=True)
    rows = [*sft_rows(3), {"messages": [{"role": "user", "content": "spin"}]}, *sft_rows(2)]
    data = write_jsonl(tmp_path / "loop.jsonl", rows)
    args = ["--input", str(data), "--output-prefix", str(tmp_path / "o"), "--tokenizer-path", str(looping)]
    r = run_tool(*args, "--render-timeout", "1", "--workers", workers, subprocess_run=True)
    assert r.returncode == 1, r.stderr
    assert f"{data}:4: the chat template took more than 1 s to render 'messages'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("o_*"))  # neither .partial files nor outputs


def test_sigterm_during_preprocessing_leaves_no_partial_files(tok_dir: Path, tmp_path: Path) -> None:
    """A run killed by SIGTERM (e.g. `timeout`, a batch system) removes its .partial files on the way out."""
    import json
    import shutil
    import signal
    import time

    looping = tmp_path / "looping_tok"
    shutil.copytree(tok_dir, looping)
    config = json.loads((looping / "tokenizer_config.json").read_text())
    config["chat_template"] = LOOPING_TEMPLATE
    (looping / "tokenizer_config.json").write_text(json.dumps(config))
    (looping / "chat_template.jinja").unlink(missing_ok=True)
    data = write_jsonl(tmp_path / "loop.jsonl", [{"messages": [{"role": "user", "content": "spin"}]}])
    args = ["--input", str(data), "--output-prefix", str(tmp_path / "o"), "--tokenizer-path", str(looping)]
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), *args, "--render-timeout", "0"], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("o_*.partial")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob("o_*.partial")), "the tool never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert not list(tmp_path.glob("o_*"))
