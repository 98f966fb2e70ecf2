"""Registration of the diffusion modality and its components (entry point ``diffusion``).

Every factory is a lazy ``"module:attr"`` string: listing plugins or validating a run config
imports neither torch nor diffusers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from miles_core import (
    Algorithm,
    Component,
    DataSource,
    Modality,
    RewardFunction,
    RolloutFunction,
    hookimpl,
)
from miles_diffusion.options import (
    BrightnessOptions,
    ColourTargetOptions,
    DiffusionGRPOOptions,
    DiffusionOptions,
    DiffusionSampleOptions,
    DigitClassifierOptions,
    DigitPromptsOptions,
    JpegCompressibilityOptions,
)

if TYPE_CHECKING:
    from miles_core.config import RunConfig

#: Components that only make sense on images require the diffusion modality.
_ON_DIFFUSION = {"modality": ("diffusion",)}


@hookimpl
def miles_register_modalities(register: Callable[[Component], None]) -> None:
    """The ``diffusion`` modality; its factory builds the policy (UNet + DDIM sampler)."""
    register(
        Modality(
            name="diffusion",
            factory="miles_diffusion.policy:build_policy",
            config=DiffusionOptions,
            description="images from a diffusers UNet; each denoising step is a Gaussian action",
            default_rollout_function="diffusion_sample",
        )
    )


@hookimpl
def miles_register_rollout_functions(register: Callable[[Component], None]) -> None:
    """The ``diffusion_sample`` rollout function."""
    register(
        RolloutFunction(
            name="diffusion_sample",
            factory="miles_diffusion.rollout:DiffusionSample",
            config=DiffusionSampleOptions,
            description="a group of images of one prompt class with per-step log-probs",
            requires=_ON_DIFFUSION,
        )
    )


@hookimpl
def miles_register_reward_functions(register: Callable[[Component], None]) -> None:
    """Image rewards: three that need no model, and a digit classifier's probability."""
    register(
        RewardFunction(
            name="image_brightness",
            factory="miles_diffusion.rewards:ImageBrightness",
            config=BrightnessOptions,
            description="mean pixel value of the image (or closeness to a target)",
            requires=_ON_DIFFUSION,
        )
    )
    register(
        RewardFunction(
            name="image_colour_target",
            factory="miles_diffusion.rewards:ColourTarget",
            config=ColourTargetOptions,
            description="closeness of every pixel to a target RGB colour",
            requires=_ON_DIFFUSION,
        )
    )
    register(
        RewardFunction(
            name="jpeg_compressibility",
            factory="miles_diffusion.rewards:JpegCompressibility",
            config=JpegCompressibilityOptions,
            description="minus the JPEG size of the image in KiB (needs Pillow)",
            requires=_ON_DIFFUSION,
        )
    )
    register(
        RewardFunction(
            name="digit_classifier",
            factory="miles_diffusion.rewards:DigitClassifierReward",
            config=DigitClassifierOptions,
            description="a digit classifier's probability of the prompted digit (label)",
            requires=_ON_DIFFUSION,
        )
    )


@hookimpl
def miles_register_data_sources(register: Callable[[Component], None]) -> None:
    """Digit prompts (a class and a sampling seed per record) for the digits model."""
    register(
        DataSource(
            name="digit_prompts",
            factory="miles_diffusion.prompts:DigitPrompts",
            config=DigitPromptsOptions,
            description="records {label, seed}: each digit equally often, seeded noise per record",
            requires=_ON_DIFFUSION,
        )
    )


def _needs_groups(config: RunConfig) -> str | None:
    """Group-normalised advantages of single-sample groups are all zero: nothing to learn."""
    if config.rollout.group_size < 2:
        return (
            f"rollout.group_size is {config.rollout.group_size}; GRPO normalises rewards within "
            "a group, so it needs at least 2 samples per prompt"
        )
    return None


@hookimpl
def miles_register_algorithms(register: Callable[[Component], None]) -> None:
    """GRPO over denoising steps (DDPO / Flow-GRPO)."""
    register(
        Algorithm(
            name="diffusion_grpo",
            factory="miles_diffusion.grpo:StepGRPO",
            config=DiffusionGRPOOptions,
            description="GRPO with a PPO-clipped ratio per denoising step",
            requires=_ON_DIFFUSION,
            check=_needs_groups,
            importance_ratios=True,
        )
    )
