"""Registers the ``session`` rollout function with Miles."""

from __future__ import annotations

from collections.abc import Callable

from miles_core import RolloutFunction, hookimpl
from miles_sessions.rollout import SessionRolloutOptions


@hookimpl
def miles_register_rollout_functions(register: Callable[[RolloutFunction], None]) -> None:
    """``session``: multi-turn agentic rollouts recorded by the session server."""
    register(
        RolloutFunction(
            name="session",
            factory="miles_sessions.rollout:build",
            config=SessionRolloutOptions,
            description="multi-turn agent sessions, token-in-token-out through the session server",
            requires={"modality": ["text"]},
        )
    )
