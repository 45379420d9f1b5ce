"""A ``manifest.json`` of the wrong structure is one line naming it (the checkpoint is skipped like a truncated one),
never a traceback, and its file names cannot leave the folder; retention deletes nothing unless the new checkpoint
passes a resume's checks on its files (manifest, finite weights and optimizer state)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.checkpoint import CheckpointConfig
from megatron.checkpoint.commit import commit, delete_old_checkpoints, partial_tag, select_checkpoint
from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.loadable import load_problem
from megatron.checkpoint.manifest import MANIFEST, write_manifest
from megatron.checkpoint.resume import resolve_tag


def _save(root: Path, step: int, *, moment: float = 0.5) -> Path:
    """A checkpoint as save_checkpoint lays it out: weights and a torch optimizer's state, manifest last, commit."""
    staged = root / partial_tag(f"global_step{step}")
    staged.mkdir(parents=True)
    optimizer = {"state": {0: {"step": torch.tensor(float(step)), "exp_avg_sq": torch.full((8, 4), moment)}}}
    state = {"module": {"sequential.0.word_embeddings.weight": torch.ones(8, 4)}, "optimizer": optimizer}
    torch.save(state, staged / "mp_rank_00_model_states.pt")
    write_manifest(staged, tag=f"global_step{step}", iteration=step)
    return commit(root, f"global_step{step}")


def _edit_manifest(directory: Path, change: Any) -> Path:
    path = directory / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return path


def _outside(tmp_path: Path) -> str:
    secret = tmp_path / "secret"
    secret.write_text("x")
    return str(secret)


CASES: dict[str, Any] = {
    "files a number": (lambda m, _: m.update(files=5), "'files' is a JSON int"),
    "files a string": (lambda m, _: m.update(files="a.pt"), "'files' is a JSON str"),
    "a manifest that is a list": (None, "it holds a JSON list"),
    "an entry that is a number": (lambda m, _: m["files"].update({"a.pt": 3}), "the entry of 'a.pt' is int"),
    "a name that is a number": (lambda m, _: m.update(files=[1]), "file name 1 is not a non-empty string"),
    "a negative size": (lambda m, _: m["files"].update({"a.pt": {"size": -1}}), "the size of 'a.pt' is -1"),
    "a huge size": (lambda m, _: m["files"].update({"a.pt": {"size": 2**70}}), "the size of 'a.pt' is 1180591"),
    "a size as text": (lambda m, _: m["files"].update({"a.pt": {"size": "10"}}), "the size of 'a.pt' is '10'"),
    "a size true": (lambda m, _: m["files"].update({"a.pt": {"size": True}}), "the size of 'a.pt' is True"),
    "a sha256 number": (
        lambda m, _: m["files"].update({"a.pt": {"size": 1, "sha256": 7}}),
        "the sha256 of 'a.pt' is 7",
    ),
    "a path up and out": (
        lambda m, _: m["files"].update({"../../secret": {"size": 1}}),
        "file name '../../secret' is not a relative path inside the checkpoint folder",
    ),
    "an absolute path": (
        lambda m, out: m["files"].update({out: {"size": 1}}),
        "file name '/",  # (the name cut to 60 characters) ... is not a relative path inside the checkpoint folder
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_manifest_is_one_line_naming_it(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    _save(root, 2)
    directory = _save(root, 4)
    change, needle = CASES[case]
    outside = _outside(tmp_path)
    if change is None:
        (directory / MANIFEST).write_text("[1, 2]")
        path = directory / MANIFEST
    else:
        path = _edit_manifest(directory, lambda m: change(m, outside))
    with pytest.raises(CheckpointError) as raised:  # the checkpoint asked for by its iteration: refused
        resolve_tag(CheckpointConfig(load=str(root), iteration=4))
    line = str(raised.value)
    assert f"{path} is not a valid checkpoint manifest: {needle}" in line and "\n" not in line, line
    with caplog.at_level(logging.WARNING):  # latest names it: the newest valid one is loaded instead
        assert resolve_tag(CheckpointConfig(load=str(root))) == "global_step2"
    assert f"skipping checkpoint {directory}: {path} is not a valid checkpoint manifest" in caplog.text


def test_manifest_entry_symlinked_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    directory = _save(root, 4)
    (directory / "extra.pt").symlink_to(_outside(tmp_path))
    _edit_manifest(directory, lambda m: m["files"].update({"extra.pt": {"size": 1}}))
    with pytest.raises(CheckpointError, match=r"lists 'extra\.pt', which resolves outside"):
        resolve_tag(CheckpointConfig(load=str(root), iteration=4))


def test_undecodable_manifest_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    directory = _save(root, 4)
    (directory / MANIFEST).write_bytes(b'{"files": {"\xff": 1}}')
    with pytest.raises(
        CheckpointError, match=r"manifest\.json is not a valid checkpoint manifest \(UnicodeDecodeError"
    ):
        resolve_tag(CheckpointConfig(load=str(root), iteration=4))


@pytest.mark.parametrize("damage", ["nan moment", "inf weight", "truncated"])
def test_retention_keeps_everything_when_the_new_checkpoint_would_not_load(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """keep_last_n_checkpoints: 1 and a new checkpoint a resume would refuse: nothing is deleted, a warning names
    the file (and the tensor); a clean new checkpoint then lets retention delete as usual."""
    for step in (2, 4):
        _save(tmp_path, step)
    new = _save(tmp_path, 6, moment=float("nan") if damage == "nan moment" else 0.5)
    states = new / "mp_rank_00_model_states.pt"
    if damage == "inf weight":
        state = torch.load(states, weights_only=False)
        state["module"]["sequential.0.word_embeddings.weight"][1, 2] = float("inf")
        torch.save(state, states)
        write_manifest(new, tag="global_step6", iteration=6)  # consistent: only the tensors tell
    elif damage == "truncated":
        states.write_bytes(states.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert delete_old_checkpoints(tmp_path, 1, new="global_step6") == []
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step2", "global_step4", "global_step6"]
    why = {
        "nan moment": f"{states}: tensor optimizer.state.0.exp_avg_sq holds 32 NaN/inf value(s) of 32",
        "inf weight": f"{states}: tensor module.sequential.0.word_embeddings.weight holds 1 NaN/inf value(s) of 32",
        "truncated": f"{states} has 100 bytes, the manifest records",
    }[damage]
    assert f"removing no checkpoint, since the new one {new} would not load: {why}" in caplog.text, caplog.text
    if damage == "truncated":
        assert select_checkpoint(tmp_path) == "global_step4"  # what a resume would pick meanwhile

    _save(tmp_path, 8)
    assert load_problem(tmp_path / "global_step8") is None
    deleted = delete_old_checkpoints(tmp_path, 1, new="global_step8")
    assert sorted(p.name for p in deleted) == ["global_step2", "global_step4", "global_step6"]
