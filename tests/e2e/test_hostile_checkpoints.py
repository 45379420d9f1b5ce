"""Hostile checkpoints through ``deepy.py train.py`` (load / finetune) and ``convert_neox_to_hf.py``: NaN weights
(manifest rewritten to match), another tokenizer of the same padded size, a ``global_stepN`` symlink out of the load
folder, a ``latest`` naming ``.``, an ``lr_scheduler`` entry that is not a schedule's state — each a one-line
error, exit 1, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.manifest import MANIFEST, checkpoint_files
from megatron.checkpoint.tokenizer_identity import check_tokenizer, tokenizer_identity
from megatron.tokenizer.tokenizer import HFTokenizer
from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import PYTHON, CommandResult, free_port, run_command, run_distributed
from tests.unit.test_ckpt_hf import TO_HF, _run

pytestmark = pytest.mark.distributed

POISONED = "sequential.2.attention.dense.weight"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hostile")
    data = make_tiny_data(root / "data")
    save = root / "ckpt"
    cfg = tiny_config(data, train_iters=2, save=str(save), checkpoint_factor=2, eval_interval=100)
    run_distributed(run_pretrain, 1, cfg, timeout=300)
    assert (save / "global_step2" / "mp_rank_00_model_states.pt").is_file()
    return {"data": data, "ckpt": save}


def _copy(trained: dict[str, Any], dest: Path) -> Path:
    shutil.copytree(trained["ckpt"], dest, symlinks=True)
    return dest


def _deepy(tmp_path: Path, data: dict[str, str], **overrides: Any) -> CommandResult:
    cfg = tiny_config(data, **{"train_iters": 2, "eval_interval": 100, "master_port": free_port(), **overrides})
    cfg.pop("global_num_gpus")
    cfg["num_gpus"] = 1
    config_file = tmp_path / "run.yml"
    config_file.write_text(yaml.safe_dump(cfg))
    return run_command([PYTHON, "deepy.py", "train.py", str(config_file)], timeout=300, check=False)


def _one_line_error(result: CommandResult, *needles: str) -> str:
    assert result.returncode != 0, result.describe()
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert lines and "Traceback" not in result.stderr, result.describe()
    for needle in needles:
        assert needle in lines[0], result.describe()
    return lines[0]


def _rewrite_manifest(step: Path) -> None:
    """What a writer that damaged the files would also do: record the new sizes and checksums."""
    from megatron.checkpoint.manifest import _sha256

    manifest = json.loads((step / MANIFEST).read_text())
    for path in checkpoint_files(step):
        name = str(path.relative_to(step))
        manifest["files"][name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (step / MANIFEST).write_text(json.dumps(manifest))


def test_nonfinite_weights_are_refused(trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    load = _copy(trained, tmp_path / "nan")
    step = load / "global_step2"
    state_file = step / "mp_rank_00_model_states.pt"
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    state["module"][POISONED][0, 0] = float("nan")
    torch.save(state, state_file)
    _rewrite_manifest(step)
    before = {p: p.stat().st_mtime_ns for p in load.rglob("*")}
    needle = f"{state_file}: tensor {POISONED} holds 1 NaN/inf value(s) of 4096"
    _one_line_error(_deepy(tmp_path, trained["data"], load=str(load)), needle)
    assert {p: p.stat().st_mtime_ns for p in load.rglob("*")} == before  # nothing rewritten

    out = tmp_path / "hf"
    assert _run(TO_HF, ["--input_dir", str(load), "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


@pytest.mark.parametrize("entry", ["missing", "hostile"])
def test_lr_schedule_state_missing_resumes_and_hostile_is_refused(
    trained: dict[str, Any], tmp_path: Path, entry: str
) -> None:
    """The step owns the LR schedule, so the checkpoint's ``lr_scheduler`` entry is read by neox-forge: absent (a
    converter's checkpoint) the run resumes at the checkpoint's iteration with a warning; not a schedule's state, it
    is one line naming the file and the entry, nothing written."""
    load = _copy(trained, tmp_path / entry)
    step = load / "global_step2"
    state_file = step / "mp_rank_00_model_states.pt"
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    state["lr_scheduler"] = None if entry == "missing" else {"num_iters": "2; rm -rf /"}
    torch.save(state, state_file)
    _rewrite_manifest(step)
    if entry == "missing":
        result = _deepy(tmp_path, trained["data"], load=str(load), train_iters=3)
        assert result.returncode == 0, result.describe()
        assert (
            "has no LR scheduler state: the configured schedule resumes at iteration 2" in result.stderr + result.stdout
        )
        return
    before = {p: p.stat().st_mtime_ns for p in load.rglob("*")}
    _one_line_error(_deepy(tmp_path, trained["data"], load=str(load)), str(step), "'lr_scheduler' entry", "finetune")
    assert {p: p.stat().st_mtime_ns for p in load.rglob("*")} == before


def test_another_tokenizer_is_refused_unless_allowed(trained: dict[str, Any], tmp_path: Path) -> None:
    original = Path(trained["data"]["vocab_file"])
    tok = json.loads(original.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two token ids swapped
    other = tmp_path / "other_tokenizer.json"
    other.write_text(json.dumps(tok))
    data = {**trained["data"], "vocab_file": str(other)}
    run = {"load": str(trained["ckpt"]), "finetune": True}
    line = _one_line_error(_deepy(tmp_path, data, **run), f"was saved with tokenizer HFTokenizer {original}")
    assert f"this run's is HFTokenizer {other}" in line and "load_allow_tokenizer_change: true" in line

    result = _deepy(tmp_path, data, **run, load_allow_tokenizer_change=True)
    assert result.returncode == 0 and "training finished at iteration 2" in result.stdout, result.describe()
    assert "its token ids would mean other tokens; loading anyway" in result.stdout + result.stderr

    # the same vocabulary serialised otherwise and stored elsewhere is the same tokenizer; the swapped one is not
    same = tmp_path / "same_tokenizer.json"
    same.write_text(json.dumps(json.loads(original.read_text()), indent=4))
    saved = torch.load(trained["ckpt"] / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)["args"]
    assert saved["tokenizer_vocab_size"] == 512 and saved["tokenizer_vocab_file"] == str(original)
    check_tokenizer(saved, {**saved, **tokenizer_identity(HFTokenizer(str(same)), str(same))}, "ckpt", allow=False)
    with pytest.raises(CheckpointError, match="tokenizer_vocab_sha256 differ"):
        check_tokenizer(saved, {**saved, **tokenizer_identity(HFTokenizer(str(other)), str(other))}, "c", allow=False)


def test_step_folder_symlinked_out_of_load_is_refused(trained: dict[str, Any], tmp_path: Path) -> None:
    outside = _copy(trained, tmp_path / "outside") / "global_step2"
    load = tmp_path / "load"
    load.mkdir()
    (load / "global_step2").symlink_to(outside, target_is_directory=True)  # no latest: picked by name
    _one_line_error(
        _deepy(tmp_path, trained["data"], load=str(load)),
        f"checkpoint folder {load / 'global_step2'}",
        f"is a symlink to {outside}, outside {load}",
    )


@pytest.mark.parametrize("tag", [".", "..", "global_step2/.", ""])
def test_latest_naming_no_folder_is_one_line(trained: dict[str, Any], tmp_path: Path, tag: str) -> None:
    from megatron.checkpoint import CheckpointConfig
    from megatron.checkpoint.layout import CheckpointError, resolve_checkpoint_dir
    from megatron.checkpoint.resume import resolve_tag

    load = _copy(trained, tmp_path / "dot")
    (load / "latest").write_text(tag)
    needle = f"{load / 'latest'} names {tag!r}, which is not a checkpoint folder name"
    with pytest.raises(CheckpointError, match="not a checkpoint folder name"):
        resolve_tag(CheckpointConfig(load=str(load)))
    with pytest.raises(CheckpointError, match="not a checkpoint folder name"):
        resolve_checkpoint_dir(load)
    if tag == ".":  # through the command a user runs, once
        _one_line_error(_deepy(tmp_path, trained["data"], load=str(load)), needle)
