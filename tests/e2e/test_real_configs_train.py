"""Every shipped config and every real GPT-NeoX model config trains 3 steps on the CPU when only its size shrinks.

``tests/e2e/shrink.py`` keeps every key except model size, sequence length, batch, parallel sizes (world ≤ 4),
iterations and file paths; so pipeline engine, ZeRO, precision (fp16 under the CPU-fp16 allowance), optimizer,
schedule, fusions, attention types, activation checkpointing and DeepSpeed's own settings (``steps_per_print``,
``wall_clock_breakdown``) are those of the real config. Configs refused as "not supported yet" are listed exactly.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from megatron.neox_arguments import NeoXArgs
from tests.distributed.fns_train import make_tiny_data, run_pretrain_each
from tests.e2e.shrink import ITERS, load_raw, shrink
from tests.harness import PYTHON, free_port, run_command, run_distributed
from tests.shared_files import SHARED, train_shakespeare_spm
from tests.unit.test_neox_args_configs import EXPECTED as REAL_EXPECTED

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
REAL = SHARED / "reference" / "gpt-neox-configs"
LLAMA_FAMILY = ("llama", "llama2", "mistral")
SETUP_NAMES = ("local_setup.yml", "text_generation.yml", "train_config.yml", "sparse.yml")  # sparse.yml: below


def model_configs() -> dict[str, list[Path]]:
    """name -> files to merge, for every shipped config and (with shared/) every real GPT-NeoX model config that
    loads; post-training configs are trained by the post-training tests. Refused ones: ``refused_real_configs``."""
    found: dict[str, list[Path]] = {}
    for p in sorted((REPO / "configs").rglob("*.yml")):
        rel = p.relative_to(REPO / "configs")
        if p.name in SETUP_NAMES or (rel.parts[0] == "cpu" and p.name != "tiny.yml" and p.name != "quickstart.yml"):
            continue
        extra = [REPO / "configs" / "llama" / "train_config.yml"] if rel.parts[0] in LLAMA_FAMILY else []
        found[f"ours/{rel}"] = [p, *extra]
    found["ours/125M.yml + sparse.yml"] = [REPO / "configs" / "125M.yml", REPO / "configs" / "sparse.yml"]
    if REAL.is_dir():
        for name, (extra, outcome) in REAL_EXPECTED.items():
            if outcome == "ok" and not name.startswith("post-training/"):
                found[f"real/{name}"] = [REAL / name, *(REAL / e for e in extra if e != "local_setup.yml")]
        found["real/125M.yml + sparse.yml"] = [REAL / "125M.yml", REAL / "sparse.yml"]  # a setup-style addition
    return found


def refused_real_configs() -> list[str]:
    """The real configs refused at load time ("not supported yet" or a key GPT-NeoX itself rejects)."""
    return sorted(n for n, (_, outcome) in REAL_EXPECTED.items() if outcome != "ok") if REAL.is_dir() else []


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("real_configs")
    data = make_tiny_data(root / "data")
    return {
        "data_path": data["data_path"],
        "hf_tokenizer": data["vocab_file"],
        **_tokenizer_files(root, data["vocab_file"]),
    }


def _tokenizer_files(root: Path, hf_tokenizer: str) -> dict[str, str]:
    """GPT-2-format vocab.json/merges.txt of the data's own 512-token BPE (GPT2BPETokenizer configs keep their
    tokenizer type; a 50k vocabulary would make the emulated-fp16 CPU steps 20x slower) and a small SentencePiece
    model (vocab ≥ the data's 512). The real GPT-2 files are tested in tests/unit/test_tokenizer.py."""
    model = json.loads(Path(hf_tokenizer).read_text())["model"]
    (root / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    spm_model = train_shakespeare_spm(root / "spm", vocab_size=600, lines=4000)
    return {
        "gpt2_vocab": str(root / "vocab.json"),
        "gpt2_merges": str(root / "merges.txt"),
        "spm_model": str(spm_model),
    }


# GPT-NeoX's own training-test variants that no shipped config covers: name -> (base config, overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "variant/sm3-fp16": (
        "125M.yml",
        {"optimizer": {"type": "sm3", "params": {"lr": 0.0006}}, "pipe_parallel_size": 0, "zero_optimization": None},
    ),
    # every block-sparse attention type of GPT-NeoX (sparse.yml itself uses local layers), 2 TP ranks
    "variant/sparse-types": (
        "125M.yml",
        {
            "attention_config": [[["sparse_fixed", "sparse_variable", "bigbird", "bslongformer"], "all"]],
            "sparsity_config": {"different_layout_per_head": True, "num_random_blocks": 1, "num_local_blocks": 2},
            "num_layers": 4,
            "model_parallel_size": 2,
        },
    ),
}


