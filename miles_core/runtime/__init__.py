"""The runtime: :func:`train` over a :class:`Run`'s parts (see :mod:`miles_core.runtime.run`)."""

from miles_core.runtime.run import Run
from miles_core.runtime.train import train

__all__ = ["Run", "train"]
