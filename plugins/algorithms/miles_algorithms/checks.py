"""Start-time compatibility rules of the algorithms (torch-free: they run on config validation)."""

from __future__ import annotations

from typing import Any


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def async_needs_off_policy_choice(run_config: Any) -> str | None:
    """Rule for algorithms with PPO-style ratios: an asynchronous run trains on samples from
    older weights, so which log-probs the ratio is taken against must be chosen explicitly
    (``behaviour_policy``); leaving it at ``None`` is refused with the reason.

    Reads ``run_config.run.mode`` and ``run_config.algorithm.options.behaviour_policy``.
    """
    mode = _get(_get(run_config, "run"), "mode")
    if mode != "async":
        return None
    options = _get(_get(run_config, "algorithm"), "options")
    if _get(options, "behaviour_policy") is not None:
        return None
    return (
        "it uses PPO-style importance ratios, and an asynchronous run trains on samples from "
        "older weights, so its off-policy correction must be chosen explicitly: set "
        "algorithm.behaviour_policy to 'rollout' (ratio against the engine's log-probs) or "
        "'recomputed' (against old_logprobs recomputed by the trainer, optionally with "
        "off_policy_correction 'tis' or 'mis'); it is None"
    )
