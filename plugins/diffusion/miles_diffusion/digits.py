"""The handwritten digits of scikit-learn (``sklearn.datasets.load_digits``) as tensors.

1797 greyscale images of 8x8 pixels with integer values 0..16, ten classes. The file
``data/digits.csv.gz`` is scikit-learn's own copy (the test set of the UCI "Optical Recognition
of Handwritten Digits" data, E. Alpaydin and C. Kaynak, CC BY 4.0), shipped here byte for byte
so that the plugin needs neither scikit-learn nor a download: one row per image, 64 pixel values
then the label.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

DATA_FILE = Path(__file__).parent / "data" / "digits.csv.gz"
#: sha256 of scikit-learn's ``sklearn/datasets/data/digits.csv.gz``
DATA_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
NUM_IMAGES = 1797
NUM_CLASSES = 10
SIZE = 8
#: the largest pixel value of the data
MAX_VALUE = 16


@dataclass(frozen=True)
class Digits:
    """Images ``[N, 1, 8, 8]`` (float32 in ``[-1, 1]``) and their labels ``[N]`` (int64)."""

    images: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@lru_cache(maxsize=1)
def load_digits() -> Digits:
    """All 1797 digits in the order of ``sklearn.datasets.load_digits``."""
    raw = DATA_FILE.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DATA_SHA256:
        raise ValueError(f"{DATA_FILE} is damaged (sha256 {digest}, expected {DATA_SHA256})")
    rows = [[int(v) for v in row] for row in csv.reader(gzip.decompress(raw).decode().splitlines())]
    data = torch.tensor(rows, dtype=torch.int64)
    pixels = data[:, :-1].to(torch.float32).reshape(-1, 1, SIZE, SIZE)
    images = pixels / MAX_VALUE * 2.0 - 1.0
    return Digits(images=images, labels=data[:, -1].clone())


def split_indices(seed: int = 0, held_out: float = 0.2) -> tuple[Tensor, Tensor]:
    """Indices ``(train, held_out)`` into :func:`load_digits` of a fixed split: a seeded
    permutation, its first ``round(held_out * N)`` held out. The same seed gives the same split."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    order = torch.randperm(NUM_IMAGES, generator=torch.Generator().manual_seed(seed))
    n_held = round(held_out * NUM_IMAGES)
    return order[n_held:], order[:n_held]


def split_digits(seed: int = 0, held_out: float = 0.2) -> tuple[Digits, Digits]:
    """The digits of :func:`split_indices`: ``(train, held_out)``, 1438 and 359 images at the
    defaults."""
    digits = load_digits()
    train, held = split_indices(seed, held_out)
    return (
        Digits(images=digits.images[train], labels=digits.labels[train]),
        Digits(images=digits.images[held], labels=digits.labels[held]),
    )
