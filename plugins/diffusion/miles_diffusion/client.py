"""The client of a diffusion engine server (:mod:`miles_diffusion.server`).

:class:`DiffusionEngineClient` is the engine client Miles uses for every engine
(:class:`miles_engine_client.EngineClient`: weights, versions, pause, memory, health, info) with
``generate`` answering sampled trajectories (:class:`ImageGeneration`) instead of tokens.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from miles_engine_client import EngineClient, EngineHTTPError

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class ImageGeneration:
    """One ``/generate`` answer: ``n`` sampled trajectories of one label.

    Attributes:
        latents: the trajectories ``x_T ... x_0``, ``[n, K + 1, C, H, W]``.
        step_logprobs: the log-probability of every denoising step, ``[n, K]``.
        timesteps: the timestep each step starts from (``K`` ints).
        output_ids, logprobs: the same steps as a text engine's answer is shaped (each
            trajectory's timesteps and step log-probs, one trajectory after the other), for
            what the loop counts and stamps per generated "token".
        weight_version: the weight version that sampled them (the loop may overwrite it).
        finish_reason: ``"stop"``.
        rid: the request id.
        seed: the seed of the noise.
        raw: the answer's ``meta_info``.
    """

    latents: torch.Tensor
    step_logprobs: torch.Tensor
    timesteps: list[int]
    weight_version: str
    finish_reason: str = "stop"
    rid: str = ""
    seed: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[float] = field(default_factory=list, repr=False)
    #: no routing record: a diffusion model has no experts to route
    routed_experts: None = None

    def __post_init__(self) -> None:
        if not self.output_ids:
            self.output_ids = list(self.timesteps) * int(self.step_logprobs.shape[0])
        if not self.logprobs:
            self.logprobs = self.step_logprobs.reshape(-1).tolist()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageGeneration:
        """Parse one ``/generate`` answer of a diffusion server."""
        try:
            dtype = _DTYPES[str(data["dtype"])]
            shape = [int(x) for x in data["shape"]]
            latents = decode(str(data["latents"]), dtype, shape)
            logprobs = decode(str(data["logprobs"]), dtype, [shape[0], shape[1] - 1])
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise EngineHTTPError(
                "/generate", 200, f"not a diffusion engine's answer: {exc!r}"
            ) from None
        meta = dict(data.get("meta_info") or {})
        reason = data.get("finish_reason") or meta.get("finish_reason") or {}
        version = data.get("weight_version", meta.get("weight_version"))
        return cls(
            latents=latents,
            step_logprobs=logprobs,
            timesteps=[int(t) for t in data.get("timesteps", [])],
            weight_version="" if version is None else str(version),
            finish_reason=str(reason.get("type", "")) if isinstance(reason, dict) else str(reason),
            rid=str(meta.get("id", "")),
            seed=meta.get("seed"),
            raw=meta,
        )


def decode(text: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` from base64 of its raw little-endian bytes."""
    raw = bytearray(base64.b64decode(text))
    t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(list(shape))


class DiffusionEngineClient(EngineClient):
    """Async client of one diffusion engine server; every method but ``generate`` is the
    engine client's."""

    async def generate(  # type: ignore[override]
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        **kw: Any,
    ) -> ImageGeneration:
        """``POST /generate`` for ``input_ids = [label]``; ``sampling_params``: ``n``, ``seed``
        and the sampler fields of :class:`miles_diffusion.options.DiffusionOptions`. Other
        keyword arguments are added to the body (the server refuses unknown ones)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        body.update({k: v for k, v in kw.items() if v is not None and v is not False})
        return ImageGeneration.from_json(await self.request("POST", "/generate", body))
