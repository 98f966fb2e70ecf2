"""Miles placement on Ray: the trainer (with its weight sender) and the engines run in Ray
actors placed by one placement group, colocated (one shared bundle) or disaggregated (a bundle
each). See the distribution's README."""

from __future__ import annotations

from miles_ray.layout import Layout, plan
from miles_ray.options import RayOptions

__all__ = ["Layout", "RayOptions", "plan"]
