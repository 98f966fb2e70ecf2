"""The HTTP server: SGLang's native API subset over the continuous-batching engine.

Run as ``python -m miles_engine_embedded.server --model-path DIR --port N``. Every body is
validated by :mod:`miles_engine_embedded.protocol`; a bad request is a 4xx with
``{"error": {"message": ...}}`` and never reaches the scheduler. The endpoint shapes are
documented in ``API.md`` beside this package.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
from aiohttp import web
from miles_engine_client.bodies import BodyRejected, check_declared_size, loads, read_body
from pydantic import BaseModel, ValidationError

from miles_engine_embedded.engine import Engine, EngineError, Request
from miles_engine_embedded.launcher import bind_listening
from miles_engine_embedded.lora import LoraError, parse_lora_paths, read_adapter_folder
from miles_engine_embedded.protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    MemoryOccupationRequest,
    P2PWeightsRequest,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateLoraFromDistributedRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from miles_engine_embedded.weights import ModelHolder

#: Miles's extension path serving the ``p2p_weights`` capability (not an SGLang endpoint).
P2P_PATH = "/miles/p2p_weights"
#: Miles's extension: a broadcast update committed into a LoRA adapter (``lora_weight_updates``)
LORA_DISTRIBUTED_PATH = "/miles/update_lora_from_distributed"

log = logging.getLogger("miles_engine_embedded")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

FLUSH_MESSAGE = (
    "Please check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


#: The body limit of an endpoint without one of its own (the control endpoints: pause, abort,
#: flush, version, init group... whose bodies are a few fields).
CONTROL_BODY_LIMIT = 64 << 10
#: ``/generate``: a batch of token ids or text as JSON, a few bytes a token (a 16-request
#: batch of 32k-token prompts is about 6 MiB of decimal ids).
GENERATE_BODY_LIMIT = 16 << 20
#: The weight-update and adapter endpoints by default (``--max-weights-body-mb``): their bodies
#: carry shared-memory handles and a manifest, about 200 bytes of JSON a tensor (the colocated
#: transport, measured), so a bucket of 20,000 tensors for 8 ranks fits with margin.
WEIGHTS_BODY_LIMIT = 256 << 20
#: ``app[BODY_LIMITS]``: ``{path: bytes}``, each endpoint's body limit (else the control one)
BODY_LIMITS: web.AppKey[dict[str, int]] = web.AppKey("body_limits", dict)


def body_limit(request: web.Request) -> int:
    """The largest body ``request``'s endpoint accepts, in bytes."""
    limits = request.app.get(BODY_LIMITS) or {}
    return limits.get(request.path, CONTROL_BODY_LIMIT)


