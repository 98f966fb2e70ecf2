"""The weight-update endpoints of the embedded server: SGLang's (from disk, from tensors, by a
broadcast group) and the version call. Each commit runs between two scheduler steps."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from aiohttp import web

from miles_engine_embedded.engine import Engine
from miles_engine_embedded.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from miles_engine_embedded.routing import BadRequest, Route, on_engine, parse_body

log = logging.getLogger("miles_engine_embedded")


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


class WeightRoutes:
    """SGLang's weight-update endpoints over one engine (anything with ``call``, ``abort``
    and a ``holder`` of :class:`~miles_engine_embedded.weights.ModelHolder`'s loading API),
    and the commits other route groups reuse: :meth:`target`, :meth:`adapter_target`,
    :meth:`set_version`, :meth:`weights_call`."""

    ROUTES: ClassVar[tuple[Route, ...]] = (
        Route("POST", "/update_weights_from_disk", "update_weights_from_disk", "weights"),
        Route("POST", "/init_weights_update_group", "init_weights_update_group"),
        Route(
            "POST",
            "/update_weights_from_distributed",
            "update_weights_from_distributed",
            "weights",
        ),
        Route("POST", "/update_weights_from_tensor", "update_weights_from_tensor", "weights"),
        Route("POST", "/update_weight_version", "update_weight_version"),
    )

    def __init__(self, engine: Any, *, server_args: dict[str, Any]) -> None:
        from miles_transport_common.engine_side import DistributedUpdates, TensorUpdates

        self.engine = engine
        self.holder = engine.holder
        self.server_args = server_args
        # the engine side of the colocated and broadcast transports (SGLang's endpoints with
        # per-bucket verification and all-or-nothing commits)
        self.tensor_updates = TensorUpdates(str(self.holder.device.type))
        self.distributed_updates = DistributedUpdates(str(self.holder.device.type))

    def routes(self) -> Sequence[Route]:
        """The endpoints of this group."""
        return self.ROUTES

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
            n, _ = await on_engine(self.engine, apply)
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

    def target(self) -> Any:
        """The served model as a transport's staging layer loads into it: ``load`` copies and
        ``adopt`` serves from the given tensors, each between two scheduler steps; ``read``
        gives the parameters served now, by name, so every commit checks that the model serves
        exactly the tensors the trainer sent (``miles_transport_common.served``)."""
        from miles_transport_common.staging import ServedTarget

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            self.engine.call(lambda e: e.holder.load_named(named)).result()

        def adopt(named: list[tuple[str, torch.Tensor]]) -> None:
            self.engine.call(lambda e: e.holder.adopt_named(named)).result()

        def read(names: Sequence[str]) -> dict[str, torch.Tensor]:
            params = self.holder.params  # read after the load returned: the model's now
            return {n: params[n].detach() for n in names if n in params}

        return ServedTarget(load=load, read=read, adopt=adopt)

    def adapter_target(self, name: str, config: dict[str, object] | None) -> Any:
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

    def set_version(self, version: str | None) -> None:
        """Set the served weight version, between two scheduler steps (blocking)."""
        self.engine.call(lambda e: e.holder.bump_version(version)).result()

    async def weights_call(self, fn: Callable[[], dict[str, Any]], abort_all: bool) -> web.Response:
        """Run a blocking weight-update step off the event loop; a refused one is a 400 with
        ``success: false`` (the served weights and version unchanged)."""
        from miles_transport_common.errors import BucketRejected

        if abort_all:
            await on_engine(self.engine, lambda e: e.abort(None, "aborted for a weight update"))
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
        return await self.weights_call(
            lambda: self.tensor_updates.handle(
                body.serialized_named_tensors,
                self.target(),
                load_format=body.load_format,
                weight_version=body.weight_version,
                set_version=self.set_version,
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

        return await self.weights_call(join, False)

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
        return await self.distributed(body, self.target())

    async def distributed(
        self, body: UpdateWeightsFromDistributedRequest, target: Any
    ) -> web.Response:
        """Run one ``/update_weights_from_distributed``-shaped call committing into
        ``target`` (the model, or an adapter)."""
        return await self.weights_call(
            lambda: self.distributed_updates.handle(
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                group_name=body.group_name,
                load_format=body.load_format,
                weight_version=body.weight_version,
                target=target,
                set_version=self.set_version,
            ),
            body.abort_all_requests,
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

        await on_engine(self.engine, upd)
        return web.json_response(
            {"success": True, "message": "Weight version updated", "new_version": body.new_version}
        )
