"""The routes of the weight transports whose engine side is not an SGLang endpoint: each
installed transport record that declares a ``receiver_route`` (and its ``receiver_factory``)
gets that route, where the engine builds the transport's receiver and takes updates through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web

from miles_core import Component, Transport
from miles_engine_embedded.protocol import ReceiverUpdateRequest
from miles_engine_embedded.routing import BadRequest, Route, parse_body
from miles_engine_embedded.weight_routes import WeightRoutes

log = logging.getLogger("miles_engine_embedded")


class ReceiverRoutes:
    """The route of one transport's receiver: ``POST record.receiver_route`` builds (once per
    sender: options and address) the receiver ``record.load_receiver()`` makes, receives one
    update into the model (or the adapter the body names), all or nothing, and takes its
    version. A receiver of an earlier sender is closed."""

    def __init__(self, record: Transport, *, weights: WeightRoutes) -> None:
        self.record = record
        self.weights = weights
        #: the receiver of the current sender, by its options and address
        self.receivers: dict[str, Any] = {}

    def routes(self) -> Sequence[Route]:
        """The transport's receiver route."""
        return (Route("POST", self.record.receiver_route, "receive", "weights"),)

    async def _receiver(self, body: ReceiverUpdateRequest) -> Any:
        """The receiver connected to the body's sender, built (and the older one closed)
        when the sender is new."""
        key = json.dumps([body.options, body.address], sort_keys=True, default=str)
        receiver = self.receivers.get(key)
        if receiver is not None:
            return receiver
        record = self.record
        try:
            options = record.config.model_validate(body.options) if record.config else None
            factory = record.load_receiver()
        except Exception as exc:
            raise BadRequest(f"cannot build the {record.name} receiver: {exc}") from None
        receiver = await asyncio.to_thread(factory, options, tuple(body.address), 1)
        for old_key in list(self.receivers):
            old = self.receivers.pop(old_key)
            try:
                await asyncio.to_thread(old.close)
            except Exception as exc:  # a dead peer's connection: nothing to keep
                log.warning("closing the old %s receiver: %s", record.name, exc)
        self.receivers[key] = receiver
        return receiver

    async def receive(self, request: web.Request) -> web.Response:
        """``POST <receiver_route>`` (Miles's extension serving the transport's engine
        capability; SGLang has no such endpoint): receive one update through the transport's
        receiver."""
        body = await parse_body(request, ReceiverUpdateRequest)
        receiver = await self._receiver(body)
        try:
            target = (
                self.weights.target()
                if body.lora_name is None
                else self.weights.adapter_target(body.lora_name, body.config_dict)
            )
            version = await asyncio.to_thread(receiver.receive, target)
        except Exception as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to receive weights: {exc!r}"}, status=400
            )
        await asyncio.to_thread(self.weights.set_version, str(version))
        return web.json_response(
            {"success": True, "message": "Weights received.", "weight_version": str(version)}
        )


def receiver_records(records: Iterable[Component] | None = None) -> list[Transport]:
    """The transport records among ``records`` (default: the installed ones) that declare
    a receiver route, by name."""
    if records is None:
        from miles_core import Kind
        from miles_core.plugins import load_plugins

        records = load_plugins().registry.all(Kind.TRANSPORT)
    return sorted(
        (
            r
            for r in records
            if isinstance(r, Transport) and r.receiver_route and r.receiver_factory
        ),
        key=lambda r: r.name,
    )


def receiver_routes(
    weights: WeightRoutes, records: Iterable[Component] | None = None
) -> list[ReceiverRoutes]:
    """One :class:`ReceiverRoutes` for each transport record declaring a receiver route
    (:func:`receiver_records`)."""
    return [ReceiverRoutes(record, weights=weights) for record in receiver_records(records)]
