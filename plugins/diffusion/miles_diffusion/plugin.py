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
    Modality,
    RewardFunction,
    RolloutEngine,
    RolloutFunction,
    hookimpl,
)
from miles_diffusion.engine import DiffusionEngineConfig
from miles_diffusion.options import (
    BrightnessOptions,
    ColourTargetOptions,
    DiffusionGRPOOptions,
    DiffusionOptions,
    DiffusionSampleOptions,
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
    """Image rewards that need no downloaded model."""
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


@hookimpl
def miles_register_rollout_engines(register: Callable[[Component], None]) -> None:
    """The ``diffusion`` engine: servers sampling a model folder's UNet, with the weight
    endpoints of the embedded engine (every transport) and its memory endpoints."""
    register(
        RolloutEngine(
            name="diffusion",
            factory="miles_diffusion.engine:build",
            config=DiffusionEngineConfig,
            description="server sampling a diffusion model folder's UNet (DDIM trajectories with "
            "per-step log-probs) over SGLang-shaped endpoints; CPU",
            requires=_ON_DIFFUSION,
            devices=("cpu",),
            capabilities=frozenset(
                {
                    "update_weights_from_tensor",
                    "update_weights_from_distributed",
                    "p2p_weights",
                    "memory_occupation",
                }
            ),
        )
    )
