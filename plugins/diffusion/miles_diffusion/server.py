"""The diffusion engine server: a model folder's UNet sampled over SGLang-shaped HTTP endpoints.

Run as ``python -m miles_diffusion.server --model-path DIR --port N``. ``POST /generate`` takes
``{"input_ids": [label], "sampling_params": {"n", "seed", sampler fields}}`` and answers the
sampled trajectories (``latents`` ``[n, K+1, C, H, W]`` and per-step ``logprobs`` ``[n, K]``, as
base64 of little-endian bytes), exactly what
``DiffusionPolicy(options, unet=served_unet).sample([label] * n, seed)`` returns.

The weight endpoints are the embedded engine's route groups
(:class:`miles_engine_embedded.weight_routes.WeightRoutes`: ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weight_version``; and the receiver route of every
installed transport that declares one, such as the p2p transport's ``/miles/p2p_weights``), run
unchanged over :class:`~miles_diffusion.unet_engine.DiffusionEngine`, whose one worker thread
runs both the sampling batches and every weight load: a batch never overlaps an update, and an
update waits for the running batch.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, ClassVar, Literal

# What loading the UNet imports (5 s of CPU here), imported with this module rather than at the
# load: a CPU server that is a fork of a fork server which imported this module
# (:class:`miles_core.forks.ForkedServer`) then starts without importing it again.
import diffusers.models.unets.unet_2d
import diffusers.schedulers.scheduling_ddim  # noqa: F401
import torch
from aiohttp import web
from miles_engine_client.bodies import read_body
from miles_engine_embedded.launcher import bind_listening
from miles_engine_embedded.protocol import (
    ContinueGenerationRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
)
from miles_engine_embedded.receiver_routes import receiver_routes
from miles_engine_embedded.routing import (
    BadRequest,
    Route,
    RouteGroup,
    body_limit,
    build_app,
    error_response,
    on_engine,
    parse_body,
    weights_body_limit,
)
from miles_engine_embedded.weight_routes import WeightRoutes
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from miles_diffusion.modality import SAMPLER_FIELDS as MODALITY_SAMPLER_FIELDS
from miles_diffusion.options import DiffusionOptions
from miles_diffusion.policy import DiffusionRollout
from miles_diffusion.unet_engine import DiffusionEngine, SamplerRefused, UNetHolder

__all__ = [
    "SAMPLER_FIELDS",
    "DiffusionEngine",
    "DiffusionGenerateRequest",
    "DiffusionSamplingParams",
    "DiffusionServer",
    "SamplerRefused",
    "UNetHolder",
    "build_parser",
    "encode",
    "main",
]

log = logging.getLogger("miles_diffusion.server")

#: the sampler fields of :class:`DiffusionOptions` a request may set: the modality's, and
#: the dtype (float64 for the Python API's checks; a run samples float32)
SAMPLER_FIELDS = (*MODALITY_SAMPLER_FIELDS, "dtype")
_STRICT = ConfigDict(extra="forbid", strict=True)


class DiffusionSamplingParams(BaseModel):
    """``sampling_params`` of ``POST /generate``: the batch size, the seed and the sampler
    fields of :class:`DiffusionOptions` (each unset one takes that model's default)."""

    model_config = ConfigDict(extra="forbid")

    n: StrictInt = Field(1, ge=1, le=4096, description="images sampled for the label")
    seed: StrictInt | None = Field(
        None, ge=0, le=2**63 - 1, description="seed of the noise (default: drawn by the server)"
    )
    num_inference_steps: Any = None
    eta: Any = None
    guidance_scale: Any = None
    clip_sample: Any = None
    logprob_reduction: Any = None
    timestep_spacing: Any = None
    dtype: Any = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"unknown sampling_params {unknown}; allowed: {', '.join(cls.model_fields)}"
                )
        return data


class DiffusionGenerateRequest(BaseModel):
    """Body of ``POST /generate``."""

    model_config = _STRICT

    input_ids: list[StrictInt]
    sampling_params: DiffusionSamplingParams | None = None
    rid: StrictStr | None = None
    #: accepted for the engine client's body; the step log-probs are always returned
    return_logprob: StrictBool = True
    stream: Literal[False] = False


def encode(t: torch.Tensor) -> str:
    """A tensor's raw little-endian bytes as base64 text."""
    a = t.detach().contiguous().cpu().numpy()
    return base64.b64encode(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).decode()


def _errors(exc: ValidationError, prefix: str) -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False, include_context=False)
    )


