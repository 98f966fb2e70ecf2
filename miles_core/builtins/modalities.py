"""The text modality: token-id prompts and responses, scored as decoded text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core import hookimpl
from miles_core.components import Modality

if TYPE_CHECKING:
    from miles_core.config import RunConfig


@dataclass(frozen=True)
class TextModality:
    """Text rollouts: a sample is token ids; rewards read ``sample.metadata['response_text']``."""

    name: str = "text"


def _build(_options: None) -> TextModality:
    return TextModality()


def _check(config: RunConfig) -> str | None:
    """A diffusers folder (a pipeline's ``model_index.json``, or a ``unet/``) is not a text
    model: refused at start instead of failing in the engine's loader."""
    path = Path(config.model.path).expanduser()
    if (path / "model_index.json").is_file() or (path / "unet" / "config.json").is_file():
        return (
            f"model.path {config.model.path!r} is a diffusion model (diffusers layout); "
            "select a modality that serves it (modality: diffusion, from miles-diffusion)"
        )
    return None


@hookimpl
def miles_register_modalities(register):  # type: ignore[no-untyped-def]
    register(
        Modality(
            name="text",
            factory=_build,
            description="token-in-token-out text generation",
            default_rollout_function="single_turn",
            check=_check,
        )
    )
