"""The engine client: one method per SGLang-native endpoint Miles uses.

Requests and responses follow SGLang's shapes (``/generate`` with ``input_ids`` and
``sampling_params``; ``meta_info`` with ``finish_reason``, ``output_token_logprobs`` and
``weight_version``), so the same code drives a real SGLang server and the embedded engine.
Paths and body fields are those of SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``
and the request structs of ``sglang/srt/managers/io_struct.py``); the tests check every
request this client sends against them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from miles_core.data import RoutedExperts
from miles_engine_client.connection import EngineAuthError, EngineConnection, EngineHTTPError

__all__ = [
    "PAUSE_MODES",
    "EngineAuthError",
    "EngineClient",
    "EngineConnection",
    "EngineHTTPError",
    "GenerateResult",
    "decode_routed_experts",
]

#: SGLang's pause modes (``PauseGenerationReqInput.mode`` at 0.5.23).
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class GenerateResult:
    """One finished generation.

    Attributes:
        rid: the request id.
        output_ids: generated token ids (a matched stop token included, as SGLang returns it).
        logprobs: log-prob of each generated token (empty unless ``return_logprob``).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        matched_stop: the stop token id that ended it, if any.
        weight_version: the engine's weight version stamped on the response (``""`` when
            the server stamped none).
        prompt_tokens / completion_tokens: token counts from ``meta_info``.
        routed_experts: with ``return_routed_experts``, SGLang's ``meta_info["routed_experts"]``
            decoded into a compact :class:`miles_core.data.RoutedExperts`: one row per
            forwarded position (``prompt_tokens + completion_tokens - 1`` rows: the last
            generated token is never forwarded), each the top-k expert ids of every layer in
            order (``num_hidden_layers * k`` ids); None when not asked.
        raw: the full JSON answer.
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched_stop: int | str | None
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    routed_experts: RoutedExperts | None = field(default=None, repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerateResult:
        """Parse one ``/generate`` answer."""
        meta = data.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        lps = meta.get("output_token_logprobs") or []
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=list(data.get("output_ids", [])),
            logprobs=[float(x[0]) for x in lps],
            finish_reason=str(reason.get("type", "")),
            matched_stop=reason.get("matched"),
            weight_version=_version_text(meta.get("weight_version")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(data.get("output_ids", [])))),
            text=str(data.get("text", "")),
            raw=dict(data),
            routed_experts=decode_routed_experts(
                meta.get("routed_experts"),
                int(meta.get("prompt_tokens", 0)) + int(meta.get("completion_tokens", 0)) - 1,
            ),
        )


def decode_routed_experts(payload: str | None, positions: int) -> RoutedExperts | None:
    """SGLang's ``routed_experts`` (base64 of little-endian int32 ``[positions, layers, k]``)
    as a compact record of ``positions`` rows of ``layers * k`` ids; None for no payload."""
    if payload is None:
        return None
    return RoutedExperts.from_sglang(payload, positions)


