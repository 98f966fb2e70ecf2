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
    RolloutEngine,
    RolloutFunction,
    TrainerBackend,
    hookimpl,
)
from miles_diffusion.engine import DiffusionEngineConfig
from miles_diffusion.modality import check as check_model
from miles_diffusion.options import (
    BrightnessOptions,
    ColourTargetOptions,
    DiffusionOptions,
    DiffusionSampleOptions,
    DiffusionTrainerOptions,
    DigitClassifierOptions,
    DigitPromptsOptions,
    JpegCompressibilityOptions,
    StepGRPOOptions,
)

if TYPE_CHECKING:
    from miles_core.config import RunConfig
    from miles_core.data import Group

#: Components that only make sense on images require the diffusion modality.
_ON_DIFFUSION = {"modality": ("diffusion",)}


@hookimpl
def miles_register_modalities(register: Callable[[Component], None]) -> None:
    """The ``diffusion`` modality: its options are the sampler's (sent with every engine
    request) and the model's image shape and classes (checked against ``model.path``)."""
    register(
        Modality(
            name="diffusion",
            factory="miles_diffusion.modality:build",
            config=DiffusionOptions,
            description="images from a diffusers UNet; each denoising step is a Gaussian action",
            default_rollout_function="diffusion_sample",
            check=check_model,
        )
    )


@hookimpl
def miles_register_trainer_backends(register: Callable[[Component], None]) -> None:
    """The ``diffusion`` trainer backend: the UNet of ``model.path``, trained in-process."""
    register(
        TrainerBackend(
            name="diffusion",
            factory="miles_diffusion.trainer:build",
            config=DiffusionTrainerOptions,
            description="trains the UNet of a diffusion model folder over denoising steps",
            requires=_ON_DIFFUSION,
            computes=frozenset({"ref_logprobs"}),
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
            config=StepGRPOOptions,
            description="GRPO with a PPO-clipped ratio per denoising step",
            requires=_ON_DIFFUSION,
            check=_needs_groups,
            importance_ratios=True,
            needs=frozenset({"ref_logprobs"}),  # with kl_coef > 0
        )
    )


#: the run directory of the diffusion run in progress in this process (sample grids go there)
_RUN: dict[str, str] = {}


@hookimpl
def miles_run_start(config: RunConfig, run_dir: str) -> None:
    """A diffusion run writes a grid of its samples at every step: remember where."""
    if config.modality.name == "diffusion":
        _RUN["dir"] = run_dir


@hookimpl
def miles_after_train_step(step: int, groups: list[Group], metrics: object) -> None:
    """``samples/step_<N>.png``: one row per group (prompt), one column per image."""
    run_dir = _RUN.get("dir")
    if run_dir is None or not groups:
        return
    from pathlib import Path

    from miles_diffusion.grids import write_group_grid

    write_group_grid(groups, Path(run_dir) / "samples" / f"step_{step:05d}.png")


@hookimpl
def miles_run_end(config: RunConfig, run_dir: str, status: str) -> None:
    """The run is over: no more grids."""
    if _RUN.get("dir") == run_dir:
        _RUN.clear()


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
