"""A name → entry table for the pluggable parts (optimizers, activations, norms, position embeddings).

Each pluggable part has one ``Registry`` next to its implementation; adding a variant is one ``register`` call
there. Looking up an unknown name raises ``ValueError`` naming the config key and every valid name, so no code
path falls through to a default. The config schema's allowed values (the ``Literal`` types of
``megatron/neox_arguments/sections``, which cannot import torch-level code) are checked against the registries by
``tests/unit/test_registries.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by lower-case name for the config key ``key`` (used in error messages)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name`` (lower-cased); a name registered twice is a programming error."""
        name = name.lower()
        if name in self._entries:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that registered a toy entry clean up with this)."""
        del self._entries[name.lower()]

    @contextmanager
    def temporarily(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered under ``name`` for the duration of the ``with`` block."""
        self.register(name, entry)
        try:
            yield entry
        finally:
            self.unregister(name)

    def get(self, name: str) -> T:
        """The entry of ``name`` (case-insensitive); unknown: ``ValueError`` listing the valid names."""
        entry = self._entries.get(str(name).lower())
        if entry is None:
            raise ValueError(self.unknown(name))
        return entry

    def unknown(self, name: object) -> str:
        """The one-line message for an unknown ``name``."""
        return f"{self.key}={name!r} is not one of {', '.join(self.names())}"

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._entries)

    def items(self) -> tuple[tuple[str, T], ...]:
        """``(name, entry)`` pairs in registration order."""
        return tuple(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._entries
