"""PNG grids of sampled images: one row per prompt group, one column per image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from miles_core.data import Group


def grid_image(rows: Sequence[Sequence[Tensor]], scale: int = 4, pad: int = 1) -> Tensor:
    """Images ``[C, H, W]`` in ``[0, 1]`` laid out in rows, upscaled ``scale`` times
    (nearest), ``pad`` pixels of mid-grey between them: ``[H', W', 3]`` uint8."""
    if not rows or not any(rows):
        raise ValueError("no images to lay out")
    first = next(img for row in rows for img in row)
    c, h, w = first.shape
    cols = max(len(row) for row in rows)
    hh, ww = h * scale, w * scale
    out = torch.full(
        (len(rows) * (hh + pad) + pad, cols * (ww + pad) + pad, 3), 128, dtype=torch.uint8
    )
    for i, row in enumerate(rows):
        for j, img in enumerate(row):
            x = img.detach().float().clamp(0, 1)
            x = x.expand(3, h, w) if c == 1 else x[:3]
            x = x.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
            y0, x0 = pad + i * (hh + pad), pad + j * (ww + pad)
            out[y0 : y0 + hh, x0 : x0 + ww] = (x.permute(1, 2, 0) * 255).round().to(torch.uint8)
    return out


def save_png(pixels: Tensor, path: Path) -> Path:
    """Write ``[H, W, 3]`` uint8 pixels as a PNG (Pillow)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.numpy(), mode="RGB").save(path)
    return path


def write_group_grid(groups: Sequence[Group], path: Path) -> Path | None:
    """The images of ``groups`` (``metadata["image"]`` of each sample), a row per group in
    label order; nothing when no sample has an image."""
    rows = [
        [s.metadata["image"] for s in g.samples if "image" in s.metadata]
        for g in sorted(groups, key=lambda g: int(g.samples[0].metadata.get("label", 0)))
        if g.samples
    ]
    rows = [r for r in rows if r]
    if not rows:
        return None
    return save_png(grid_image(rows), path)


def model_grid(
    model_path: str,
    out: Path,
    *,
    per_class: int = 8,
    seed: int = 0,
    num_inference_steps: int = 10,
    eta: float = 1.0,
) -> Path:
    """A row of ``per_class`` samples for every class of the diffusion model folder
    ``model_path`` (a pretrained model, or a run's ``checkpoints/step_<N>/trainer``), each row
    from the same noise (``seed``), so grids of two folders compare image by image."""
    from miles_diffusion.modality import policy_options
    from miles_diffusion.model import read_model_info
    from miles_diffusion.policy import from_pretrained

    info = read_model_info(model_path)
    options = policy_options(info, {"num_inference_steps": num_inference_steps, "eta": eta})
    policy = from_pretrained(model_path, options)
    rows = []
    for label in range(max(info.num_classes, 1)):
        rollout = policy.sample([label] * per_class, seed)
        rows.append(list(rollout.images))
    return save_png(grid_image(rows), out)
