"""A small convolutional digit classifier on 8x8 images in ``[-1, 1]``, and its folder format.

The folder (``classifier/`` of a model folder written by ``miles-diffusion pretrain-digits``)
holds ``config.json`` (``{"format": "miles-digit-classifier", "sample_size", "channels",
"num_classes", "conv_channels", "hidden", ...}``) and ``model.safetensors`` (the state dict):
loading it runs no pickled code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FORMAT = "miles-digit-classifier"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ClassifierFolderError(ValueError):
    """A classifier folder is missing, incomplete or unreadable."""


class DigitClassifier(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers; logits over the classes."""

    def __init__(
        self,
        *,
        sample_size: int = 8,
        channels: int = 1,
        num_classes: int = 10,
        conv_channels: Sequence[int] = (16, 32),
        hidden: int = 64,
    ) -> None:
        super().__init__()
        if sample_size % 2:
            raise ValueError(f"sample_size {sample_size} must be even (one 2x2 max-pool)")
        self.config: dict[str, Any] = {
            "sample_size": sample_size,
            "channels": channels,
            "num_classes": num_classes,
            "conv_channels": [int(c) for c in conv_channels],
            "hidden": hidden,
        }
        layers: list[nn.Module] = []
        prev = channels
        for c in conv_channels:
            layers += [nn.Conv2d(prev, c, 3, padding=1), nn.ReLU()]
            prev = c
        flat = prev * (sample_size // 2) ** 2
        layers += [
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        ]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes]`` of images ``[B, C, H, W]`` in ``[-1, 1]``."""
        out: Tensor = self.net(x)
        return out


def save_classifier(model: DigitClassifier, path: str | Path, **extra: Any) -> Path:
    """Write ``model`` as a classifier folder at ``path`` (``extra`` goes into config.json,
    e.g. the held-out accuracy); returns the folder."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, **model.config, **extra}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    return out


def load_classifier(path: str | Path) -> DigitClassifier:
    """The classifier of the folder ``path`` in eval mode; :class:`ClassifierFolderError`
    saying what is wrong otherwise."""
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ClassifierFolderError(f"{str(path)!r} is not a folder")
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        raise ClassifierFolderError(
            f"{str(path)!r} has no {' or '.join(missing)} (a classifier folder as written by "
            "`miles-diffusion pretrain-digits`, in DIR/classifier)"
        )
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ClassifierFolderError(f"{folder / CONFIG_FILE}: cannot read it ({exc})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        got = config.get("format") if isinstance(config, dict) else None
        raise ClassifierFolderError(
            f"{folder / CONFIG_FILE}: format is {got!r}, expected {FORMAT!r}"
        )
    keys = ("sample_size", "channels", "num_classes", "conv_channels", "hidden")
    try:
        model = DigitClassifier(**{k: config[k] for k in keys if k in config})
        model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
    except Exception as exc:  # a damaged file or weights of another shape
        raise ClassifierFolderError(
            f"{str(path)!r}: cannot load the classifier ({type(exc).__name__}: {exc})"
        ) from None
    return model.eval()


def accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    """Fraction of ``images`` whose most likely class is their label."""
    with torch.no_grad():
        pred = model(images).argmax(dim=1)
    return float((pred == labels).float().mean())
