"""True on-policy mode: which models the batch-invariant kernels cover (torch-free, read by
the run config's check). The kernels themselves are :mod:`miles_core.invariant.kernels`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Hugging Face ``model_type`` values whose forward is made of the operations the kernels cover
#: (linear layers, SDPA attention, RMSNorm, rotary embeddings, SiLU): dense decoders, and the
#: mixtures of experts whose experts then run one by one (``kernels.prepare``)
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


def unsupported(model_config: Mapping[str, Any]) -> str | None:
    """Why a Hugging Face ``config.json`` (its text config when nested) is not covered by the
    batch-invariant kernels, or None when it is."""
    cfg = model_config.get("text_config") or model_config
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        return (
            f"model_type {model_type!r} has no batch-invariant forward; covered: "
            f"{', '.join(sorted(MODEL_TYPES))}"
        )
    windowed = model_type in ("mistral", "mixtral") and cfg.get("sliding_window")
    if cfg.get("use_sliding_window") or windowed:
        return "a sliding-window attention has no batch-invariant forward"
    return None