class EngineClient(EngineConnection):
    """Async client of one engine server at ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    Use as ``async with EngineClient(url) as c: ...`` or call :meth:`close`; the connection
    (one aiohttp session, retries, errors) is
    :class:`~miles_engine_client.connection.EngineConnection`'s.
    """

    # --- generation -------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        lora_path: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """``POST /generate`` for one token-id prompt; ``lora_path`` names the LoRA adapter
        to serve it with (SGLang's field; None: the base model); ``return_routed_experts``
        asks for the experts every position was routed to (an MoE model's)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        if return_routed_experts:
            body["return_routed_experts"] = True
        return GenerateResult.from_json(await self.request("POST", "/generate", body))

    async def input_logprobs(self, input_ids: Sequence[int], *, start: int) -> list[float]:
        """Log-probs of the tokens at positions ``start..len(input_ids)-1`` of ``input_ids``,
        each given the tokens before it (a teacher scoring a student's tokens): SGLang's
        prompt log-prob path of ``POST /generate`` (``max_new_tokens: 0``, ``return_logprob``,
        ``logprob_start_len``), no token generated. ``start`` must be in ``[1, len]``;
        otherwise ``ValueError`` before anything is sent.

        SGLang 0.5.23 answers ``input_token_logprobs`` for positions ``logprob_start_len`` to
        the end with a null log-prob at ``logprob_start_len`` itself (it keeps no logits
        before it), whereas the embedded engine fills that one when it can: the request
        starts one position early and the last ``len - start`` entries are taken, which are
        the same on both. Fewer entries, or a null among them (an aborted request, say),
        raise :class:`EngineHTTPError`."""
        ids = list(input_ids)
        if not 1 <= start <= len(ids):
            raise ValueError(
                f"start must be in [1, {len(ids)}] (the token at position 0 has no log-prob), "
                f"got {start}"
            )
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        return _input_logprobs(await self.request("POST", "/generate", body), len(ids), start)

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """``POST /abort_request``: abort ``rid`` (or everything with ``abort_all``)."""
        await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> Any:
        """``POST /pause_generation`` with mode ``abort``, ``retract`` or ``in_place``
        (SGLang's ``PauseGenerationReqInput.mode``); another mode raises ``ValueError``
        before anything is sent."""
        if mode not in PAUSE_MODES:
            raise ValueError(
                f"pause_generation mode {mode!r} is not one of SGLang's modes {PAUSE_MODES}"
            )
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        """``POST /continue_generation``."""
        return await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """``POST /flush_cache``; False when the server refused (requests still running)."""
        try:
            await self.request("POST", "/flush_cache")
        except EngineHTTPError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    # --- weights ----------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_disk``; raises on ``success: false``."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return _check(await self.request("POST", "/update_weights_from_disk", body))

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> dict[str, Any]:
        """``POST /init_weights_update_group`` (returns when the group has formed)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return _check(await self.request("POST", "/init_weights_update_group", body))

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_distributed``: the engine receives each tensor by a
        broadcast from rank 0 of the group, in the order given."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return _check(await self.request("POST", "/update_weights_from_distributed", body))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """``POST /update_weights_from_tensor`` with one serialized item per engine rank."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return _check(await self.request("POST", "/update_weights_from_tensor", body))

    # --- LoRA adapters (SGLang's LoRA API) ---------------------------------------------------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, pinned: bool = False
    ) -> dict[str, Any]:
        """``POST /load_lora_adapter``: load the PEFT folder ``lora_path`` (as written by
        ``save_pretrained``) as ``lora_name``; returns SGLang's answer (``loaded_adapters``
        maps every loaded name to its path). A refusal raises :class:`EngineHTTPError` with
        the server's ``error_message``."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return _check_lora(
            "/load_lora_adapter", await self.request("POST", "/load_lora_adapter", body)
        )

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """``POST /unload_lora_adapter`` (the server drops it once the requests using it have
        finished)."""
        body = {"lora_name": lora_name}
        return _check_lora(
            "/unload_lora_adapter", await self.request("POST", "/unload_lora_adapter", body)
        )

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
        config_dict: Mapping[str, Any],
        *,
        pinned: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """``POST /load_lora_adapter_from_tensors``: an adapter from (PEFT name, tensor) pairs
        and its ``adapter_config.json`` dict. The tensors are serialized with
        ``miles_transport_common.payload.serialize`` (SGLang's serializer: CPU tensors travel
        by shared-memory name, CUDA ones as IPC handles, so the server must be on the same
        machine); with ``load_format="flattened_bucket"``, ``tensors`` is already a bucket item
        (``payload.bucket_payload``)."""
        from miles_transport_common.payload import serialize

        if load_format == "flattened_bucket":
            item: Any = tensors
        else:
            pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
            item = [(str(n), t) for n, t in pairs]
        body: dict[str, Any] = {
            "lora_name": lora_name,
            "config_dict": dict(config_dict),
            "serialized_named_tensors": [serialize(item)],
            "pinned": pinned,
        }
        if load_format is not None:
            body["load_format"] = load_format
        return _check_lora(
            "/load_lora_adapter_from_tensors",
            await self.request("POST", "/load_lora_adapter_from_tensors", body),
        )

    async def get_weight_version(self) -> str | None:
        """The weight version the server reports (``weight_version`` of ``GET /model_info``,
        where SGLang 0.5.23 publishes the version a weight update or
        ``/update_weight_version`` set), as a string; ``None`` when it reports none."""
        info = await self.request("GET", "/model_info")
        if not isinstance(info, dict):
            raise EngineHTTPError("/model_info", 200, f"expected a JSON object, got {info!r}")
        version = info.get("weight_version")
        return None if version is None else str(version)

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = True
    ) -> Any:
        """``POST /update_weight_version``: set the version without touching weights."""
        return await self.request(
            "POST",
            "/update_weight_version",
            {"new_version": new_version, "abort_all_requests": abort_all_requests},
        )

    # --- memory, health, info ---------------------------------------------------------------

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /release_memory_occupation`` (``tags``: ``kv_cache``, ``weights``)."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self.request("POST", "/release_memory_occupation", body)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """``POST /resume_memory_occupation``."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self.request("POST", "/resume_memory_occupation", body)

    async def health(self) -> bool:
        """``GET /health``: True on 200, False on an error status or no connection;
        :class:`EngineAuthError` when the server refuses this client's API key."""
        try:
            await self.request("GET", "/health")
        except EngineAuthError:
            raise  # a key to set, not an engine to restart
        except (EngineHTTPError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def health_generate(self) -> bool:
        """``GET /health_generate``: True when one token can be generated end to end;
        :class:`EngineAuthError` when the server refuses this client's API key."""
        try:
            await self.request("GET", "/health_generate")
        except EngineAuthError:
            raise  # a key to set, not an engine to restart
        except (EngineHTTPError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def get_model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (``model_path``, ``is_generation``, ``weight_version``...;
        SGLang 0.5.23 keeps ``/get_model_info`` only as a deprecated alias)."""
        return dict(await self.request("GET", "/model_info"))

    async def get_server_info(self) -> dict[str, Any]:
        """``GET /server_info``: the server arguments (``max_running_requests``...) plus
        ``internal_states``, one per data-parallel rank (SGLang 0.5.23 keeps
        ``/get_server_info`` only as a deprecated alias)."""
        return dict(await self.request("GET", "/server_info"))


def _input_logprobs(data: Any, length: int, start: int) -> list[float]:
    """The log-probs of positions ``start..length-1`` in a ``/generate`` answer's
    ``input_token_logprobs`` (its last ``length - start`` entries, all non-null)."""
    meta = data.get("meta_info", {}) if isinstance(data, dict) else {}
    entries = meta.get("input_token_logprobs") or []
    want = length - start
    got = entries[len(entries) - want :] if want else []
    if len(entries) < want:
        problem = f"{len(entries)} entries of input_token_logprobs"
    elif any(e[0] is None for e in got):
        problem = "a null log-prob among them"
    else:
        return [float(e[0]) for e in got]
    raise EngineHTTPError(
        "/generate",
        200,
        f"asked for the log-probs of the {want} input tokens from position {start}, got "
        f"{problem} (finish reason {meta.get('finish_reason')})",
    )


def _version_text(version: Any) -> str:
    """A ``meta_info.weight_version`` as text; ``""`` for a missing or null one."""
    return "" if version is None else str(version)


def _check(data: Any) -> dict[str, Any]:
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineHTTPError("weights", 200, str(data.get("message")))
    return dict(data) if isinstance(data, dict) else {"result": data}


def _check_lora(endpoint: str, data: Any) -> dict[str, Any]:
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineHTTPError(endpoint, 200, str(data.get("error_message")))
    return dict(data) if isinstance(data, dict) else {"result": data}
