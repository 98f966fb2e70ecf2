"""Image reward functions that need no downloaded model.

``digit_classifier`` scores with a local classifier folder (one that ``miles-diffusion
pretrain-digits`` writes); the others need no model at all. Each reads the sampled image from
``sample.metadata["image"]`` (written by the ``diffusion_sample`` rollout function):
``C x H x W`` with values in ``[0, 1]``, as a torch tensor, a NumPy array or nested lists.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from miles_core.data import Sample
from miles_core.errors import MilesUserError
from miles_diffusion.options import (
    BrightnessOptions,
    ColourTargetOptions,
    DigitClassifierOptions,
    JpegCompressibilityOptions,
)

if TYPE_CHECKING:
    from miles_diffusion.classifier import DigitClassifier


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


class DigitClassifierReward:
    """The classifier's probability of the prompted digit (the prompt record's ``label``) for
    the sample's image: in ``[0, 1]``, higher for an image that looks more like that digit.

    The classifier folder is checked when the reward is built and loaded on the first call,
    once; a missing or broken folder is an error naming the ``path`` option.
    """

    def __init__(self, options: DigitClassifierOptions) -> None:
        from miles_diffusion.classifier import CONFIG_FILE, WEIGHTS_FILE

        self.options = options
        self.path = Path(options.path).expanduser()
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (self.path / f).is_file()]
        if not self.path.is_dir() or missing:
            what = "is not a folder" if not self.path.is_dir() else f"has no {' or '.join(missing)}"
            raise MilesUserError(
                f"reward digit_classifier: path {options.path!r} {what}; set path to a "
                "classifier folder (DIR/classifier of `miles-diffusion pretrain-digits --out DIR`)"
            )
        self._model: DigitClassifier | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def classifier(self) -> DigitClassifier:
        """The classifier, loaded on first use (a load error is raised again on every call)."""
        from miles_diffusion.classifier import ClassifierFolderError, load_classifier

        with self._lock:
            if self._model is None and self._error is None:
                try:
                    self._model = load_classifier(self.path)
                except ClassifierFolderError as exc:
                    self._error = f"reward digit_classifier: path {self.options.path!r}: {exc}"
            if self._model is None:
                raise MilesUserError(str(self._error))
            return self._model

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        """Score the sample's image against the prompted digit."""
        model = self.classifier()
        key = self.options.label_key
        if key not in prompt:
            raise ValueError(
                f"reward digit_classifier: the prompt record has no {key!r} field (label_key) "
                "holding the prompted digit"
            )
        label = int(prompt[key])
        cfg = model.config
        if not 0 <= label < cfg["num_classes"]:
            raise ValueError(
                f"reward digit_classifier: label {label} is not a class of the classifier "
                f"(0..{cfg['num_classes'] - 1})"
            )
        x = sample_image(sample)
        shape = (cfg["channels"], cfg["sample_size"], cfg["sample_size"])
        if tuple(x.shape) != shape:
            raise ValueError(
                f"reward digit_classifier: the image is {tuple(x.shape)}, the classifier takes "
                f"{shape}"
            )
        with torch.no_grad():
            # images are in [0, 1]; the classifier was trained on [-1, 1]
            logits = model((x.to(torch.float32) * 2.0 - 1.0)[None])
        return float(torch.softmax(logits, dim=1)[0, label])
