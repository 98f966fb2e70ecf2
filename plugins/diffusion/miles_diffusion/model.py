"""A diffusion model folder, as ``model.path`` names it, and loading its UNet.

The folder holds:

* ``miles_diffusion.json``: ``{"format": "miles-diffusion", "sample_size", "channels",
  "num_classes", "num_train_timesteps", "beta_schedule"}`` (what a run checks without torch);
* ``unet/``: a diffusers ``UNet2DModel`` in its own ``save_pretrained`` format (class-conditioned
  with ``num_class_embeds = num_classes + 1``: the last class id is the unconditional one);
* optionally ``classifier/``: the digit classifier the ``digit_classifier`` reward loads.

``miles-diffusion pretrain-digits`` writes such a folder (see :mod:`miles_diffusion.pretrain`).
Reading the description (:func:`read_model_info`) imports neither torch nor diffusers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: the file that marks a folder as a Miles diffusion model
INFO_FILE = "miles_diffusion.json"
FORMAT = "miles-diffusion"


class NotADiffusionModel(ValueError):
    """``model.path`` is not a diffusion model folder (a text model, or nothing)."""


@dataclass(frozen=True)
class ModelInfo:
    """What a diffusion model folder says about its network and its noise schedule."""

    sample_size: int
    channels: int
    num_classes: int
    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"

    def to_json(self) -> dict[str, Any]:
        """The contents of ``miles_diffusion.json``."""
        return {"format": FORMAT, **asdict(self)}


def is_diffusion_model(path: str | Path) -> bool:
    """Whether ``path`` is a folder with a ``miles_diffusion.json`` or a diffusers
    ``model_index.json`` (a pipeline): cheap, no import of torch."""
    p = Path(path).expanduser()
    return (p / INFO_FILE).is_file() or (p / "model_index.json").is_file()


def read_model_info(path: str | Path) -> ModelInfo:
    """The description of the diffusion model at ``path``; :class:`NotADiffusionModel` naming
    what is there instead when it is not one."""
    p = Path(path).expanduser()
    info = p / INFO_FILE
    if not info.is_file():
        what = (
            "a text model (it has a config.json)"
            if (p / "config.json").is_file()
            else "not a diffusion model folder"
        )
        raise NotADiffusionModel(
            f"model.path {str(path)!r} is {what}: the diffusion modality needs a folder with "
            f"{INFO_FILE} and unet/ (make one with `miles-diffusion pretrain-digits --out DIR`)"
        )
    try:
        data = json.loads(info.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NotADiffusionModel(f"{info}: cannot read it ({exc})") from None
    if data.get("format") != FORMAT:
        raise NotADiffusionModel(f"{info}: format is {data.get('format')!r}, expected {FORMAT!r}")
    fields = {k: data[k] for k in ("sample_size", "channels", "num_classes") if k in data}
    missing = {"sample_size", "channels", "num_classes"} - set(fields)
    if missing:
        raise NotADiffusionModel(f"{info}: missing {sorted(missing)}")
    for k in ("num_train_timesteps", "beta_schedule"):
        if k in data:
            fields[k] = data[k]
    return ModelInfo(**fields)


def write_model_info(path: str | Path, info: ModelInfo) -> None:
    """Write ``miles_diffusion.json`` into the folder ``path``."""
    Path(path, INFO_FILE).write_text(json.dumps(info.to_json(), indent=2) + "\n")


def load_unet(path: str | Path, dtype: str = "float32") -> Any:
    """The folder's UNet (``unet/``), in eval mode, on the CPU, in ``dtype``."""
    import diffusers
    import torch

    unet_cls: Any = diffusers.UNet2DModel
    unet = unet_cls.from_pretrained(
        str(Path(path).expanduser() / "unet"), torch_dtype=torch.float32
    )
    if dtype == "float64":
        unet = unet.double()  # nn.Module.double: no half-precision warning
    return unet.eval()
