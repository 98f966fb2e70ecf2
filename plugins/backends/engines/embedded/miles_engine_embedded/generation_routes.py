"""The generation endpoints of the embedded server: ``/generate`` and the control calls that
steer the scheduler (abort, pause, continue, flush)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

from aiohttp import web

from miles_engine_embedded.engine import Engine, EngineError, Request
from miles_engine_embedded.protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    GenerateRequest,
    PauseGenerationRequest,
    SamplingParams,
)
from miles_engine_embedded.routing import BadRequest, Route, on_engine, parse_body

FLUSH_MESSAGE = (
    "Please check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


class GenerationRoutes:
    """``/generate`` over the continuous-batching engine, and the calls that pause, resume,
    abort and flush it. ``unloading`` is the set of adapters being unloaded (shared with the
    LoRA endpoints): a request naming one is refused."""

    ROUTES: ClassVar[tuple[Route, ...]] = (
        Route("POST", "/generate", "generate", "generate"),
        Route("POST", "/abort_request", "abort_request"),
        Route("POST", "/pause_generation", "pause_generation"),
        Route("POST", "/continue_generation", "continue_generation"),
        Route("*", "/flush_cache", "flush_cache"),
    )

    def __init__(self, engine: Engine, *, tokenizer: Any, unloading: set[str]) -> None:
        self.engine = engine
        self.holder = engine.holder
        self.tokenizer = tokenizer
        self.unloading = unloading
        #: the rids of the requests running now (a second request with one is refused)
        self.inflight: set[str] = set()

    def routes(self) -> Sequence[Route]:
        """The endpoints of this group."""
        return self.ROUTES

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

    def _inputs(self, body: GenerateRequest) -> tuple[list[list[int]], bool]:
        """The token ids of each input, and whether the body is a single request."""
        if body.text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer: send input_ids")
            texts = [body.text] if isinstance(body.text, str) else body.text
            seqs = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
            return seqs, isinstance(body.text, str)
        ids = body.input_ids or []
        if ids and isinstance(ids[0], list):
            return [list(x) for x in ids], False  # type: ignore[arg-type]
        return [list(ids)], True  # type: ignore[arg-type]

    def _rids(self, body: GenerateRequest, n: int, single: bool) -> list[str]:
        """The rid of each of the ``n`` inputs (drawn where the body gives none)."""
        if body.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(body.rid, str):
            if not single:
                raise BadRequest("a batch needs one rid per input")
            rids = [body.rid]
        else:
            if single or len(body.rid) != n:
                raise BadRequest("rid must be a list of one id per input")
            rids = list(body.rid)
        if len(set(rids)) != len(rids) or any(r in self.inflight for r in rids):
            raise BadRequest("a request with this rid is already running")
        return rids

    def _batch(
        self, body: GenerateRequest
    ) -> tuple[list[list[int]], list[SamplingParams], list[str], bool]:
        seqs, single = self._inputs(body)
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
        return seqs, params, self._rids(body, len(seqs), single), single

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
        await on_engine(self.engine, lambda e: e.abort(rid))
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

        await on_engine(self.engine, pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation`` (``torch_empty_cache`` is accepted; the CPU engine
        has no allocator cache to empty)."""
        await parse_body(request, ContinueGenerationRequest)

        def cont(e: Engine) -> None:
            e.paused = False

        await on_engine(self.engine, cont)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: succeeds only when no request is running or waiting, and then
        frees the KV cache (allocated again, as long as needed, by the next request)."""
        if request.method not in ("GET", "POST"):
            raise BadRequest("use GET or POST", 405)
        ok = await on_engine(self.engine, lambda e: e.flush())
        if ok:
            return web.Response(text="Cache flushed.\n" + FLUSH_MESSAGE)
        return web.Response(text="Cache not flushed.\n" + FLUSH_MESSAGE, status=400)
