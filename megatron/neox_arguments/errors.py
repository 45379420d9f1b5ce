"""The one error type of the config system: every problem found, reported together."""

from __future__ import annotations

from megatron.errors import UserError


class ConfigError(UserError):
    """One or more problems with the user's configuration; ``problems`` holds one readable line each."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = [f"{len(self.problems)} problems in the configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)
