"""Async HTTP client for SGLang's native API, shared by real SGLang and the embedded engine,
plus the router that spreads requests over engines and the supervisor that restarts them."""

from miles_engine_client.client import EngineClient, EngineHTTPError, GenerateResult
from miles_engine_client.router import (
    EngineBroadcastError,
    EngineRouter,
    EngineUnavailable,
    NoEngineAvailable,
)
from miles_engine_client.supervisor import EngineRestartError, EngineSupervisor

__all__ = [
    "EngineBroadcastError",
    "EngineClient",
    "EngineHTTPError",
    "EngineRestartError",
    "EngineRouter",
    "EngineSupervisor",
    "EngineUnavailable",
    "GenerateResult",
    "NoEngineAvailable",
]
__version__ = "0.1.0"