class BadRequest(Exception):
    """A client error: answered with ``status`` and a JSON message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> web.Response:
    """The error body SGLang's native endpoints use."""
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON answer; a bug is a 500, never a dead server. A body
    declared over its endpoint's limit is refused (413) here, before a byte of it is read."""
    try:
        check_declared_size(request, body_limit(request))
        return await handler(request)
    except BodyRejected as exc:
        return error_response(exc.message, exc.status)
    except BadRequest as exc:
        return error_response(str(exc), exc.status)
    except EngineError as exc:
        return error_response(str(exc), exc.status)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.reason or exc.text or "error", exc.status)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("handler %s failed", request.path)
        return error_response(f"internal error: {exc!r}", 500)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read and validate a JSON body; an absent body means ``{}``. The body is bounded by its
    endpoint's limit (:func:`body_limit`, 413 over it), its nesting and its text are checked
    (:func:`miles_engine_client.bodies.loads`, 400): a :class:`BodyRejected` otherwise."""
    raw = await read_body(request, body_limit(request))
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = loads(raw)
        except BodyRejected as exc:
            raise BadRequest(f"malformed JSON body: {exc.message}", exc.status) from None
    if not isinstance(data, dict):
        raise BadRequest("the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise BadRequest("invalid request: " + "; ".join(parts)) from None


async def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s`` (retried while the
    port refuses: the trainer may bind its rendezvous a moment after it asked to join)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), left)
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            continue
        writer.close()
        return True


class Server:
    """HTTP front of one :class:`Engine`."""

    def __init__(self, engine: Engine, *, tokenizer: Any = None, server_args: dict[str, Any]):
        self.engine = engine
        self.holder = engine.holder
        self.tokenizer = tokenizer
        self.server_args = server_args
        self.inflight: set[str] = set()
        self.receivers: dict[str, Any] = {}
        from miles_transport_common.engine_side import DistributedUpdates, TensorUpdates

        # the engine side of the colocated and broadcast transports (SGLang's endpoints with
        # per-bucket verification and all-or-nothing commits)
        self.tensor_updates = TensorUpdates(str(self.holder.device.type))
        self.distributed_updates = DistributedUpdates(str(self.holder.device.type))
        self.started = time.time()
        #: adapters being unloaded: refused to new requests, dropped once none uses them
        self.unloading: set[str] = set()

    def app(self) -> web.Application:
        """The aiohttp application with every route, and each route's body limit."""
        limits = self.body_limits()
        # client_max_size bounds any read that does not go through parse_body
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
        r.add_post(LORA_DISTRIBUTED_PATH, self.update_lora_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_post("/release_memory_occupation", self.release_memory_occupation)
        r.add_post("/resume_memory_occupation", self.resume_memory_occupation)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        # SGLang 0.5.23 names: /model_info and /server_info; the /get_ spellings are its
        # deprecated aliases, still served there (and so here) for older callers.
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        app.on_shutdown.append(self._on_shutdown)
        return app

    def body_limits(self) -> dict[str, int]:
        """``{path: bytes}``: the body limit of each endpoint with more than
        :data:`CONTROL_BODY_LIMIT`: ``/generate``, and the weight-update and adapter
        endpoints (``--max-weights-body-mb``)."""
        weights = int(float(self.server_args.get("max_weights_body_mb") or 0) * (1 << 20))
        weights = weights or WEIGHTS_BODY_LIMIT
        limits = {"/generate": GENERATE_BODY_LIMIT}
        limits.update(
            (path, weights)
            for path in (
                "/update_weights_from_disk",
                "/update_weights_from_distributed",
                "/update_weights_from_tensor",
                P2P_PATH,
                LORA_DISTRIBUTED_PATH,
                "/load_lora_adapter",
                "/load_lora_adapter_from_tensors",
            )
        )
        return limits

    async def _on_shutdown(self, _app: web.Application) -> None:
        await asyncio.to_thread(self.engine.stop)

    async def _call(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    # --- generation -------------------------------------------------------------------------

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequest("input_ids is empty")
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.engine.context_length:
            raise BadRequest(
                f"the input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.engine.context_length} tokens)"
            )

    def _batch(
        self, body: GenerateRequest
    ) -> tuple[list[list[int]], list[SamplingParams], list[str], bool]:
        single = True
        if body.text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer: send input_ids")
            texts = [body.text] if isinstance(body.text, str) else body.text
            single = isinstance(body.text, str)
            seqs = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        else:
            ids = body.input_ids or []
            if ids and isinstance(ids[0], list):
                single = False
                seqs = [list(x) for x in ids]  # type: ignore[arg-type]
            else:
                seqs = [list(ids)]  # type: ignore[arg-type]
        if not seqs:
            raise BadRequest("the batch is empty")
        for s in seqs:
            self._check_ids(s)
            # SGLang ignores the field without return_logprob; with it, no input position
            # may start past the last one (SGLang 0.5.23 also takes len(input), which
            # returns nothing: refused here, where it can only be a mistake).
            if body.return_logprob and body.logprob_start_len >= len(s):
                raise BadRequest(
                    f"logprob_start_len ({body.logprob_start_len}) must be below the input's "
                    f"length ({len(s)} tokens), or -1 for no input log-probs"
                )
        sp = body.sampling_params
        if isinstance(sp, list):
            if len(sp) != len(seqs):
                raise BadRequest("sampling_params must be one object or one per input")
            params = sp
        else:
            params = [sp or SamplingParams()] * len(seqs)
        if body.rid is None:
            rids = [uuid.uuid4().hex for _ in seqs]
        elif isinstance(body.rid, str):
            if not single:
                raise BadRequest("a batch needs one rid per input")
            rids = [body.rid]
        else:
            if single or len(body.rid) != len(seqs):
                raise BadRequest("rid must be a list of one id per input")
            rids = list(body.rid)
        if len(set(rids)) != len(rids) or any(r in self.inflight for r in rids):
            raise BadRequest("a request with this rid is already running")
        return seqs, params, rids, single

    def _loras(self, lora_path: str | list[str | None] | None, n: int) -> list[str | None]:
        """The adapter of each of the ``n`` inputs (SGLang's ``lora_path``: one name for all,
        or one name or null per input); a name not loaded is refused here."""
        if lora_path is None:
            return [None] * n
        names: list[str | None] = [lora_path] * n if isinstance(lora_path, str) else list(lora_path)
        if len(names) != n:
            raise BadRequest(
                f"lora_path: give one adapter name, or a list of one name (or null) per input "
                f"({n}); got {len(names)}"
            )
        lora = self.holder.lora
        if any(x is not None for x in names) and lora is None:
            raise BadRequest("lora_path: LoRA is not enabled on this server (enable_lora)")
        for x in names:
            if (
                x is not None
                and lora is not None
                and (x not in lora.adapters or x in self.unloading)
            ):
                raise BadRequest(f"lora_path: {lora.not_loaded(x)}")
        return names

    def _response(self, req: Request, with_logprob: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": req.weight_version,
            "e2e_latency": req.finished_at - req.created,
        }
        if with_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.logprobs, req.output_ids, strict=True)
            ]
            # empty unless asked (logprob_start_len >= 0), and for an aborted request that was
            # not scored yet
            start = max(req.logprob_start_len, 0)
            meta["input_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(req.input_logprobs, req.input_ids[start:], strict=False)
            ]
        if req.return_routed_experts:
            ids = self.engine.routed_experts(req).numpy().astype("<i4", copy=False)
            meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode("ascii")
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``."""
        body = await parse_body(request, GenerateRequest)
        seqs, params, rids, single = self._batch(body)
        loras = self._loras(body.lora_path, len(seqs))
        if body.return_routed_experts and not self.holder.moe_layers:
            raise BadRequest(
                "return_routed_experts: the served model has no mixture-of-experts layer "
                f"({type(self.holder.model).__name__}); allowed: false"
            )
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Request]] = []
        reqs: list[Request] = []
        for ids, sp, rid, lora in zip(seqs, params, rids, loras, strict=True):
            fut: asyncio.Future[Request] = loop.create_future()

            def done(req: Request, fut: asyncio.Future[Request] = fut) -> None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

            req = Request(
                rid=rid,
                input_ids=ids,
                params=sp,
                return_logprob=body.return_logprob,
                logprob_start_len=body.logprob_start_len,
                lora=lora,
                return_routed_experts=body.return_routed_experts,
                on_done=done,
                uniforms=self.engine.new_stream(sp.sampling_seed),
            )
            futures.append(fut)
            reqs.append(req)
        self.inflight.update(rids)
        try:
            self.engine.submit_all(reqs)
        except EngineError:
            self.inflight.difference_update(rids)
            raise
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            # The client went away: stop spending compute on its requests.
            for rid in rids:
                self.engine.call(lambda e, rid=rid: e.abort(rid, "client disconnected"))
            raise
        finally:
            self.inflight.difference_update(rids)
        out = [self._response(r, body.return_logprob) for r in results]
        return web.json_response(out[0] if single else out)

    async def abort_request(self, request: web.Request) -> web.Response:
        """``POST /abort_request``: abort one rid, or all with ``abort_all``."""
        body = await parse_body(request, AbortRequest)
        if not body.abort_all and not body.rid:
            raise BadRequest("give rid or abort_all")
        rid = None if body.abort_all else body.rid
        await self._call(lambda e: e.abort(rid))
        return web.json_response({})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation``: stop decoding (mode abort / retract / in_place)."""
        body = await parse_body(request, PauseGenerationRequest)

        def pause(e: Engine) -> None:
            e.paused = True
            if body.mode == "abort":
                e.abort(None, "aborted by pause_generation")
            elif body.mode == "retract":
                e.retract_all()

        await self._call(pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation`` (``torch_empty_cache`` is accepted; the CPU engine
        has no allocator cache to empty)."""
        await parse_body(request, ContinueGenerationRequest)

        def cont(e: Engine) -> None:
            e.paused = False

        await self._call(cont)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: succeeds only when no request is running or waiting, and then
        frees the KV cache (allocated again, as long as needed, by the next request)."""
        if request.method not in ("GET", "POST"):
            raise BadRequest("use GET or POST", 405)
        ok = await self._call(lambda e: e.flush())
        if ok:
            return web.Response(text="Cache flushed.\n" + FLUSH_MESSAGE)
        return web.Response(text="Cache not flushed.\n" + FLUSH_MESSAGE, status=400)

    # --- weights ----------------------------------------------------------------------------

    async def _apply(
        self, load: Callable[[], int], *, abort_all: bool, version: str | None
    ) -> web.Response:
        """Run a weight load on the scheduler thread between steps; bump the version on success
        (a version the protocol does not allow is refused before anything is loaded)."""
        from miles_transport_common.engine_side import check_version
        from miles_transport_common.errors import BucketRejected

        try:
            check_version(version)
        except BucketRejected as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)

        def apply(e: Engine) -> tuple[int, int]:
            n_aborted = e.abort(None, "aborted for a weight update") if abort_all else 0
            n = load()
            e.holder.bump_version(version)
            return n, n_aborted

        try:
            n, _ = await self._call(apply)
        except (ValueError, OSError, RuntimeError, KeyError, TypeError) as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc}"}, status=400
            )
        return web.json_response(
            {
                "success": True,
                "message": f"Succeeded to update {n} weights.",
                "num_paused_requests": 0,
                "weight_version": self.holder.weight_version,
            }
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: load a checkpoint folder."""
        body = await parse_body(request, UpdateWeightsFromDiskRequest)
        if not os.path.isdir(body.model_path):
            return web.json_response(
                {"success": False, "message": f"no such checkpoint folder: {body.model_path}"},
                status=400,
            )
        return await self._apply(
            lambda: self.holder.load_from_disk(body.model_path),
            abort_all=body.abort_all_requests,
            version=body.weight_version,
        )

    def _target(self) -> Any:
        """The served model as a transport's staging layer loads into it: ``load`` copies and
        ``adopt`` serves from the given tensors, each between two scheduler steps."""

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            self.engine.call(lambda e: e.holder.load_named(named)).result()

        def adopt(named: list[tuple[str, torch.Tensor]]) -> None:
            self.engine.call(lambda e: e.holder.adopt_named(named)).result()

        load.adopt = adopt  # type: ignore[attr-defined]
        return load

    def _adapter_target(self, name: str, config: dict[str, object] | None) -> Any:
        """What a broadcast or p2p update naming an adapter commits into: the adapter
        ``name``, replaced (or loaded) whole from the received tensors, between two scheduler
        steps; the base weights are untouched."""
        if config is None:
            raise BadRequest("an update naming lora_name needs its config_dict")
        cfg = dict(config)

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            copied = [(n, t.clone()) for n, t in named]  # staging memory is reused
            self.engine.call(lambda e: e.holder.set_adapter(name, cfg, copied)).result()

        return load

    def _set_version(self, version: str | None) -> None:
        self.engine.call(lambda e: e.holder.bump_version(version)).result()

    async def _weights_call(
        self, fn: Callable[[], dict[str, Any]], abort_all: bool
    ) -> web.Response:
        """Run a blocking weight-update step off the event loop; a refused one is a 400 with
        ``success: false`` (the served weights and version unchanged)."""
        from miles_transport_common.errors import BucketRejected

        if abort_all:
            await self._call(lambda e: e.abort(None, "aborted for a weight update"))
        try:
            out = await asyncio.to_thread(fn)
        except (BucketRejected, ValueError, KeyError, TypeError) as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc}"}, status=400
            )
        except TimeoutError as exc:  # a peer that never answered, given up at dist_timeout
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc}"}, status=504
            )
        except Exception as exc:  # a broken group or a dead peer: the sender forms a new one
            log.warning("weight update failed: %r", exc)
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc!r}"}, status=500
            )
        out.setdefault("weight_version", self.holder.weight_version)
        return web.json_response(out)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor`` (SGLang's body): one serialized item per rank
        (this engine is one rank), ``load_format`` None/``direct`` (a list of (name, tensor)) or
        ``flattened_bucket``; the colocated transport's buckets, verified and committed all at
        once (see ``miles_transport_common.engine_side``)."""
        body = await parse_body(request, UpdateWeightsFromTensorRequest)
        return await self._weights_call(
            lambda: self.tensor_updates.handle(
                body.serialized_named_tensors,
                self._target(),
                load_format=body.load_format,
                weight_version=body.weight_version,
                set_version=self._set_version,
            ),
            body.abort_all_requests,
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join the weight-update group whose rank 0 is the
        trainer, formed as SGLang forms it (``tcp://master_address:master_port`` rendezvous,
        ``PrefixStore(group_name)``); the engine is rank ``rank_offset``. Returns once every rank
        joined. A new group replaces the earlier ones and drops what they staged."""
        body = await parse_body(request, InitWeightsUpdateGroupRequest)
        if body.backend != "gloo" and self.holder.device.type == "cpu":
            raise BadRequest("an engine on the CPU joins gloo groups only")
        if body.rank_offset >= body.world_size:
            raise BadRequest("rank_offset must be below world_size")
        timeout_s = float(self.server_args.get("dist_timeout", 120.0))
        # torch's store client retries a refused connection past its timeout (2-3x it), holding
        # the update lock all along: the rendezvous must accept a connection within the
        # timeout before the join starts.
        if not await reachable(body.master_address, body.master_port, timeout_s):
            return web.json_response(
                {
                    "success": False,
                    "message": f"Failed to init group: no rendezvous accepted a connection at "
                    f"{body.master_address}:{body.master_port} within dist_timeout "
                    f"({timeout_s:g} s)",
                },
                status=504,
            )

        def join() -> dict[str, Any]:
            self.distributed_updates.init_group(
                master_address=body.master_address,
                master_port=body.master_port,
                rank_offset=body.rank_offset,
                world_size=body.world_size,
                group_name=body.group_name,
                backend=body.backend,
                timeout_s=timeout_s,
            )
            return {"success": True, "message": "Succeeded to init group."}

        return await self._weights_call(join, False)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed`` (SGLang's body): receive the named tensors
        by broadcasts from rank 0 of the group (``load_format`` unset: one per tensor, loaded at
        once; ``flattened_bucket``: one flat bucket, staged and hashed until the call that
        carries ``weight_version`` commits the update; see
        ``miles_transport_common.engine_side``)."""
        body = await parse_body(request, UpdateWeightsFromDistributedRequest)
        for name, shape in zip(body.names, body.shapes, strict=True):
            if name not in self.holder.params:
                raise BadRequest(f"unknown weight {name!r}")
            if tuple(shape) != tuple(self.holder.params[name].shape):
                raise BadRequest(f"weight {name!r}: shape {shape} does not match the model")
        return await self._distributed(body, self._target())

    async def update_lora_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /miles/update_lora_from_distributed`` (Miles's extension serving the
        ``lora_weight_updates`` capability): ``/update_weights_from_distributed``'s body and
        protocol plus ``lora_name`` and ``config_dict``; the commit replaces (or loads) that
        adapter, checked whole then, instead of model weights."""
        body = await parse_body(request, UpdateLoraFromDistributedRequest)
        return await self._distributed(body, self._adapter_target(body.lora_name, body.config_dict))

    async def _distributed(
        self, body: UpdateWeightsFromDistributedRequest, target: Any
    ) -> web.Response:
        return await self._weights_call(
            lambda: self.distributed_updates.handle(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                load_format=body.load_format,
                weight_version=body.weight_version,
                target=target,
                set_version=self._set_version,
            ),
            body.abort_all_requests,
        )

    async def p2p_weights(self, request: web.Request) -> web.Response:
        """``POST /miles/p2p_weights`` (Miles's extension serving the ``p2p_weights`` capability;
        SGLang has no NIXL receiver endpoint): build (once per sender: options and address) the
        p2p transport's NIXL receiver, receive one update into the model, all or nothing, and
        take its version. A receiver of an earlier sender is closed."""
        body = await parse_body(request, P2PWeightsRequest)
        key = json.dumps([body.options, body.address], sort_keys=True, default=str)
        receiver = self.receivers.get(key)
        if receiver is None:
            try:
                from miles_core import Kind
                from miles_core.plugins import load_plugins

                record = load_plugins().registry.get(Kind.TRANSPORT, "p2p")
                options = record.config.model_validate(body.options) if record.config else None
                factory = record.load_receiver()
            except Exception as exc:
                raise BadRequest(f"cannot build the p2p receiver: {exc}") from None
            receiver = await asyncio.to_thread(factory, options, tuple(body.address), 1)
            for old_key in list(self.receivers):
                old = self.receivers.pop(old_key)
                try:
                    await asyncio.to_thread(old.close)
                except Exception as exc:  # a dead peer's connection: nothing to keep
                    log.warning("closing the old p2p receiver: %s", exc)
            self.receivers[key] = receiver
        try:
            target = (
                self._target()
                if body.lora_name is None
                else self._adapter_target(body.lora_name, body.config_dict)
            )
            version = await asyncio.to_thread(receiver.receive, target)
        except Exception as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to receive weights: {exc!r}"}, status=400
            )
        await asyncio.to_thread(self._set_version, str(version))
        return web.json_response(
            {"success": True, "message": "Weights received.", "weight_version": str(version)}
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version``: set the version without touching the weights."""
        from miles_transport_common.engine_side import check_version
        from miles_transport_common.errors import BucketRejected

        body = await parse_body(request, UpdateWeightVersionRequest)
        try:
            check_version(body.new_version)
        except BucketRejected as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)

        def upd(e: Engine) -> None:
            if body.abort_all_requests:
                e.abort(None, "aborted for a weight version update")
            e.holder.weight_version = body.new_version

        await self._call(upd)
        return web.json_response(
            {"success": True, "message": "Weight version updated", "new_version": body.new_version}
        )

    # --- LoRA adapters -------------------------------------------------------------------

    def _lora_answer(self, error: str | None, loaded: dict[str, str]) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: 200 on success, 400 with ``error_message``."""
        return web.json_response(
            {"success": error is None, "error_message": error, "loaded_adapters": loaded},
            status=200 if error is None else 400,
        )

    def _loaded(self) -> dict[str, str]:
        lora = self.holder.lora
        return dict(lora.paths) if lora is not None else {}

    async def _install(
        self,
        name: str,
        load: Callable[[], tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]],
        *,
        path: str,
        pinned: bool,
        replace: bool = False,
    ) -> web.Response:
        """Read an adapter off the event loop, then check and install it on the engine's
        thread (all or nothing); a name already loaded is refused, as SGLang does, unless
        ``replace`` (a weight transport's update of the adapter: the requests using it go on
        with the new one, as after a model update)."""
        if self.holder.lora is None:
            return self._lora_answer("LoRA is not enabled (start the server with enable_lora)", {})
        if name in self.unloading or (name in self.holder.lora.adapters and not replace):
            return self._lora_answer(
                f"lora_name: LoRA adapter {name!r} is already loaded; unload it first",
                self._loaded(),
            )
        try:
            config, named = await asyncio.to_thread(load)

            def install(e: Engine) -> dict[str, str]:
                lora = e.holder.lora
                assert lora is not None
                if name in lora.adapters and not replace:
                    raise LoraError(
                        f"lora_name: LoRA adapter {name!r} is already loaded; unload it first"
                    )
                e.holder.set_adapter(name, config, named, path=path, pinned=pinned)
                return dict(lora.paths)

            loaded = await self._call(install)
        except (LoraError, ValueError, OSError, KeyError, TypeError) as exc:
            return self._lora_answer(str(exc), self._loaded())
        except Exception as exc:  # a payload that does not unpickle, say
            return self._lora_answer(f"cannot load the adapter: {exc!r}", self._loaded())
        return self._lora_answer(None, loaded)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """``POST /load_lora_adapter``: load a PEFT ``save_pretrained`` folder as
        ``lora_name``."""
        body = await parse_body(request, LoadLoRAAdapterRequest)
        return await self._install(
            body.lora_name,
            lambda: read_adapter_folder(body.lora_path),
            path=body.lora_path,
            pinned=body.pinned,
        )

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """``POST /load_lora_adapter_from_tensors``: an adapter from PEFT-named tensors
        serialized as for ``/update_weights_from_tensor`` (a list or dict of (name, tensor), or
        with ``load_format: flattened_bucket`` one bucket item)."""
        body = await parse_body(request, LoadLoRAAdapterFromTensorsRequest)
        # A Miles header on the bucket (the colocated transport's, which SGLang ignores):
        # the bucket's checksum is verified, and the adapter replaces one of its name.
        replace = False

        def read() -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
            nonlocal replace
            from miles_transport_common.bucketing import Manifest
            from miles_transport_common.checksum import bucket_checksum
            from miles_transport_common.payload import deserialize, read_bucket, reconstruct

            item = deserialize(body.item)
            if body.load_format == "flattened_bucket":
                flat, meta, header = read_bucket(item)
                if header is not None and header.get("op") == "adapter":
                    manifest = Manifest.from_json(header["manifest"])
                    got = bucket_checksum(flat, manifest.pieces)
                    if got != manifest.checksum:
                        raise LoraError(
                            f"serialized_named_tensors: the bucket's checksum {got} is not the "
                            f"sender's {manifest.checksum}: it changed on the way"
                        )
                    replace = True
                named = [(n, t.clone()) for n, t in reconstruct(flat, meta)]
            elif isinstance(item, dict):
                named = list(item.items())
            elif isinstance(item, (list, tuple)):
                named = [tuple(x) for x in item]
            else:
                raise LoraError(
                    "serialized_named_tensors: the item must be a list or dict of "
                    f"(name, tensor), or a flattened bucket; got {type(item).__name__}"
                )
            if not all(len(x) == 2 and isinstance(x[0], str) for x in named):
                raise LoraError("serialized_named_tensors: every entry must be (name, tensor)")
            return dict(body.config_dict), named  # type: ignore[return-value]

        if self.holder.lora is not None and body.lora_name in self.holder.lora.adapters:
            # Whether this is a transport's replacement is known once the item is read.
            try:
                config, named = await asyncio.to_thread(read)
            except (LoraError, ValueError, KeyError, TypeError) as exc:
                return self._lora_answer(str(exc), self._loaded())
            return await self._install(
                body.lora_name,
                lambda: (config, named),
                path="__tensor__",
                pinned=body.pinned,
                replace=replace,
            )
        return await self._install(
            body.lora_name, read, path="__tensor__", pinned=body.pinned, replace=replace
        )

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``POST /unload_lora_adapter``: new requests naming it are refused at once; it is
        dropped when the requests already using it have finished (SGLang waits likewise)."""
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        lora = self.holder.lora
        if lora is None:
            return self._lora_answer("LoRA is not enabled (start the server with enable_lora)", {})
        name = body.lora_name
        if name not in lora.adapters or name in self.unloading:
            return self._lora_answer(f"lora_name: {lora.not_loaded(name)}", self._loaded())
        self.unloading.add(name)
        try:
            while await self._call(lambda e: e.lora_in_use(name)):
                await asyncio.sleep(0.01)

            def remove(e: Engine) -> dict[str, str]:
                assert e.holder.lora is not None
                e.holder.lora.remove(name)
                return dict(e.holder.lora.paths)

            loaded = await self._call(remove)
        finally:
            self.unloading.discard(name)
        return self._lora_answer(None, loaded)

    # --- memory -----------------------------------------------------------------------------

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """``POST /release_memory_occupation``: free the KV cache (running requests are
        retracted and wait); on an accelerator, ``weights`` moves the weights to the CPU."""
        body = await parse_body(request, MemoryOccupationRequest)
        tags = set(body.tags or ["kv_cache", "weights"])

        def release(e: Engine) -> None:
            if "kv_cache" in tags or "weights" in tags:
                e.release_kv()
            if "weights" in tags:
                e.weights_released = True
                if e.holder.device.type != "cpu":
                    e.holder.model.to("cpu")
                    e.holder.rebuild()

        await self._call(release)
        return web.json_response({"success": True, "message": "Memory released."})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """``POST /resume_memory_occupation``."""
        body = await parse_body(request, MemoryOccupationRequest)
        tags = set(body.tags or ["kv_cache", "weights"])

        def resume(e: Engine) -> None:
            if "weights" in tags and e.weights_released:
                e.holder.model.to(e.holder.device)
                e.holder.rebuild()
                e.weights_released = False
            if "kv_cache" in tags:
                e.resume_kv()

        await self._call(resume)
        return web.json_response({"success": True, "message": "Memory resumed."})

    # --- health and info --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while the scheduler thread is alive."""
        if not self.engine.alive:
            return error_response("engine scheduler is not running", 503)
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """``GET /health_generate``: generate one token end to end (200 at once while paused
        or released, when no token can be generated by design)."""
        state = await self._call(lambda e: e.paused or e.kv_released or e.weights_released)
        if state:
            return web.Response(text="")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Request] = loop.create_future()
        req = Request(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=False,
            on_done=lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)),
            uniforms=self.engine.new_stream(0),
        )
        self.engine.submit(req)
        try:
            done = await asyncio.wait_for(fut, timeout=20)
        except asyncio.TimeoutError:
            self.engine.call(lambda e: e.abort(req.rid))
            return error_response("health generation timed out", 503)
        if (done.finish_reason or {}).get("type") == "abort":
            return error_response(f"health generation aborted: {done.finish_reason}", 503)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info``: the model, and the weight version it serves now (where
        SGLang 0.5.23 publishes the version a weight update set)."""
        return web.json_response(
            {
                "model_path": self.holder.model_path,
                "served_model_name": self.holder.model_path,
                # SGLang's tokenizer_path defaults to the model path.
                "tokenizer_path": self.server_args.get("tokenizer_path") or self.holder.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.holder.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(self.holder.model.config, "model_type", None),
                "architectures": getattr(self.holder.model.config, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /server_info``: server arguments plus live scheduler state."""
        e = self.engine
        info = dict(self.server_args)
        info.update(
            {
                # The names SGLang's /server_info reports these under.
                "served_model_name": self.holder.model_path,
                "tokenizer_path": info.get("tokenizer_path") or self.holder.model_path,
                "max_context_length": e.context_length,
                "max_total_num_tokens": e.max_total_tokens,
                "max_req_input_len": e.context_length - 1,
                "version": "miles-embedded",
                "weight_version": self.holder.weight_version,
                "loaded_lora_adapters": self._loaded(),
                "internal_states": [
                    {
                        "running_requests": len(e.running),
                        "waiting_requests": len(e.waiting),
                        "paused": e.paused,
                        "kv_cache_released": e.kv_released,
                        "weights_released": e.weights_released,
                        "decode_steps": e.steps,
                        "generated_tokens": e.generated_tokens,
                        "prefill_tokens_forwarded": e.prefill_forwarded,
                        "prefill_tokens_shared": e.prefill_shared,
                        "scoring_requests": len(e.scoring),
                        "score_tokens_forwarded": e.score_forwarded,
                        "kv_cache_length": e.cache.length,
                        "last_error": e.last_error,
                    }
                ],
                "uptime_s": time.time() - self.started,
            }
        )
        return web.json_response(info)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the server."""
    p = argparse.ArgumentParser(prog="python -m miles_engine_embedded.server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--port-file",
        default=None,
        help="write the bound port to this file (with --port 0: the port the kernel picked)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=120.0,
        help="seconds every wait of a weight-update group may block (SGLang's --dist-timeout)",
    )
    p.add_argument(
        "--max-weights-body-mb",
        type=float,
        default=WEIGHTS_BODY_LIMIT >> 20,
        help="largest body (MiB) of the weight-update and LoRA adapter endpoints; a body "
        "declared larger is refused (413) before it is read",
    )
    p.add_argument(
        "--no-lean-forward", action="store_true", help="always use the model's own forward"
    )
    p.add_argument(
        "--matmul",
        choices=("auto", "linear", "transposed"),
        default="auto",
        help="layout of the lean forward's dense products (auto: measured at start)",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "native", "sdpa"),
        default="auto",
        help="the lean forward's decode attention, and with it the native element-wise steps "
        "and draw (auto: the native kernels where they apply and build, else SDPA)",
    )
    p.add_argument(
        "--true-on-policy",
        action="store_true",
        help="batch-invariant kernels (miles_core.invariant): a token's log-prob is bitwise the "
        "one a trainer's teacher-forced forward in the same mode computes, whatever the batch",
    )
    p.add_argument(
        "--allow-nonfinite-weights",
        action="store_true",
        help="accept weight updates holding NaN or infinite values (refused by default)",
    )
    # SGLang's LoRA flags
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-paths", nargs="*", default=None, help="name=path or path")
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    return p


def build_engine(args: argparse.Namespace, lora: dict[str, Any] | None) -> Engine:
    """Load the model (and the adapters of ``--lora-paths``) and make the scheduler."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    holder = ModelHolder(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        weight_version=args.weight_version,
        lean_forward=not args.no_lean_forward,  # never in true on-policy mode (the holder)
        matmul=args.matmul,
        attention=args.attention,
        lora=lora,
        invariant=args.true_on_policy,
        allow_nonfinite_weights=args.allow_nonfinite_weights,
    )
    for name, path in parse_lora_paths(args.lora_paths or []):
        config, named = read_adapter_folder(path)
        holder.set_adapter(name, config, named, path=path)
    cfg = holder.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    model_max = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
    context_length = min(args.context_length or model_max, model_max)
    max_total = args.max_total_tokens or args.max_running_requests * context_length
    return Engine(
        holder,
        max_running_requests=args.max_running_requests,
        max_total_tokens=max(max_total, context_length),
        context_length=context_length,
        seed=args.seed,
        invariant=args.true_on_policy,
    )


