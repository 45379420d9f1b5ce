"""Training runs with ``s3_path`` against a real S3 server on 127.0.0.1 (moto's server mode): every committed
checkpoint is uploaded byte for byte, ``load: s3://...`` resumes with a local resume's losses, and a run whose S3
server is down trains to the end with its checkpoints intact, one line per failed upload and no secret anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron.checkpoint import verify_checkpoint
from tests.distributed.fns_train import make_tiny_data, run_pretrain, run_pretrain_many, tiny_config
from tests.harness import PYTHON, free_port, run_command, run_distributed
from tests.s3_server import SECRET_KEY, FaultProxy, make_bucket, moto_s3, objects, s3_env

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


def local_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_uploads_every_checkpoint_and_resumes_from_s3(data: dict[str, str], endpoint: str, tmp_path: Path) -> None:
    client = make_bucket(endpoint, "neox-train")
    proxy = FaultProxy(endpoint).__enter__()  # relays unchanged, and records every request
    env = s3_env(proxy.endpoint, tmp_path)
    common: dict[str, Any] = {"hidden_dropout": 0.1, "checkpoint_factor": 4, "lr_decay_iters": 10}
    common["s3_cache_dir"] = str(tmp_path / "cache")
    save = tmp_path / "a" / "run1"
    cfg = tiny_config(data, world=2, train_iters=8, save=str(save), s3_path="s3://neox-train/runs", **common)
    full = run_distributed(run_pretrain, 2, cfg, env, timeout=300)
    assert full[0]["saved"] == [4, 8]
    stored = objects(client, "neox-train")
    expected = {"runs/run1/latest": b"global_step8"}
    for tag in ("global_step4", "global_step8"):
        expected.update({f"runs/run1/{tag}/{k}": v for k, v in local_files(save / tag).items()})
    assert stored == expected  # every file of both committed checkpoints, byte for byte, and latest last
    puts = [path for method, path in proxy.requests if method == "PUT"]
    assert len(puts) == len(expected) + 1  # each object once (only rank 0 uploads), latest twice

    source = "s3://neox-train/runs/run1"
    runs = run_distributed(
        run_pretrain_many,
        2,
        [
            tiny_config(data, world=2, train_iters=8, load=source, iteration=4, **common),  # global_step4
            tiny_config(data, world=2, train_iters=10, load=source, **common),  # latest: global_step8
            tiny_config(data, world=2, train_iters=10, load=str(save), **common),  # the same, from the local save
        ],
        env,
        timeout=300,
    )
    at4, from_s3, from_local = runs[0]
    assert at4["start_iteration"] == 4 and at4["train_losses"] == full[0]["train_losses"][4:]
    assert from_s3["start_iteration"] == 8 == from_local["start_iteration"]
    assert from_s3["train_losses"] == from_local["train_losses"] and len(from_s3["train_losses"]) == 2
    cached = tmp_path / "cache" / "neox-train" / "runs" / "run1"
    assert sorted(p.name for p in cached.iterdir()) == ["global_step8", "latest"]  # the cache keeps the last fetch
    assert local_files(cached / "global_step8") == local_files(save / "global_step8")
    proxy.__exit__()


def test_server_down_training_continues_with_one_line_and_no_secret(data: dict[str, str], tmp_path: Path) -> None:
    secret = f"{SECRET_KEY}-{tmp_path.name}"
    save = tmp_path / "ckpt"
    cfg = tiny_config(data, train_iters=4, checkpoint_factor=2, save=str(save), log_dir=str(tmp_path / "logs"))
    cfg.update(s3_path="s3://neox-train/runs", s3_upload_attempts=2, num_gpus=1)
    cfg.pop("global_num_gpus")
    config = tmp_path / "run.yml"
    config.write_text(yaml.safe_dump(cfg))
    env = s3_env(f"http://127.0.0.1:{free_port()}", tmp_path, secret=secret)  # nothing listens there
    result = run_command([PYTHON, "deepy.py", "train.py", str(config)], env=env, timeout=300)
    output = result.stdout + result.stderr
    failed = [line for line in output.splitlines() if "S3 upload of checkpoint" in line]
    assert len(failed) == 2, output  # one line per checkpoint
    for line, tag in zip(failed, ("global_step2", "global_step4"), strict=True):
        assert f"S3 upload of checkpoint {save / tag} to s3://neox-train/runs/ckpt/{tag} failed after" in line
        assert "training continues (the local checkpoint is intact)" in line and "Could not connect" in line
    assert "Traceback" not in output and "iteration        4/       4" in output
    for tag in ("global_step2", "global_step4"):
        assert verify_checkpoint(save / tag, checksums=True) is None
    assert (save / "latest").read_text() == "global_step4"
    # the secret key reached the ranks only through the environment: no log line, no file of the run holds it
    assert secret not in output
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaks == []
    assert list((tmp_path / "logs").glob("deepy-*"))  # the run folder was written and searched
