"""Bad input files get one clear line naming the file, a non-zero exit, no traceback and no partial output:
truncated / non-gzip ``.gz`` and corrupt / truncated ``.zst`` in preprocessing, an unwritable ``log_dir`` in deepy."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import zstandard

import deepy
from tests.harness import REPO_ROOT, load_tool

DOCS = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(300)).encode()


def _corrupt_zst() -> bytes:
    data = bytearray(zstandard.ZstdCompressor().compress(DOCS))
    for i in range(len(data) // 2, len(data) // 2 + 32):
        data[i] ^= 0xFF
    return bytes(data)


CASES = {
    "truncated.jsonl.gz": (lambda: gzip.compress(DOCS)[:-200], "truncated"),
    "plain.jsonl.gz": (lambda: DOCS, "not a valid gzip file"),
    "corrupt.jsonl.zst": (_corrupt_zst, "corrupt zstd data"),
    "truncated.jsonl.zst": (lambda: zstandard.ZstdCompressor().compress(DOCS)[:-50], "incomplete"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_archives_fail_cleanly(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, fragment = CASES[name]
    bad = tmp_path / name
    bad.write_bytes(make())
    out = tmp_path / "out"
    out.mkdir()
    vocab = tmp_path / "vocab.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(vocab))
    argv = ["--input", str(bad), "--output-prefix", str(out / "x"), "--tokenizer-type", "HFTokenizer"]
    monkeypatch.setattr(sys, "argv", ["preprocess_data.py", *argv, "--vocab-file", str(vocab), "--workers", "1"])
    code = load_tool("tools/datasets/preprocess_data.py").cli()  # the command line's error handling
    err = capsys.readouterr().err
    assert code == 1 and str(bad) in err and fragment in err and "Traceback" not in err, err
    assert list(out.iterdir()) == []


def test_good_multi_frame_zst_still_reads(tmp_path: Path) -> None:
    from megatron.data.document_reader import read_documents

    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(compressor.compress(DOCS[:1001]) + compressor.compress(DOCS[1001:]))
    assert len(list(read_documents([str(path)], ["text"]))) == 300


def test_unwritable_log_dir_is_reported_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    tiny = str(REPO_ROOT / "configs" / "cpu" / "tiny.yml")
    argv = ["train.py", tiny, "--log_dir", str(blocker / "logs"), "--run_dir", str(tmp_path / "run"), "--dry-run"]
    assert deepy.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepy.py: error: ") and str(blocker / "logs") in err and "Traceback" not in err


def test_generate_reports_an_undecodable_prompt_file_with_its_line(tmp_path: Path) -> None:
    """``deepy.py generate.py`` reads the prompts before it loads a model, so no checkpoint is needed to see this."""
    import yaml

    from tests.distributed.fns_train import make_tiny_data, tiny_config
    from tests.harness import PYTHON, free_port, run_command

    cfg = tiny_config(make_tiny_data(tmp_path / "data"), world=1, master_port=free_port())
    cfg.pop("global_num_gpus")
    cfg["num_gpus"] = 1
    config_file = tmp_path / "gen.yml"
    config_file.write_text(yaml.safe_dump(cfg))
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"def main():\nimport os\n\xc3\x28 latin-1 junk\n")
    cmd = [PYTHON, "deepy.py", "generate.py", str(config_file), "--sample_input_file", str(prompts)]
    cmd += ["--run_dir", str(tmp_path / "run")]
    result = run_command(cmd, timeout=300, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors and f"sample_input_file {prompts}:3: invalid UTF-8" in errors[0], (
        result.stdout[-2000:] + result.stderr
    )
    assert "Traceback" not in result.stderr
