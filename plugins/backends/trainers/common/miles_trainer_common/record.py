"""The record of a trainer backend built on :class:`miles_trainer_common.worker.TrainerRank`
(torch-free: a plugin module imports it when it registers).

What every such rank does is declared here once: a critic for the algorithms that need values
(``computes``: the backend's needs), adapters (``lora``), several on one base, true on-policy
mode, text runs, CPU and CUDA. A backend names what differs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from miles_core import TrainerBackend


def rank_backend(
    name: str,
    factory: str,
    config: type[BaseModel],
    description: str,
    computes: frozenset[str],
    **fields: Any,
) -> TrainerBackend:
    """A :class:`~miles_core.TrainerBackend` whose ranks are ``TrainerRank``'s; ``fields``
    add to or replace its declarations (e.g. ``routing=True``)."""
    declared: dict[str, Any] = {
        "devices": ("cpu", "cuda"),
        # checked against the algorithm's needs when a run is validated (a distillation
        # teacher's log-probs come with the samples)
        "computes": computes,
        # causal LMs: a text run
        "requires": {"modality": ("text",)},
        # a run's adapter (miles-lora): only the adapter trains and syncs
        "adapters": frozenset({"lora"}),
        # several adapters on one base (the config's adapters): each group trains its own
        "multi_adapter": True,
        # rollout.true_on_policy: a recomputed log-prob must be bitwise the engine's
        "true_on_policy": True,
        # a placement starts the ranks (one Ray actor each, on any node)
        "placed_ranks": True,
    }
    declared.update(fields)
    return TrainerBackend(
        name=name, factory=factory, config=config, description=description, **declared
    )
