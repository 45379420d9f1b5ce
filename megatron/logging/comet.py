"""Comet (the ``comet_ml`` package) as a metrics sink, started the way GPT-NeoX's ``initialize_comet`` starts it.

On rank 0, ``use_comet`` starts one experiment with ``comet_ml.start(workspace=comet_workspace,
project_name=comet_project)``, console capture and comet_ml's automatic logging off; the resolved config goes in as
its parameters (nested values flattened), then ``comet_experiment_name``, ``comet_tags`` and ``comet_others`` are
set, and every scalar of ``Metrics.log`` is logged at its iteration. Where the experiment goes is comet_ml's own
configuration (environment or ``~/.comet.config``): ``COMET_API_KEY`` for Comet's server, or
``COMET_START_ONLINE=false`` for an offline experiment, a zip archive under ``COMET_OFFLINE_DIRECTORY`` (comet_ml's
default: ``.cometml-runs``) that ``comet upload`` sends later. ``comet_problem()`` says, before anything is
started, why that cannot work here.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, Protocol

from megatron.neox_arguments.errors import ConfigError

REQUIREMENTS = "requirements/requirements-comet.txt"
FRAMEWORK = "gpt-neox"  # what Comet shows as the experiment's "Created from", as for GPT-NeoX's experiments


class CometKeysView(Protocol):
    """The Comet keys a sink reads (``LoggingConfig`` has them)."""

    comet_workspace: str | None
    comet_project: str | None
    comet_experiment_name: str | None
    comet_tags: list | None
    comet_others: dict | None


def comet_problem() -> str | None:
    """Why ``use_comet`` cannot start an experiment in this environment, as one line, or None.

    Reads comet_ml's own configuration (environment variables, config files) without starting anything; the API
    key's value is never part of the message."""
    try:
        from comet_ml.config import get_api_key, get_config
        from everett import ConfigurationError  # comet_ml's configuration library
    except ImportError:
        return (
            f"use_comet=True needs the comet_ml package, which this Python ({sys.executable}) lacks: "
            f"pip install -r {REQUIREMENTS}"
        )
    try:
        config = get_config()
        online = config.get_bool(None, "comet.start.online", default=None, not_set_value=None)
        if online is False or get_api_key(None, config=config):
            return None
    except ConfigurationError as e:  # a setting comet_ml cannot parse; its first line quotes the value: not shown
        named = re.search(r"^(COMET_\w+) requires", str(e), re.MULTILINE)
        setting = named.group(1) if named else "a setting (environment or .comet.config)"
        return f"use_comet=True: comet_ml cannot parse the value of {setting}; correct or unset it"
    return (
        "use_comet=True logs to Comet's server, which needs an API key: set COMET_API_KEY in the environment "
        "(or run `comet login`), or set COMET_START_ONLINE=false for an offline experiment "
        "(an archive under COMET_OFFLINE_DIRECTORY)"
    )


def check_comet(use_comet: bool | None) -> None:
    """With ``use_comet``: raise ``ConfigError`` (a ``UserError``) with ``comet_problem()``'s line, if any."""
    if use_comet:
        problem = comet_problem()
        if problem:
            raise ConfigError(problem)


class _NoLateImportAdvice(logging.Filter):
    """Drops comet_ml's advice to import it before torch: that only matters for its automatic logging, which is off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "import comet_ml before" not in str(record.msg)


class CometSink:
    """Scalars into one Comet experiment (online or offline, as comet_ml is configured)."""

    def __init__(self, cfg: CometKeysView, run_config: dict[str, Any] | None = None) -> None:
        check_comet(True)
        import comet_ml

        experiment_log = logging.getLogger("comet_ml.experiment")
        if not any(isinstance(f, _NoLateImportAdvice) for f in experiment_log.filters):
            experiment_log.addFilter(_NoLateImportAdvice())
        self.experiment = comet_ml.start(
            workspace=cfg.comet_workspace,
            project_name=cfg.comet_project,
            # output capture off (the ranks' output is teed to log_dir already), as GPT-NeoX; automatic metric and
            # parameter logging off too: comet_ml would log every TensorBoard add_scalar a second time
            experiment_config=comet_ml.ExperimentConfig(
                auto_output_logging=False, auto_metric_logging=False, auto_param_logging=False
            ),
        )
        if run_config:
            self.experiment.__internal_api__log_parameters__(
                run_config, framework=FRAMEWORK, source="manual", flatten_nested=True
            )
        if cfg.comet_experiment_name:
            self.experiment.set_name(cfg.comet_experiment_name)
        if cfg.comet_tags:
            self.experiment.add_tags(list(cfg.comet_tags))
        if cfg.comet_others:
            self.experiment.log_others(dict(cfg.comet_others))

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log each scalar at ``step``."""
        for key, value in scalars.items():
            self.experiment.__internal_api__log_metric__(key, value, framework=FRAMEWORK, step=step)

    def close(self) -> None:
        """End the experiment (an offline one writes its archive now)."""
        self.experiment.end()
