"""The pipeline step's loss on gloo ranks (tests/e2e/test_train_pipe.py): what ``PipeStep.train`` reports (the
loss its one decision read at DeepSpeed's optimizer step) next to what ``engine.train_batch`` returned (DeepSpeed's
own aggregate, read here by the test only), on every rank, in real ``pretrain`` runs."""

from __future__ import annotations

from typing import Any

from tests.distributed.fns_train import run_pretrain


def run_recording_pipe_losses(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run_pretrain`` for each config; each gives the losses ``PipeStep.train`` reported (``reported``), the
    values ``train_batch`` returned in the same iterations (``deepspeed``) and the run's ``train_losses``."""
    from megatron.training import step as step_mod

    original_train = step_mod.PipeStep.train
    out = []
    for config in configs:
        reported: list[float] = []
        returned: list[float] = []

        def recording_train(self: Any, data_iter: Any, _reported: list = reported, _returned: list = returned) -> Any:
            engine = self.engine
            if "train_batch" not in vars(engine):  # once per engine: record what train_batch returns
                deepspeeds = engine.train_batch

                def train_batch(data_iter: Any = None) -> Any:
                    loss = deepspeeds(data_iter=data_iter)
                    _returned.append(float(loss))
                    return loss

                engine.train_batch = train_batch
            result = original_train(self, data_iter)
            _reported.append(result.lm_loss)
            return result

        step_mod.PipeStep.train = recording_train  # type: ignore[method-assign]
        try:
            result = run_pretrain(config)
        finally:
            step_mod.PipeStep.train = original_train  # type: ignore[method-assign]
        out.append({"reported": reported, "deepspeed": returned, "train_losses": result["train_losses"]})
    return out
