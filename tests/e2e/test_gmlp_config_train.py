"""GPT-NeoX's ``gmlp_small.yml`` (12 gMLP layers, pipe engine with one stage, fp16, activation checkpointing, no
position embedding, untied output) trains on the CPU when only its size, data and iterations shrink and its
``eps: 1.0e_8`` typo (a string for YAML, refused at load: tests/unit/test_neox_args_configs.py) is corrected; the
checkpoint it saves holds GPT-NeoX's gMLP tensor names in GPT-NeoX's layer files and resumes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from tests.distributed.fns_train import make_tiny_data, run_pretrain_many
from tests.e2e.shrink import load_raw, shrink
from tests.harness import run_distributed
from tests.shared_files import SHARED

pytestmark = pytest.mark.distributed

GMLP_SMALL = SHARED / "reference" / "gpt-neox-configs" / "gmlp_small.yml"


def _gpt2_files(root: Path, hf_tokenizer: str) -> dict[str, str]:
    """GPT-2-format vocab.json / merges.txt of the tiny data's BPE (gmlp_small keeps its GPT2BPETokenizer)."""
    model = json.loads(Path(hf_tokenizer).read_text())["model"]
    (root / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return {"gpt2_vocab": str(root / "vocab.json"), "gpt2_merges": str(root / "merges.txt")}


@pytest.mark.skipif(not GMLP_SMALL.is_file(), reason="needs shared/reference/gpt-neox-configs")
def test_gmlp_small_trains_shrunk_and_resumes(tmp_path: Path) -> None:
    raw = load_raw([GMLP_SMALL])
    assert raw["optimizer"]["params"]["eps"] == "1.0e_8"
    fixed = copy.deepcopy(raw)
    fixed["optimizer"]["params"]["eps"] = 1.0e-8
    assert {k for k in raw if raw[k] != fixed[k]} == {"optimizer"}

    data = make_tiny_data(tmp_path / "data")
    files = {
        "data_path": data["data_path"],
        "hf_tokenizer": data["vocab_file"],
        "spm_model": "unused: gmlp_small uses GPT2BPETokenizer",
        **_gpt2_files(tmp_path, data["vocab_file"]),
    }
    cfg, world = shrink(fixed, files, tmp_path)
    assert world == 1 and cfg["attention_config"] == [[["gmlp"], 1]] * 2 and cfg["gmlp_attn_dim"] == 64
    assert cfg["pipe_parallel_size"] == 1 and cfg["fp16"]["enabled"] and cfg["checkpoint_activations"]
    save = tmp_path / "checkpoints"
    first = {
        **cfg,
        "train_iters": 2,
        "lr_decay_iters": 3,
        "eval_interval": 2,
        "checkpoint_factor": 2,
        "save": str(save),
    }
    resumed = {**first, "train_iters": 3, "eval_interval": 3, "load": str(save)}
    [[one, two]] = run_distributed(
        run_pretrain_many, world, [first, resumed], {"NEOX_FORGE_ALLOW_CPU_FP16": "1"}, timeout=600
    )
    assert one["iteration"] == 2 and len(one["train_losses"]) == 2
    assert all(math.isfinite(x) for x in one["train_losses"]) and one["skipped_iters"] < 2
    assert two["start_iteration"] == 2 and two["iteration"] == 3 and len(two["train_losses"]) == 1
    assert math.isfinite(two["train_losses"][0])

    # GPT-NeoX's layer files: layer 2 and 3 are the gMLP blocks, with its tensor names
    layer = torch.load(save / "global_step2" / "layer_02-model_00-model_states.pt", weights_only=True)
    assert set(layer) == {
        f"{m}.{p}"
        for m in ("norm", "input_linear", "sgu.norm", "sgu.proj", "output_linear")
        for p in ("weight", "bias")
    }
    assert tuple(layer["sgu.proj.weight"].shape) == (cfg["seq_length"],) * 2
    assert tuple(layer["input_linear.weight"].shape) == (8 * cfg["hidden_size"], cfg["hidden_size"])
    assert torch.count_nonzero(layer["sgu.proj.weight"].triu(1)) == 0 < torch.count_nonzero(layer["sgu.proj.weight"])