def start_compute_thread(build: Callable[[], Engine]) -> Engine:
    """Build the engine on a thread of its own, which then runs the scheduler loop; returns
    the engine once built (a failure to build is raised here).

    Loading the model and every forward run on that one thread, so the process has one
    OpenMP thread pool: a second pool (the main thread's, had it loaded the model) makes
    libgomp throttle its idle spinning once its threads outnumber the cores, and each of the
    hundreds of parallel regions of a decode step then waits for a sleeping worker. Measured
    on 2 cores: the same workload 11-20% slower with the model loaded on the main thread."""
    ready: queue.Queue[Engine | BaseException] = queue.Queue()

    def compute() -> None:
        try:
            engine = build()
        except BaseException as exc:
            ready.put(exc)
            return
        engine.run(on_start=lambda: ready.put(engine))

    threading.Thread(target=compute, name="engine-scheduler", daemon=True).start()
    got = ready.get()
    if isinstance(got, BaseException):
        raise got
    return got


def true_on_policy_refusal(args: argparse.Namespace) -> str | None:
    """Why the server cannot run in true on-policy mode with ``args``, or None."""
    from miles_core.invariant import unsupported

    if args.dtype.removeprefix("torch.") != "float32":
        return f"needs --dtype float32 (the trainer's dtype), got {args.dtype}"
    if args.enable_lora or args.lora_paths:
        return "LoRA adapters are not covered by the batch-invariant kernels"
    try:
        with open(os.path.join(args.model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return f"cannot read the model's config.json: {exc}"
    return unsupported(config)


def main(argv: list[str] | None = None) -> None:
    """Load the model and serve until terminated."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    if args.lora_paths:
        args.enable_lora = True  # as SGLang: adapters to load imply LoRA
    for flag in ("max_lora_rank", "max_loras_per_batch", "max_loaded_loras"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    lora = (
        dict(
            max_lora_rank=args.max_lora_rank,
            max_loras_per_batch=args.max_loras_per_batch,
            max_loaded_loras=args.max_loaded_loras,
            target_modules=args.lora_target_modules,
        )
        if args.enable_lora
        else None
    )
    if args.true_on_policy:
        refusal = true_on_policy_refusal(args)
        if refusal:
            raise SystemExit(f"--true-on-policy: {refusal}")
    # bound before the model loads: the port is this server's from here on
    sock = bind_listening(args.host, args.port, args.port_file)
    engine = start_compute_thread(lambda: build_engine(args, lora))
    tokenizer = None
    tok_path = args.tokenizer_path or args.model_path
    if os.path.exists(os.path.join(tok_path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_path)
    server_args = {k: v for k, v in vars(args).items()}
    server_args.update(
        port=sock.getsockname()[1],
        context_length=engine.context_length,
        max_total_tokens=engine.max_total_tokens,
        tokenizer_path=tok_path if tokenizer is not None else None,
        lean_forward=engine.holder.lean is not None,
        # what auto chose: the layout from each batch size on
        matmul_plan=engine.holder.lean.plan.describe() if engine.holder.lean else None,
        # what auto chose: the decode attention of the lean forward (None: no lean forward)
        decode_attention=(
            ("native" if engine.holder.lean.native else "sdpa") if engine.holder.lean else None
        ),
        lora_target_modules=list(engine.holder.lora.target_modules) if engine.holder.lora else None,
    )
    server = Server(engine, tokenizer=tokenizer, server_args=server_args)
    web.run_app(
        server.app(),
        sock=sock,
        print=None,
        handler_cancellation=True,
        access_log=None,
    )


if __name__ == "__main__":
    main()
