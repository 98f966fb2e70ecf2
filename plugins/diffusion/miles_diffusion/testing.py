"""Helpers for tests and benchmarks: a tiny diffusion model folder built from a random UNet
(no download, no training), in the format of :mod:`miles_diffusion.model`."""

from __future__ import annotations

from pathlib import Path

from miles_diffusion.model import ModelInfo, write_model_info
from miles_diffusion.options import DiffusionOptions


def tiny_options(**overrides: object) -> DiffusionOptions:
    """Options of a tiny class-conditioned model: 8x8, one channel, 4 classes, 4 steps."""
    base: dict[str, object] = {
        "sample_size": 8,
        "channels": 1,
        "num_classes": 4,
        "block_out_channels": (8, 16),
        "norm_num_groups": 4,
        "num_inference_steps": 4,
    }
    base.update(overrides)
    return DiffusionOptions.model_validate(base)


def write_tiny_model(path: str | Path, options: DiffusionOptions | None = None) -> Path:
    """A diffusion model folder at ``path`` holding a randomly initialised UNet of ``options``
    (default :func:`tiny_options`); returns the folder."""
    from miles_diffusion.policy import DiffusionPolicy

    opts = options or tiny_options()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    policy = DiffusionPolicy(opts)
    policy.unet.save_pretrained(str(out / "unet"))
    write_model_info(
        out,
        ModelInfo(
            sample_size=opts.sample_size,
            channels=opts.channels,
            num_classes=opts.num_classes,
            num_train_timesteps=opts.num_train_timesteps,
            beta_schedule=opts.beta_schedule,
        ),
    )
    return out
