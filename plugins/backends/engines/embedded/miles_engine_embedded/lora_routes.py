"""The LoRA adapter endpoints of the embedded server: SGLang's load / unload calls, and
Miles's broadcast update committed into an adapter (``lora_weight_updates``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from aiohttp import web

from miles_engine_embedded.engine import Engine
from miles_engine_embedded.lora import LoraError, read_adapter_folder
from miles_engine_embedded.protocol import (
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    UpdateLoraFromDistributedRequest,
)
from miles_engine_embedded.routing import Route, on_engine, parse_body
from miles_engine_embedded.weight_routes import WeightRoutes

#: Miles's extension: a broadcast update committed into a LoRA adapter (``lora_weight_updates``)
LORA_DISTRIBUTED_PATH = "/miles/update_lora_from_distributed"

Named = list[tuple[str, torch.Tensor]]


def read_tensor_adapter(
    body: LoadLoRAAdapterFromTensorsRequest,
) -> tuple[dict[str, Any], Named, bool]:
    """The config and named tensors of ``/load_lora_adapter_from_tensors``'s item, and whether
    it carries a Miles header (the colocated transport's, which SGLang ignores): the bucket's
    checksum is then verified, and the adapter replaces one of its name."""
    from miles_transport_common.bucketing import Manifest
    from miles_transport_common.checksum import bucket_checksum
    from miles_transport_common.payload import deserialize, read_bucket, reconstruct

    replace = False
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
    return dict(body.config_dict), named, replace  # type: ignore[return-value]


class LoraRoutes:
    """SGLang's LoRA adapter endpoints over one engine, and the broadcast update committed
    into an adapter (through ``weights``' group protocol). ``unloading`` is the set of adapters
    being unloaded, shared with the generation endpoints that refuse requests naming one."""

    ROUTES: ClassVar[tuple[Route, ...]] = (
        Route("POST", LORA_DISTRIBUTED_PATH, "update_lora_from_distributed", "weights"),
        Route("POST", "/load_lora_adapter", "load_lora_adapter", "weights"),
        Route(
            "POST", "/load_lora_adapter_from_tensors", "load_lora_adapter_from_tensors", "weights"
        ),
        Route("POST", "/unload_lora_adapter", "unload_lora_adapter"),
    )

    def __init__(self, engine: Engine, *, weights: WeightRoutes, unloading: set[str]) -> None:
        self.engine = engine
        self.holder = engine.holder
        self.weights = weights
        #: adapters being unloaded: refused to new requests, dropped once none uses them
        self.unloading = unloading

    def routes(self) -> Sequence[Route]:
        """The endpoints of this group."""
        return self.ROUTES

    async def update_lora_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /miles/update_lora_from_distributed`` (Miles's extension serving the
        ``lora_weight_updates`` capability): ``/update_weights_from_distributed``'s body and
        protocol plus ``lora_name`` and ``config_dict``; the commit replaces (or loads) that
        adapter, checked whole then, instead of model weights."""
        body = await parse_body(request, UpdateLoraFromDistributedRequest)
        target = self.weights.adapter_target(body.lora_name, body.config_dict)
        return await self.weights.distributed(body, target)

    def lora_answer(self, error: str | None, loaded: dict[str, str]) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: 200 on success, 400 with ``error_message``."""
        return web.json_response(
            {"success": error is None, "error_message": error, "loaded_adapters": loaded},
            status=200 if error is None else 400,
        )

    def loaded(self) -> dict[str, str]:
        """``{name: path}`` of the adapters loaded now."""
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
            return self.lora_answer("LoRA is not enabled (start the server with enable_lora)", {})
        if name in self.unloading or (name in self.holder.lora.adapters and not replace):
            return self.lora_answer(
                f"lora_name: LoRA adapter {name!r} is already loaded; unload it first",
                self.loaded(),
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

            loaded = await on_engine(self.engine, install)
        except (LoraError, ValueError, OSError, KeyError, TypeError) as exc:
            return self.lora_answer(str(exc), self.loaded())
        except Exception as exc:  # a payload that does not unpickle, say
            return self.lora_answer(f"cannot load the adapter: {exc!r}", self.loaded())
        return self.lora_answer(None, loaded)

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
        if self.holder.lora is not None and body.lora_name in self.holder.lora.adapters:
            # Whether this is a transport's replacement is known once the item is read.
            try:
                config, named, replace = await asyncio.to_thread(read_tensor_adapter, body)
            except (LoraError, ValueError, KeyError, TypeError) as exc:
                return self.lora_answer(str(exc), self.loaded())
            return await self._install(
                body.lora_name,
                lambda: (config, named),
                path="__tensor__",
                pinned=body.pinned,
                replace=replace,
            )
        return await self._install(
            body.lora_name,
            lambda: read_tensor_adapter(body)[:2],
            path="__tensor__",
            pinned=body.pinned,
        )

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``POST /unload_lora_adapter``: new requests naming it are refused at once; it is
        dropped when the requests already using it have finished (SGLang waits likewise)."""
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        lora = self.holder.lora
        if lora is None:
            return self.lora_answer("LoRA is not enabled (start the server with enable_lora)", {})
        name = body.lora_name
        if name not in lora.adapters or name in self.unloading:
            return self.lora_answer(f"lora_name: {lora.not_loaded(name)}", self.loaded())
        self.unloading.add(name)
        try:
            while await on_engine(self.engine, lambda e: e.lora_in_use(name)):
                await asyncio.sleep(0.01)

            def remove(e: Engine) -> dict[str, str]:
                assert e.holder.lora is not None
                e.holder.lora.remove(name)
                return dict(e.holder.lora.paths)

            loaded = await on_engine(self.engine, remove)
        finally:
            self.unloading.discard(name)
        return self.lora_answer(None, loaded)
