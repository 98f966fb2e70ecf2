"""Options models of every component this plugin registers (validated when a run selects one).

Pydantic only: importing this module imports neither torch nor diffusers, so listing plugins and
validating a run config stay cheap.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DiffusionOptions(BaseModel):
    """Options of the ``diffusion`` modality: the policy network, its noise schedule and the
    stochastic sampler whose per-step log-probabilities are trained on."""

    model_config = ConfigDict(extra="forbid")

    sample_size: int = Field(8, ge=4, le=512, description="image height and width in pixels")
    channels: int = Field(3, ge=1, le=4, description="image channels (3 = RGB)")
    block_out_channels: tuple[int, ...] = Field(
        (16, 32), min_length=1, max_length=4, description="UNet channels per resolution level"
    )
    layers_per_block: int = Field(1, ge=1, le=4)
    norm_num_groups: int = Field(8, ge=1, description="GroupNorm groups; divides every width")
    num_classes: int = Field(
        4,
        ge=0,
        description="number of prompt classes the UNet is conditioned on (0 = unconditional)",
    )
    num_train_timesteps: int = Field(1000, ge=10)
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "linear"
    timestep_spacing: Literal["trailing", "leading", "linspace"] = Field(
        "trailing",
        description="how the inference steps are spread over the training timesteps; "
        "'trailing' starts at the last (pure-noise) timestep",
    )
    num_inference_steps: int = Field(10, ge=1, le=1000, description="denoising steps K")
    eta: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="DDIM stochasticity; must be > 0 so every step is a Gaussian with a "
        "log-probability (eta = 1 is DDPM-like ancestral sampling)",
    )
    guidance_scale: float = Field(
        1.0, ge=1.0, description="classifier-free guidance scale; 1 disables guidance"
    )
    clip_sample: bool = Field(False, description="clip the predicted clean image to [-1, 1]")
    logprob_reduction: Literal["mean", "sum"] = Field(
        "mean",
        description="'sum': the exact log-density of a step; 'mean': per image dimension "
        "(as DDPO / Flow-GRPO do), which keeps importance ratios in a range where PPO "
        "clipping is meaningful",
    )
    dtype: Literal["float32", "float64"] = "float32"
    init_seed: int = Field(0, description="seed of the random initialisation of the UNet")

    @model_validator(mode="after")
    def _consistent(self) -> DiffusionOptions:
        levels = len(self.block_out_channels)
        if self.sample_size % (2 ** (levels - 1)):
            raise ValueError(
                f"sample_size {self.sample_size} must be divisible by {2 ** (levels - 1)} "
                f"(the UNet halves it {levels - 1} times)"
            )
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(
                f"block_out_channels {bad} are not divisible by norm_num_groups "
                f"{self.norm_num_groups}"
            )
        if self.num_inference_steps > self.num_train_timesteps:
            raise ValueError(
                f"num_inference_steps {self.num_inference_steps} exceeds num_train_timesteps "
                f"{self.num_train_timesteps}"
            )
        if self.guidance_scale > 1.0 and self.num_classes == 0:
            raise ValueError("guidance_scale > 1 needs a class-conditioned UNet (num_classes > 0)")
        return self


class DiffusionSampleOptions(BaseModel):
    """Options of the ``diffusion_sample`` rollout function."""

    model_config = ConfigDict(extra="forbid")

    label_key: str = Field(
        "label", description="prompt-record field holding the integer class of the prompt"
    )
    seed_key: str = Field(
        "seed", description="prompt-record field holding the sampling seed, if any"
    )
    base_seed: int = Field(
        0, description="first seed used for prompt records without one; incremented per group"
    )


class BrightnessOptions(BaseModel):
    """Options of ``image_brightness``."""

    model_config = ConfigDict(extra="forbid")

    target: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="None: reward = mean brightness in [0, 1]; a value: reward = "
        "-|mean brightness - target|",
    )


class ColourTargetOptions(BaseModel):
    """Options of ``image_colour_target``."""

    model_config = ConfigDict(extra="forbid")

    rgb: tuple[float, float, float] = Field(
        (1.0, 0.0, 0.0), description="target colour, each channel in [0, 1]"
    )

    @model_validator(mode="after")
    def _in_range(self) -> ColourTargetOptions:
        if any(not 0.0 <= c <= 1.0 for c in self.rgb):
            raise ValueError(f"rgb {self.rgb} must have every channel in [0, 1]")
        return self


class JpegCompressibilityOptions(BaseModel):
    """Options of ``jpeg_compressibility``."""

    model_config = ConfigDict(extra="forbid")

    quality: int = Field(95, ge=1, le=100, description="JPEG quality used to encode")
    upscale: int = Field(
        1, ge=1, le=64, description="nearest-neighbour upscaling factor before encoding"
    )


class StepGRPOOptions(BaseModel):
    """Options of the ``diffusion_grpo`` algorithm (GRPO over denoising steps)."""

    model_config = ConfigDict(extra="forbid")

    clip_range: float = Field(1e-3, gt=0.0, description="PPO clip of the per-step importance ratio")
    adv_clip_max: float = Field(5.0, gt=0.0, description="clip advantages to +-this")
    adv_eps: float = Field(1e-4, gt=0.0, description="added to a group's reward std")
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="weight of the per-step KL to the reference (the starting) policy; > 0 "
        "makes the trainer compute the reference's step log-probs",
    )


class DiffusionGRPOOptions(StepGRPOOptions):
    """Options of the step-wise GRPO trainer used outside the loop (DDPO / Flow-GRPO style)."""

    learning_rate: float = Field(3e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    num_inner_epochs: int = Field(1, ge=1, description="optimiser passes over one rollout")
    max_grad_norm: float = Field(1.0, gt=0.0)


class DiffusionTrainerOptions(BaseModel):
    """Options of the ``diffusion`` trainer backend (the UNet of ``model.path``, trained in
    the run's process)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(3e-4, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0.0, description="clip the gradient norm to this")
    num_inner_epochs: int = Field(1, ge=1, description="optimiser passes over one step's groups")
    num_threads: int | None = Field(None, ge=1, description="torch threads of the trainer")
    seed: int = Field(0, description="seed of the trainer's RNG")
    lora_rank: int | None = Field(
        None,
        ge=1,
        description="train LoRA adapters of this rank on the UNet (peft) instead of every "
        "weight; the engines receive the merged weights",
    )
    lora_alpha: float = Field(16.0, gt=0.0, description="LoRA scale numerator (scale = alpha/r)")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["conv1", "conv2", "time_emb_proj", "to_q", "to_k", "to_v"],
        min_length=1,
        description="names (suffixes) of the UNet's convolutions and linears that get adapters",
    )


class DigitClassifierOptions(BaseModel):
    """Options of the ``digit_classifier`` reward."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ...,
        min_length=1,
        description="the classifier folder (config.json + model.safetensors), e.g. "
        "MODEL/classifier as written by `miles-diffusion pretrain-digits`; '~' is expanded",
    )
    label_key: str = Field("label", description="prompt-record field holding the prompted digit")


class DigitPromptsOptions(BaseModel):
    """Options of the ``digit_prompts`` data source."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(1000, ge=1, description="records per epoch")
    seed: int = Field(
        0, description="seed of the records' order and sampling seeds (another seed for held-out)"
    )
    classes: tuple[int, ...] = Field(
        tuple(range(10)), min_length=1, description="the digits prompted, each equally often"
    )
    epochs: int | None = Field(None, ge=1, description="None = cycle forever")

    @model_validator(mode="after")
    def _valid_classes(self) -> DigitPromptsOptions:
        if any(c < 0 for c in self.classes):
            raise ValueError(f"classes {list(self.classes)} must be non-negative class ids")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes {list(self.classes)} repeat a class")
        return self
