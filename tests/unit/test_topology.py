"""3D layouts (pipe outermost, data, tensor innermost), GPT-NeoX parameter names of any execution, activation
checkpointing settings, and the single-process full-weights gather."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron import mpu
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.activation_checkpointing import ActivationCheckpointConfig
from megatron.model.full_weights import gather_full_state_dict, neox_parameter_name
from megatron.neox_arguments import ConfigError, NeoXArgs, neox_namespace
from megatron.parallel_config import ParallelConfig
from tests.unit.test_neox_args import CPU1, TINY

MATRIX = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (4, 1, 1)]


@pytest.mark.parametrize("tp,pp,dp", [*MATRIX, (2, 4, 12), (2, 2, 2), (4, 2, 3)])
def test_3d_layout_rank_arithmetic(tp: int, pp: int, dp: int) -> None:
    world = tp * pp * dp
    layout = mpu.build_layout(world, tp, pp)
    assert (layout.pipe, layout.data, layout.model) == (pp, dp, tp)
    for rank in range(world):
        p, d, m = layout.coord(rank)
        assert rank == p * dp * tp + d * tp + m
    for groups, size in ((layout.model_groups(), tp), (layout.data_groups(), dp), (layout.pipe_groups(), pp)):
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        assert sorted(itertools.chain(*groups)) == list(range(world))  # every rank in exactly one group
    # TP groups are runs of consecutive ranks; pipeline neighbours are dp·tp ranks apart.
    assert all(g == list(range(g[0], g[0] + tp)) for g in layout.model_groups())
    assert all(b - a == dp * tp for g in layout.pipe_groups() for a, b in itertools.pairwise(g))
    # Inside a data-parallel group only the data coordinate changes.
    for group in layout.data_groups():
        coords = [layout.coord(r) for r in group]
        assert len({(p, m) for p, _, m in coords}) == 1 and [d for _, d, _ in coords] == list(range(dp))


def test_gpt_neox_20b_layout_io_group() -> None:
    """TP=2 × PP=4 × DP=12 (GPT-NeoX-20B): data is read by TP rank 0 of the first and last stage only."""
    layout = mpu.build_layout(96, 2, 4)
    (io,) = layout.io_groups()
    assert len(io) == 2 * 12
    assert all(layout.coord(r)[2] == 0 and layout.coord(r)[0] in (0, 3) for r in io)
    assert io[:3] == [0, 2, 4] and io[-1] == 94
    assert layout.pipe_groups()[1] == [1, 25, 49, 73]


@pytest.mark.parametrize(
    ("name", "tied", "expected"),
    [
        ("sequential.2.attention.dense.weight", None, "sequential.2.attention.dense.weight"),
        ("module.sequential.0.word_embeddings.weight", None, "sequential.0.word_embeddings.weight"),
        ("3.mlp.linear1.bias", None, "sequential.3.mlp.linear1.bias"),
        ("module.5.norm.weight", None, "sequential.5.norm.weight"),
        ("tied_modules.embed.word_embeddings.weight", {"embed": 0}, "sequential.0.word_embeddings.weight"),
    ],
)
def test_neox_parameter_names_of_every_execution(name: str, tied: dict | None, expected: str) -> None:
    assert neox_parameter_name(name, tied) == expected


def test_neox_parameter_name_rejects_foreign_names() -> None:
    with pytest.raises(ValueError, match="tied key 'embed'"):
        neox_parameter_name("tied_modules.embed.word_embeddings.weight", {})
    with pytest.raises(ValueError, match="does not belong"):
        neox_parameter_name("encoder.weight")


def test_activation_checkpoint_config() -> None:
    args = neox_namespace(
        checkpoint_activations=True,
        checkpoint_num_layers=2,
        partition_activations=True,
        contiguous_checkpointing=True,
        num_layers=5,
        pipe_parallel_size=4,
        gradient_accumulation_steps=8,
        checkpoint_in_cpu=None,  # None = default
    )
    cfg = ActivationCheckpointConfig.from_neox_args(args)
    assert cfg.partition_activations and cfg.contiguous_checkpointing and not cfg.checkpoint_in_cpu
    # ceil(5 / 2) chunks per forward, up to 4 micro-batches in flight on the first stage.
    assert cfg.num_checkpoints == 3 * 4
    assert (
        ActivationCheckpointConfig(num_layers=4, pipe_parallel_size=0, gradient_accumulation_steps=8).num_checkpoints
        == 4
    )
    with pytest.raises(ValueError, match="partition_activations"):
        ActivationCheckpointConfig(num_layers=2, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="checkpoint_num_layers"):
        ActivationCheckpointConfig(num_layers=2, checkpoint_num_layers=0)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ActivationCheckpointConfig(num_layers=2, partition_activations=True, sequence_parallel=True)


@pytest.mark.parametrize("tied", [True, False])
def test_full_state_dict_of_one_process_is_the_model(tied: bool) -> None:
    mpu.destroy_model_parallel()
    cfg = GPTModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=64,
        max_position_embeddings=2048,
        no_weight_tying=not tied,
    )
    model = build_sequential_model(cfg)
    full = gather_full_state_dict(model, cfg)
    params = dict(model.named_parameters())
    assert list(full) == sorted(params, key=lambda n: (int(n.split(".")[1]), n.split(".", 2)[2]))
    assert all(torch.equal(full[k], params[k].detach().float()) for k in params)
    assert ("sequential.6.final_linear.weight" in full) is (not tied)


def test_config_refuses_zero2_3_with_any_pipe_engine() -> None:
    """The rule lives in the config layer's table (validate.py); ParallelConfig is built from validated args."""
    for pipe in (1, 2):
        with pytest.raises(ConfigError, match="pipeline engine supports ZeRO stages 0 and 1 only"):
            NeoXArgs({**TINY, "pipe_parallel_size": pipe, "zero_optimization": {"stage": 2}}, env=CPU1)
    ok = NeoXArgs({**TINY, "pipe_parallel_size": 0, "zero_optimization": {"stage": 3}}, env=CPU1)
    assert ParallelConfig.from_neox_args(ok).zero_stage == 3  # ZeRO-3 without the pipe engine is allowed


def test_parallel_config_turns_pipe_activation_partitioning_off_for_sequence_parallel() -> None:
    base = {"train_micro_batch_size_per_gpu": 2, "pipeline": {"activation_checkpoint_interval": 0}}
    sp = ParallelConfig(model_parallel_size=2, pipe_parallel_size=2, sequence_parallel=True, zero_stage=1)
    out = sp.apply(base)
    assert out["pipeline"] == {
        "activation_checkpoint_interval": 0,
        "pipe_partitioned": False,
        "grad_partitioned": False,
    }
    assert "pipe_partitioned" not in base["pipeline"]  # the input is not modified
    plain = ParallelConfig(model_parallel_size=2, pipe_parallel_size=2).apply(base)
    assert plain["pipeline"]["pipe_partitioned"] is True and plain["pipeline"]["grad_partitioned"] is True
    with pytest.raises(ValueError, match=r"pipeline\.pipe_partitioned"):
        sp.apply({"pipeline": {"pipe_partitioned": True}})


def test_configure_activation_checkpointing_needs_torch_distributed() -> None:
    import torch.distributed as dist

    from megatron.model.activation_checkpointing import configure_activation_checkpointing

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    assert (
        configure_activation_checkpointing(ActivationCheckpointConfig(num_layers=2, partition_activations=True))
        is False
    )
