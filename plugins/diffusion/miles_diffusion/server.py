"""The diffusion engine server: a model folder's UNet sampled over SGLang-shaped HTTP endpoints.

Run as ``python -m miles_diffusion.server --model-path DIR --port N``. ``POST /generate`` takes
``{"input_ids": [label], "sampling_params": {"n", "seed", sampler fields}}`` and answers the
sampled trajectories (``latents`` ``[n, K+1, C, H, W]`` and per-step ``logprobs`` ``[n, K]``, as
base64 of little-endian bytes), exactly what
``DiffusionPolicy(options, unet=served_unet).sample([label] * n, seed)`` returns.

Everything else is the embedded engine's server (:class:`miles_engine_embedded.server.Server`):
its weight endpoints (``/update_weights_from_disk``, ``/update_weights_from_tensor``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/miles/p2p_weights``,
``/update_weight_version``) run unchanged over :class:`DiffusionEngine`, whose one worker thread
runs both the sampling batches and every weight load: a batch never overlaps an update, and an
update waits for the running batch.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import logging
import random
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Literal

import torch
from aiohttp import web
from miles_engine_embedded.launcher import bind_listening
from miles_engine_embedded.protocol import (
    ContinueGenerationRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
)
from miles_engine_embedded.server import (
    P2P_PATH,
    BadRequest,
    Server,
    error_response,
    parse_body,
)
from miles_engine_embedded.weights import ModelHolder
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
from miles_diffusion.model import ModelInfo, load_unet, read_model_info
from miles_diffusion.options import DiffusionOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout

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


class UNetHolder(ModelHolder):
    """The served UNet and its weight version, with the embedded engine's weight loading
    (every name and shape checked before anything changes; ``load_named`` copies,
    ``adopt_named`` serves from a transport's tensors; ``load_from_disk`` reads a model folder).

    ``ModelHolder.__init__`` loads a causal LM, so this sets the fields its methods use itself.
    """

    def __init__(self, model_path: str, *, weight_version: str) -> None:
        self.invariant = False
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_path = model_path
        self.weight_version = weight_version
        self.info: ModelInfo = read_model_info(model_path)
        self.lean = None
        self.use_lean = False
        self.lora = None
        self._lora_modules = None
        self.gates: dict[int, Any] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.adopted = False
        #: incremented whenever the weights change (copies made from them are stale)
        self.generation = 0
        self.model = self._load(model_path)
        self.rebuild()

    def _load(self, path: str) -> Any:
        info = read_model_info(path)
        if hasattr(self, "model") and info != self.info:
            raise ValueError(
                f"{path} is a different diffusion model ({info}); this server serves {self.info}"
            )
        return load_unet(path)

    def rebuild(self) -> None:
        """Re-read the parameter table after the weights changed."""
        self.params = dict(self.model.state_dict(keep_vars=True))
        self.generation += 1


class SamplerRefused(ValueError):
    """The sampler settings cannot build a policy (a zero-variance step, say)."""


class DiffusionEngine:
    """What :class:`miles_engine_embedded.server.Server` drives, for a diffusion UNet: one
    worker thread that runs sampling batches and weight loads (``call``), in order."""

    def __init__(self, holder: UNetHolder, *, seed: int) -> None:
        self.holder = holder
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="miles-diffusion-batch")
        self.rng = random.Random(seed)
        self._stopped = False
        self.policies: dict[str, DiffusionPolicy] = {}
        self._copies: dict[str, Any] = {}  # the UNet in another dtype, for one generation
        self._copies_of = holder.generation
        self.batches = 0
        self.images = 0
        self.last_error: str | None = None

    def call(self, fn: Callable[[DiffusionEngine], Any]) -> Future[Any]:
        """Run ``fn(self)`` on the worker thread, after the batch or update running there."""
        return self.executor.submit(fn, self)

    def abort(self, rid: str | None = None, reason: str | None = None) -> int:
        """Nothing to abort: a batch runs to its end (it is one forward pass per step)."""
        return 0

    @property
    def alive(self) -> bool:
        return not self._stopped

    def stop(self) -> None:
        self._stopped = True
        self.executor.shutdown(wait=True)

    def unet(self, dtype: str) -> Any:
        """The served UNet in ``dtype`` (a copy for float64, remade after every update)."""
        if dtype == "float32":
            return self.holder.model
        if self._copies_of != self.holder.generation:
            self._copies, self._copies_of = {}, self.holder.generation
            self.policies = {k: p for k, p in self.policies.items() if p.options.dtype == "float32"}
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.holder.model).double()
        return self._copies[dtype]

    def policy(self, options: DiffusionOptions) -> DiffusionPolicy:
        """The policy of these sampler settings over the served UNet (cached)."""
        unet = self.unet(options.dtype)
        key = options.model_dump_json()
        policy = self.policies.get(key)
        if policy is None or policy.unet is not unet:
            try:
                policy = DiffusionPolicy(options, unet=unet)
            except ValueError as exc:
                raise SamplerRefused(str(exc)) from None
            self.policies[key] = policy
        return policy

    def sample(
        self, options: DiffusionOptions, labels: list[int], seed: int
    ) -> tuple[DiffusionRollout, str]:
        """One batch, and the weight version that sampled it."""
        policy = self.policy(options)
        try:
            rollout = policy.sample(labels, seed)
        except Exception as exc:
            self.last_error = repr(exc)
            raise
        self.batches += 1
        self.images += len(labels)
        return rollout, self.holder.weight_version


def encode(t: torch.Tensor) -> str:
    """A tensor's raw little-endian bytes as base64 text."""
    a = t.detach().contiguous().cpu().numpy()
    return base64.b64encode(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).decode()


def _errors(exc: ValidationError, prefix: str) -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False, include_context=False)
    )


class DiffusionServer(Server):
    """HTTP front of one :class:`DiffusionEngine` (the embedded server's weight endpoints,
    diffusion generation, pause, memory and info)."""

    engine: Any
    holder: Any

    def __init__(self, engine: DiffusionEngine, *, server_args: dict[str, Any]) -> None:
        super().__init__(engine, server_args=server_args)  # type: ignore[arg-type]
        self.paused = False
        self.released: set[str] = set()
        #: set while batches may start (not paused, nothing released)
        self.ready = asyncio.Event()
        self.ready.set()
        self.batch_slot = asyncio.Lock()

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        from miles_engine_embedded.server import BODY_LIMITS, errors_middleware

        # each endpoint's body bounded as on the text engine (413 from the header)
        limits = self.body_limits()
        app = web.Application(middlewares=[errors_middleware], client_max_size=max(limits.values()))
        app[BODY_LIMITS] = limits
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post(P2P_PATH, self.p2p_weights)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/release_memory_occupation", self.release_memory_occupation)
        r.add_post("/resume_memory_occupation", self.resume_memory_occupation)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        app.on_shutdown.append(self._on_shutdown)
        return app

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
                return await self._call(lambda e: e.sample(options, labels, seed))  # type: ignore[no-any-return]
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
        from miles_engine_client.bodies import read_body
        from miles_engine_embedded.server import body_limit

        await read_body(request, body_limit(request))
        return web.json_response({})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation``: no new batch starts; answers once the running one
        finished (every mode: a batch is never cut short)."""
        await parse_body(request, PauseGenerationRequest)
        self.paused = True
        self.ready.clear()
        await self._call(lambda e: None)
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
        await self._call(lambda e: None)
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
