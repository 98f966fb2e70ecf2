"""Image reward functions that need no downloaded model.

Each reads the sampled image from ``sample.metadata["image"]`` (written by the
``diffusion_sample`` rollout function): ``C x H x W`` with values in ``[0, 1]``, as a torch
tensor, a NumPy array or nested lists.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from miles_core.data import Sample
from miles_diffusion.options import (
    BrightnessOptions,
    ColourTargetOptions,
    JpegCompressibilityOptions,
)


def sample_image(sample: Sample) -> Tensor:
    """The image of a diffusion sample as a float tensor ``[C, H, W]`` in ``[0, 1]``."""
    image = sample.metadata.get("image")
    if image is None:
        raise ValueError(
            "sample.metadata['image'] is missing: an image reward needs a sample produced by "
            "the diffusion modality (rollout function 'diffusion_sample')"
        )
    x = torch.as_tensor(image).detach().to(torch.float64)
    if x.ndim != 3:
        raise ValueError(f"sample.metadata['image'] has shape {tuple(x.shape)}, expected C x H x W")
    return x


class ImageBrightness:
    """Mean pixel value in ``[0, 1]``, or minus its distance to a target brightness."""

    def __init__(self, options: BrightnessOptions | None = None) -> None:
        self.options = options or BrightnessOptions()

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        """Score the sample's image."""
        mean = float(sample_image(sample).mean())
        target = self.options.target
        return mean if target is None else -abs(mean - target)


class ColourTarget:
    """``1 - mean |pixel - rgb|`` over pixels and channels: 1 for an image of exactly the
    target colour, 0 for its opposite."""

    def __init__(self, options: ColourTargetOptions | None = None) -> None:
        self.options = options or ColourTargetOptions()

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        """Score the sample's image."""
        x = sample_image(sample)
        if x.shape[0] != 3:
            raise ValueError(f"image_colour_target needs RGB images, got {x.shape[0]} channels")
        target = torch.tensor(self.options.rgb, dtype=x.dtype)[:, None, None]
        return float(1.0 - (x - target).abs().mean())


class JpegCompressibility:
    """Minus the JPEG-encoded size in kilobytes (DDPO's compressibility reward): smoother,
    simpler images score higher."""

    def __init__(self, options: JpegCompressibilityOptions | None = None) -> None:
        try:
            from PIL import Image
        except ImportError as exc:  # optional dependency: say how to get it
            raise ImportError(
                "jpeg_compressibility needs Pillow (a dependency of diffusers): pip install pillow"
            ) from exc
        self._image = Image
        self.options = options or JpegCompressibilityOptions()

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        """Score the sample's image."""
        x = sample_image(sample)
        if x.shape[0] not in (1, 3):
            raise ValueError(f"jpeg_compressibility needs 1 or 3 channels, got {x.shape[0]}")
        u = self.options.upscale
        if u > 1:
            x = x.repeat_interleave(u, dim=1).repeat_interleave(u, dim=2)
        pixels = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        # uint8 H x W x 3 is read as RGB, H x W as greyscale.
        img = self._image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0])
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=self.options.quality)
        return -buf.tell() / 1024.0