class DiffusionServer:
    """HTTP front of one :class:`DiffusionEngine`: diffusion generation, pause, memory and
    info served here; the weight endpoints by the embedded server's route groups."""

    ROUTES: ClassVar[tuple[Route, ...]] = (
        Route("POST", "/generate", "generate", "generate"),
        Route("POST", "/abort_request", "abort_request"),
        Route("POST", "/pause_generation", "pause_generation"),
        Route("POST", "/continue_generation", "continue_generation"),
        Route("*", "/flush_cache", "flush_cache"),
        Route("POST", "/release_memory_occupation", "release_memory_occupation"),
        Route("POST", "/resume_memory_occupation", "resume_memory_occupation"),
        Route("GET", "/health", "health"),
        Route("GET", "/health_generate", "health_generate"),
        Route("GET", "/model_info", "model_info"),
        Route("GET", "/server_info", "server_info"),
        Route("GET", "/get_model_info", "model_info"),
        Route("GET", "/get_server_info", "server_info"),
    )

    def __init__(self, engine: DiffusionEngine, *, server_args: dict[str, Any]) -> None:
        self.engine = engine
        self.holder = engine.holder
        self.server_args = server_args
        self.started = time.time()
        #: the rids of the batches running now (a second request with one is refused)
        self.inflight: set[str] = set()
        self.weights = WeightRoutes(engine, server_args=server_args)
        self.receivers = receiver_routes(self.weights)
        self.paused = False
        self.released: set[str] = set()
        #: set while batches may start (not paused, nothing released)
        self.ready = asyncio.Event()
        self.ready.set()
        self.batch_slot = asyncio.Lock()

    def routes(self) -> Sequence[Route]:
        """The endpoints served by this object (the weight endpoints are its groups')."""
        return self.ROUTES

    def groups(self) -> list[RouteGroup]:
        """Every route group this server mounts."""
        return [self, self.weights, *self.receivers]

    def app(self) -> web.Application:
        """The aiohttp application with every route, each endpoint's body bounded as on the
        text engine (413 from the header)."""
        return build_app(
            self.groups(),
            weights_limit=weights_body_limit(self.server_args),
            on_shutdown=self._on_shutdown,
        )

    async def _on_shutdown(self, _app: web.Application) -> None:
        await asyncio.to_thread(self.engine.stop)

    # --- generation -------------------------------------------------------------------------

    def _label(self, ids: list[int]) -> int:
        if len(ids) != 1:
            raise BadRequest(f"input_ids: give exactly one class label, [label]; got {len(ids)}")
        label, classes = ids[0], self.holder.info.num_classes
        if classes == 0 and label != 0:
            raise BadRequest(
                f"input_ids: the model is unconditional (num_classes 0): the only label is 0, "
                f"got {label}"
            )
        if classes and not 0 <= label < classes:
            raise BadRequest(
                f"input_ids: label {label} is outside the model's classes: allowed 0 to "
                f"{classes - 1}"
            )
        return label

    def options(self, sp: DiffusionSamplingParams) -> DiffusionOptions:
        """The policy options of a request: the model folder's network and schedule, the served
        UNet's widths, and the request's sampler fields."""
        info = self.holder.info
        cfg = self.holder.model.config
        fields: dict[str, Any] = {
            **asdict(info),
            "block_out_channels": tuple(cfg.block_out_channels),
            "layers_per_block": cfg.layers_per_block,
            "norm_num_groups": cfg.norm_num_groups,
        }
        fields.update({k: getattr(sp, k) for k in SAMPLER_FIELDS if getattr(sp, k) is not None})
        try:
            return DiffusionOptions.model_validate(fields)
        except ValidationError as exc:
            raise BadRequest("invalid sampling_params: " + _errors(exc, "")) from None

    async def _batch(
        self, options: DiffusionOptions, labels: list[int], seed: int
    ) -> tuple[DiffusionRollout, str]:
        """Run one batch on the worker once batches may start (waits while paused or
        released); one at a time."""
        async with self.batch_slot:
            while not self.ready.is_set():
                await self.ready.wait()
            try:
                sampled: tuple[DiffusionRollout, str] = await on_engine(
                    self.engine, lambda e: e.sample(options, labels, seed)
                )
                return sampled
            except SamplerRefused as exc:
                raise BadRequest(f"sampling_params: {exc}") from None

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``: ``n`` trajectories of one label."""
        body = await parse_body(request, DiffusionGenerateRequest)
        label = self._label(body.input_ids)
        sp = body.sampling_params or DiffusionSamplingParams()
        options = self.options(sp)
        seed = sp.seed if sp.seed is not None else self.engine.rng.randrange(2**63)
        rid = body.rid or uuid.uuid4().hex
        if rid in self.inflight:
            raise BadRequest("a request with this rid is already running")
        self.inflight.add(rid)
        started = time.time()
        try:
            rollout, version = await self._batch(options, [label] * sp.n, seed)
        finally:
            self.inflight.discard(rid)
        finish = {"type": "stop"}
        return web.json_response(
            {
                "latents": encode(rollout.latents),
                "logprobs": encode(rollout.logprobs),
                "dtype": options.dtype,
                "shape": list(rollout.latents.shape),
                "timesteps": [int(t) for t in rollout.timesteps],
                "weight_version": version,
                "finish_reason": finish,
                "meta_info": {
                    "id": rid,
                    "weight_version": version,
                    "finish_reason": finish,
                    "label": label,
                    "seed": seed,
                    "n": sp.n,
                    "num_inference_steps": options.num_inference_steps,
                    "e2e_latency": time.time() - started,
                },
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        """``POST /abort_request``: accepted; a running batch is not cut short."""
        await read_body(request, body_limit(request))
        return web.json_response({})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation``: no new batch starts; answers once the running one
        finished (every mode: a batch is never cut short)."""
        await parse_body(request, PauseGenerationRequest)
        self.paused = True
        self.ready.clear()
        await on_engine(self.engine, lambda e: None)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``."""
        await parse_body(request, ContinueGenerationRequest)
        self.paused = False
        self._update_ready()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _update_ready(self) -> None:
        if self.paused or self.released:
            self.ready.clear()
        else:
            self.ready.set()

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: nothing is cached; succeeds when no batch runs."""
        if request.method not in ("GET", "POST"):
            raise BadRequest("use GET or POST", 405)
        if self.batch_slot.locked():
            return web.Response(text="Cache not flushed.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    # --- memory -----------------------------------------------------------------------------

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """``POST /release_memory_occupation``: no batch starts until resumed (answers once the
        running one finished). The weights live on the CPU, where the embedded engine keeps
        them too; weight updates are taken meanwhile."""
        body = await parse_body(request, MemoryOccupationRequest)
        self.released |= set(body.tags or ["kv_cache", "weights"])
        self._update_ready()
        await on_engine(self.engine, lambda e: None)
        return web.json_response({"success": True, "message": "Memory released."})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """``POST /resume_memory_occupation``."""
        body = await parse_body(request, MemoryOccupationRequest)
        self.released -= set(body.tags or ["kv_cache", "weights"])
        self._update_ready()
        return web.json_response({"success": True, "message": "Memory resumed."})

    # --- health and info --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while the worker thread runs."""
        if not self.engine.alive:
            return error_response("engine worker is not running", 503)
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """``GET /health_generate``: one single-step sample end to end (200 at once while
        paused or released)."""
        if not self.ready.is_set():
            return web.Response(text="")
        options = self.options(DiffusionSamplingParams(num_inference_steps=1))
        try:
            await asyncio.wait_for(self._batch(options, [0], 0), timeout=20)
        except asyncio.TimeoutError:
            return error_response("health generation timed out", 503)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info``: the model folder, its description and the served version."""
        h = self.holder
        return web.json_response(
            {
                "model_path": h.model_path,
                "served_model_name": h.model_path,
                "is_generation": True,
                "weight_version": h.weight_version,
                "model_type": "diffusion",
                "architectures": [type(h.model).__name__],
                "num_parameters": sum(p.numel() for p in h.model.parameters()),
                **asdict(h.info),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /server_info``: server arguments plus live state."""
        e = self.engine
        info = dict(self.server_args)
        info.update(
            {
                "served_model_name": self.holder.model_path,
                "version": "miles-diffusion",
                "weight_version": self.holder.weight_version,
                "internal_states": [
                    {
                        "running_requests": len(self.inflight),
                        "paused": self.paused,
                        "memory_released": sorted(self.released),
                        "batches": e.batches,
                        "generated_images": e.images,
                        "last_error": e.last_error,
                    }
                ],
                "uptime_s": time.time() - self.started,
            }
        )
        return web.json_response(info)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the server."""
    p = argparse.ArgumentParser(prog="python -m miles_diffusion.server")
    p.add_argument("--model-path", required=True, help="a diffusion model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--port-file",
        default=None,
        help="write the bound port to this file (with --port 0: the port the kernel picked)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds drawn for requests without one")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=120.0,
        help="seconds every wait of a weight-update group may block (SGLang's --dist-timeout)",
    )
    p.add_argument("--log-level", default="warning")
    p.add_argument("--max-running-requests", type=int, default=16)
    return p


def main(argv: list[str] | None = None) -> None:
    """Load the model folder's UNet and serve until terminated."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.max_running_requests < 1:
        raise SystemExit(
            f"--max-running-requests must be at least 1, got {args.max_running_requests}"
        )
    # bound before the model loads: the port is this server's from here on
    sock = bind_listening(args.host, args.port, args.port_file)
    holder = UNetHolder(args.model_path, weight_version=args.weight_version)
    engine = DiffusionEngine(holder, seed=args.seed)
    server = DiffusionServer(engine, server_args=dict(vars(args), port=sock.getsockname()[1]))
    web.run_app(
        server.app(),
        sock=sock,
        print=None,
        handler_cancellation=True,
        access_log=None,
    )


if __name__ == "__main__":
    main()
