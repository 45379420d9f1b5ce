"""Safe loading: a crafted pickle in a checkpoint is not executed by training, generation or any checkpoint tool;
``latest`` tags and HF index ``weight_map`` entries cannot point outside their folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from megatron.checkpoint import CheckpointError, cli, read_checkpoint, resolve_checkpoint_dir
from megatron.checkpoint.hf_io import read_hf_weights
from megatron.checkpoint.manifest import MANIFEST, write_manifest
from megatron.checkpoint.safe_load import TRUST_ENV, UnsafeCheckpointError, safe_torch_load
from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import DistributedTestError, load_tool, run_distributed

pytestmark = pytest.mark.distributed


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _tool(name: str) -> ModuleType:
    return load_tool(f"tools/ckpts/{name}.py")


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real trained checkpoint whose engine-state file also holds the payload."""
    root = tmp_path_factory.mktemp("safe")
    data = make_tiny_data(root / "data")
    config = tiny_config(data, train_iters=2, checkpoint_factor=2, eval_iters=0, save=str(root / "ck"))
    run_distributed(run_pretrain, 1, config, timeout=300)
    path = root / "ck" / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own fresh file (test setup)
    marker = root / "pwned"
    state["innocent_looking"] = Payload(marker)
    torch.save(state, path)
    manifest = json.loads((path.parent / MANIFEST).read_text())  # an attacker can rewrite the manifest as well
    write_manifest(path.parent, **{k: v for k, v in manifest.items() if k not in ("files", "format")})
    return {"root": root, "ckpt": root / "ck", "file": path, "marker": marker, "data": data}  # type: ignore[dict-item]


def test_no_tool_executes_the_payload(poisoned: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, marker = poisoned["ckpt"], poisoned["marker"]
    with pytest.raises(CheckpointError, match="allow-list"):
        read_checkpoint(ckpt)
    runs = {
        "inspect_checkpoints": [str(ckpt)],
        "convert_neox_to_hf": ["--input_dir", str(ckpt), "--output_dir", str(tmp_path / "hf")],
        "reshard_checkpoint": [
            "--input_dir",
            str(ckpt),
            "--output_dir",
            str(tmp_path / "re"),
            "--tp",
            "1",
            "--pp",
            "0",
        ],
    }
    for name, argv in runs.items():
        tool = _tool(name)
        assert cli.run(lambda tool=tool, argv=argv: tool.main(argv)) == 1, name
        err = capsys.readouterr().err
        assert "mp_rank_00_model_states.pt" in err and "--trust-checkpoint" in err and "Traceback" not in err, name
    assert cli.run(lambda: _tool("inspect_checkpoints").main([str(poisoned["file"])])) == 1
    assert not (tmp_path / "hf").exists() and not (tmp_path / "re").exists()  # no partial output
    assert not marker.exists()


def test_training_load_does_not_execute_the_payload(poisoned: dict) -> None:
    config = tiny_config(poisoned["data"], train_iters=3, eval_iters=0, load=str(poisoned["ckpt"]))
    with pytest.raises(DistributedTestError, match="allow-list"):
        run_distributed(run_pretrain, 1, config, timeout=300)
    assert not poisoned["marker"].exists()


def test_the_payload_is_real_and_trust_is_explicit(poisoned: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same file does run the payload once the user opts in: the refusal above is what protects."""
    monkeypatch.setenv(TRUST_ENV, "1")
    safe_torch_load(poisoned["file"])
    assert poisoned["marker"].exists()
    poisoned["marker"].unlink()


def test_latest_and_weight_map_are_confined(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    (tmp_path / "outside").mkdir()
    torch.save({"module": {}}, tmp_path / "outside" / "mp_rank_00_model_states.pt")
    root.mkdir()
    (root / "latest").write_text("../outside")
    with pytest.raises(CheckpointError, match="outside"):
        resolve_checkpoint_dir(root)
    from megatron.checkpoint import CheckpointConfig
    from megatron.checkpoint.resume import resolve_tag

    with pytest.raises(CheckpointError, match="outside"):
        resolve_tag(CheckpointConfig(load=str(root)))
    hf = tmp_path / "hf"
    hf.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"x")
    index = {"weight_map": {"a.weight": "../secret.bin"}}
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside"):
        read_hf_weights(hf)


def test_mmap_reads_keep_the_allow_list_and_accept_pre_zip_files(tmp_path: Path) -> None:
    """The memory-mapped read (pipeline layer 00's embedding shape) refuses a payload like a full read does."""
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": Payload(marker)}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError, match="allow-list"):
        safe_torch_load(tmp_path / "bad.pt", mmap=True)
    assert not marker.exists()
    torch.save({"w": torch.arange(3.0)}, tmp_path / "zip.pt")
    torch.save({"w": torch.arange(3.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("zip.pt", "old.pt"):
        assert safe_torch_load(tmp_path / name, mmap=True)["w"].tolist() == [0.0, 1.0, 2.0], name
