"""The text modality: token-id prompts and responses, scored as decoded text."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core import hookimpl
from miles_core.components import Modality


@dataclass(frozen=True)
class TextModality:
    """Text rollouts: a sample is token ids; rewards read ``sample.metadata['response_text']``."""

    name: str = "text"


def _build(_options: None) -> TextModality:
    return TextModality()


@hookimpl
def miles_register_modalities(register):  # type: ignore[no-untyped-def]
    register(
        Modality(
            name="text",
            factory=_build,
            description="token-in-token-out text generation",
            default_rollout_function="single_turn",
        )
    )
