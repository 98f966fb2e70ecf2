"""The engine gate's side of the engine contract: ``POST /generate`` over plain HTTP, and an
engine started through the core's plugin registry.

The gate speaks SGLang's native API and nothing else (``input_ids``, ``sampling_params``,
``return_logprob``; the answer's ``output_ids`` and ``meta_info``), so the same gate runs
against any server that speaks it: the embedded CPU engine, or a live SGLang on a GPU machine.
Which engine plugin starts the server is read from the registry (the record's ``devices``),
never from a plugin name: this module imports no plugin.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import MilesUserError
from miles_core.hosts import auth_headers


class EngineGateError(MilesUserError):
    """The gate could not run against the engine (unreachable, an error status, an answer that
    does not follow the contract, no engine to start); the message says which."""


@dataclass
class GenerateAnswer:
    """One ``/generate`` answer, in the shape SGLang returns.

    Attributes:
        output_ids: generated token ids (a matched stop token included).
        logprobs: log-prob of each generated token.
        finish_reason: ``stop``, ``length`` or ``abort``.
        weight_version: the version the engine stamped (may be empty).
        raw: the whole JSON answer.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> GenerateAnswer:
        """Parse an answer; raises :class:`EngineGateError` naming what is missing."""
        if not isinstance(data, dict):
            raise EngineGateError(f"/generate answered {type(data).__name__}, not a JSON object")
        ids = data.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise EngineGateError(
                f"/generate answer has no list of integer output_ids (keys: {sorted(data)})"
            )
        meta = data.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        return cls(
            output_ids=list(ids),
            logprobs=logprobs,
            finish_reason=str(kind or ""),
            weight_version=str(meta.get("weight_version", "")),
            raw=data,
        )


def generate(
    url: str,
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    timeout_s: float = 600.0,
) -> GenerateAnswer:
    """``POST {url}/generate`` for one token-id prompt, with log-probs."""
    body = json.dumps(
        {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
    ).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/generate",
        data=body,
        headers={"Content-Type": "application/json", **auth_headers()},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise EngineGateError(f"{url}/generate -> HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise EngineGateError(f"the engine at {url} is unreachable: {exc.reason}") from None
    except OSError as exc:
        raise EngineGateError(f"the engine at {url} is unreachable: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise EngineGateError(f"{url}/generate answered non-JSON: {text[:200]!r}") from None
    return GenerateAnswer.from_json(data)


def cpu_engine(registry: Any) -> str:
    """The name of the one installed rollout engine whose record says it runs on CPU and serves
    text models (a family is a text model: an engine that requires another modality is not a
    candidate)."""
    from miles_core.components import Kind

    def serves_text(name: str) -> bool:
        allowed = registry.get(Kind.ROLLOUT_ENGINE, name).requires.get("modality")
        return allowed is None or "text" in allowed

    names: list[str] = [n for n in registry.names(Kind.ROLLOUT_ENGINE) if serves_text(n)]
    cpu = [n for n in names if "cpu" in registry.get(Kind.ROLLOUT_ENGINE, n).devices]
    if len(cpu) == 1:
        return cpu[0]
    if not cpu:
        raise EngineGateError(
            "the engine gate needs an engine: no installed rollout engine runs on CPU "
            f"(installed: {', '.join(names) or 'none'}); install one, or give the URL of a "
            "running engine (option url=http://HOST:PORT)"
        )
    raise EngineGateError(
        f"several installed rollout engines run on CPU ({', '.join(cpu)}); choose one with the "
        "gate option engine=NAME"
    )


@dataclass
class EngineChoice:
    """The rollout engine the gate will start: its name, its record, its validated options."""

    name: str
    record: Any
    config: Any


def choose_engine(
    name: str | None = None, options: Mapping[str, Any] | None = None
) -> EngineChoice:
    """Resolve rollout engine ``name`` (default: :func:`cpu_engine`) in the plugin registry and
    validate ``options`` against its options model; raises a user error naming the engine or
    the field before anything starts."""
    from pydantic import ValidationError

    from miles_core.components import Kind
    from miles_core.config import format_validation_error
    from miles_core.errors import ConfigError
    from miles_core.plugins import load_plugins

    registry = load_plugins().registry
    name = name or cpu_engine(registry)
    record = registry.get(Kind.ROLLOUT_ENGINE, name)
    raw = dict(options or {})
    if record.config is None:
        if raw:
            raise EngineGateError(f"rollout engine {name!r} takes no options (got {sorted(raw)})")
        return EngineChoice(name, record, None)
    try:
        config = record.config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, "engine_options", record.config),
            source=f"(engine gate, rollout engine {name!r})",
        ) from None
    return EngineChoice(name, record, config)


@dataclass
class StartedEngine:
    """An engine server the gate started: its URL, the engine's name and its launcher."""

    url: str
    name: str
    launcher: Any

    def shutdown(self) -> None:
        """Stop the server."""
        self.launcher.shutdown()


def start_engine(choice: EngineChoice, model_path: str) -> StartedEngine:
    """Build the chosen engine's launcher and start one server on ``model_path``."""
    launcher = choice.record.build(choice.config)
    try:
        url = launcher.launch(model_path, index=0)
    except BaseException:
        launcher.shutdown()
        raise
    return StartedEngine(url=url, name=choice.name, launcher=launcher)
