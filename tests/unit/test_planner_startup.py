"""``deepy.py --plan`` start-up: building the model on the meta device to count its parameters does not import
``torch._dynamo`` (about a second of every plan; ``benchmarks/bench_planner.py --startup`` measures it).

Meta-device arithmetic, random fills and ``cat`` run Python decompositions that import ``torch._dynamo`` on first
use; the weight initialisers, the TP shard split and the rotary table skip them on meta tensors (no values to
compute), RWKV's constant mixing tables are computed on the CPU and moved. Checked in a fresh interpreter (this one
may have imported it already) over the planner-speed configs: transformer, GQA/SwiGLU (Llama 2), MoE, RWKV and
tied/shared-layer models, each planned and searched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from megatron.mpu.utils import shard_tensor
from tests.unit.test_planner_speed import CASES, ONE_T

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = ["configs/125M-dmoe.yml", "--vocab-size", "50277", "--gpus", "8"]
CHILD = """
import io, json, sys
from megatron.planner.cli import plan_main
for argv in json.loads(sys.argv[1]):
    for extra in ([], ["--search"]):
        assert plan_main(["--plan", "train.py", *argv, *extra], io.StringIO()) == 0
print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch._dynamo"))))
"""


def test_plan_and_search_do_not_import_torch_dynamo() -> None:
    cases = [ONE_T, MOE, *CASES.values()]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_meta_shard_has_the_shape_of_the_real_shard() -> None:
    # (shape, dim, world, stride, sub_sizes): plain splits, strided (fused QKV) and uneven sub-matrices (GQA)
    cases = [((8, 6), 0, 2, 1, None), ((8, 6), 1, 2, 1, None), ((12, 4), 0, 2, 3, None), ((16, 4), 0, 4, 1, (8, 4, 4))]
    for shape, dim, world, stride, sizes in cases:
        for rank in range(world):
            real = shard_tensor(torch.zeros(shape), dim, rank, world, stride=stride, sub_sizes=sizes)
            meta = shard_tensor(torch.zeros(shape, device="meta"), dim, rank, world, stride=stride, sub_sizes=sizes)
            assert meta.is_meta and meta.shape == real.shape and meta.dtype == real.dtype, (shape, dim, rank)
