"""User-error types: mistakes in what the user handed us (config, data, checkpoint), reported as one line.

Entry points print a :class:`UserError` as ``error: <message>`` and exit non-zero without a traceback; any other
exception is a bug and keeps its traceback. ``ConfigError`` (config), ``CheckpointError`` (checkpoints) and
:class:`DataError` (datasets, documents, tokenizer files) derive from it; all are ``ValueError``s.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad user input; the message names the key, file or line and what would be valid."""


class DataError(UserError):
    """A dataset, document or tokenizer file that cannot be used as given."""
