"""The errors Miles raises on purpose.

Every error a user can cause (a bad config, a broken plugin, an incompatible combination) is a
:class:`MilesUserError`; the command line prints its message as one paragraph and exits with
code 2, without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MilesUserError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""

    exit_code = 2


class PluginError(MilesUserError):
    """A plugin failed to load, registered a duplicate name, or implements an unknown hook."""


class ConfigError(MilesUserError):
    """A run config failed validation; ``problems`` holds one line per offending field."""

    def __init__(self, problems: list[str], *, source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}")


class IncompatibleError(ConfigError):
    """The selected plugins cannot run together; each problem says why and who declared it."""


class UnknownComponentError(MilesUserError):
    """A config or API call named a component that no installed plugin registers."""