def shrunk_runs(files: dict[str, str], out_dir: Path) -> dict[int, list[tuple[list[str], dict[str, Any]]]]:
    """world -> [(config names, shrunk config)]: configs that shrink to the same dict (our copies of GPT-NeoX's
    configs, model sizes of one family) are one run."""
    runs: dict[str, tuple[list[str], dict[str, Any], int]] = {}
    named = [(name, load_raw(paths)) for name, paths in model_configs().items()]
    for name, (base, overrides) in VARIANTS.items():
        raw = {**load_raw([REPO / "configs" / base]), **overrides}
        named.append((name, {k: v for k, v in raw.items() if v is not None}))
    for name, raw in named:
        cfg, world = shrink(raw, files, out_dir)
        NeoXArgs.from_dict(cfg)  # a shrunk config that no longer validates is a bug of the shrinking
        runs.setdefault(json.dumps(cfg, sort_keys=True), ([], cfg, world))[0].append(name)
    by_world: dict[int, list[tuple[list[str], dict[str, Any]]]] = {}
    for names, cfg, world in runs.values():
        by_world.setdefault(world, []).append((names, cfg))
    return by_world


def test_every_config_trains_when_shrunk(files, tmp_path) -> None:
    configs = model_configs()
    assert len([n for n in configs if n.startswith("ours/")]) >= 30
    assert len([n for n in configs if n.startswith("real/")]) >= (35 if REAL.is_dir() else 0)
    by_world = shrunk_runs(files, tmp_path)
    assert set(by_world) <= {1, 2, 4}

    failures: dict[str, str] = {}
    trained = []
    for world, group in sorted(by_world.items()):
        results = run_distributed(
            run_pretrain_each, world, [c for _, c in group], {"NEOX_FORGE_ALLOW_CPU_FP16": "1"}, timeout=900
        )
        for (names, _), out in zip(group, results[0], strict=True):
            if isinstance(out, str):
                failures[" = ".join(names)] = out
                continue
            losses, skipped = out
            if len(losses) != ITERS or not all(math.isfinite(x) for x in losses) or skipped >= ITERS:
                failures[" = ".join(names)] = f"losses {losses}, {skipped} optimizer steps skipped"
            else:
                trained += names
    assert not failures, json.dumps(failures, indent=1)
    assert sorted(trained) == sorted([*configs, *VARIANTS])
    print(f"trained {len(trained)} configs at worlds {sorted(by_world)}; refused at load: {refused_real_configs()}")


def test_readme_command_with_only_the_size_shrunk(files, tmp_path) -> None:
    """``python deepy.py train.py configs/125M.yml configs/local_setup.yml`` (pipeline engine, fp16, ZeRO-1,
    wall_clock_breakdown, steps_per_print 10) with size, iterations and paths given on the command line."""
    run = tmp_path / "run"
    overrides = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "max_position_embeddings": 32,
        "train_micro_batch_size_per_gpu": 2,
        "train_iters": ITERS,
        "lr_decay_iters": ITERS,
        "log_interval": 1,
        "data_path": files["data_path"],
        "vocab_file": files["gpt2_vocab"],
        "merge_file": files["gpt2_merges"],
        "save": str(run / "checkpoints"),
        "load": str(run / "checkpoints"),
        "tensorboard_dir": str(run / "tensorboard"),
        "log_dir": str(run / "logs"),
        "num_gpus": 1,
        "master_port": free_port(),
    }
    argv = [f"--{k}={v}" for k, v in overrides.items()]
    res = run_command(
        [PYTHON, "deepy.py", "train.py", "configs/125M.yml", "configs/local_setup.yml", *argv],
        timeout=600,
        env={"NEOX_FORGE_ALLOW_CPU_FP16": "1"},
    )
    assert f"training finished at iteration {ITERS}" in res.stdout, res.describe()
    losses = [float(x) for x in re.findall(r"lm_loss: ([0-9.E+-]+)", res.stdout)]
    assert len(losses) >= ITERS and all(math.isfinite(x) for x in losses)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step{ITERS}"
