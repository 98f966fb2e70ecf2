"""The ``diffusion`` modality as a run uses it: the sampler's settings every engine request
carries, and the checks of ``model.path`` against the options (no torch imported)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_diffusion.model import ModelInfo, NotADiffusionModel, read_model_info
from miles_diffusion.options import DiffusionOptions

if TYPE_CHECKING:
    from miles_core.config import RunConfig

#: the options that choose how a model is sampled (sent with every request); the others
#: describe the network, which a model folder fixes
SAMPLER_FIELDS = (
    "num_inference_steps",
    "eta",
    "guidance_scale",
    "clip_sample",
    "logprob_reduction",
    "timestep_spacing",
)

#: the options a model folder fixes, checked against its ``miles_diffusion.json``
MODEL_FIELDS = ("sample_size", "channels", "num_classes", "num_train_timesteps", "beta_schedule")


class DiffusionModality:
    """The built ``diffusion`` modality of a run: its options, and the sampler's settings."""

    name = "diffusion"

    def __init__(self, options: DiffusionOptions | None = None) -> None:
        self.options = options or DiffusionOptions()

    def sampler(self) -> dict[str, Any]:
        """The sampler's settings, as an engine request's ``sampling_params`` carries them."""
        return {k: getattr(self.options, k) for k in SAMPLER_FIELDS}


def policy_options(info: ModelInfo, sampler: dict[str, Any]) -> DiffusionOptions:
    """The options of a policy over the model ``info`` describes, sampling with ``sampler``
    (unknown or invalid settings raise ``ValueError`` naming the field)."""
    unknown = sorted(set(sampler) - set(SAMPLER_FIELDS))
    if unknown:
        raise ValueError(f"unknown sampler settings {unknown}; allowed: {list(SAMPLER_FIELDS)}")
    fields = {k: getattr(info, k) for k in MODEL_FIELDS}
    return DiffusionOptions.model_validate({**fields, **sampler})


def model_problems(options: DiffusionOptions, path: str) -> str | None:
    """Why the model folder ``path`` cannot be sampled with ``options``, or ``None``."""
    if not Path(path).expanduser().exists():
        return None  # the run's preflight names a missing model.path
    try:
        info = read_model_info(path)
    except NotADiffusionModel as exc:
        return str(exc)
    clashes = [
        f"modality.{k} is {getattr(options, k)!r} but the model's is {getattr(info, k)!r}"
        for k in MODEL_FIELDS
        if getattr(options, k) != getattr(info, k)
    ]
    if clashes:
        return (
            "the model cannot take these options: " + "; ".join(clashes) + f" (model.path {path!r})"
        )
    if options.dtype != "float32":
        return (
            f"modality.dtype {options.dtype!r}: the diffusion engine and trainer serve and "
            "train float32 (float64 is for the in-process policy of the Python API)"
        )
    return None


def check(config: RunConfig) -> str | None:
    """The modality's check at start: ``model.path`` must be a diffusion model folder whose
    images and classes are the options'."""
    if config.run.export:
        return (
            "run.export writes a Hugging Face text checkpoint; a diffusion run's checkpoints "
            "(checkpoints/step_<N>/trainer) are themselves diffusion model folders"
        )
    options = config.modality.options
    if not isinstance(options, DiffusionOptions):
        options = DiffusionOptions()
    return model_problems(options, config.model.path)


def build(options: DiffusionOptions | None) -> DiffusionModality:
    """Factory of the ``diffusion`` modality."""
    return DiffusionModality(options)
