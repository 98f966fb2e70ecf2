"""Async HTTP client for SGLang's native API, shared by real SGLang and the embedded engine,
and the ``sglang`` router component (``sglang-router`` in front of several engines)."""

from miles_engine_client.client import (
    EngineAuthError,
    EngineClient,
    EngineHTTPError,
    GenerateResult,
)

__all__ = ["EngineAuthError", "EngineClient", "EngineHTTPError", "GenerateResult"]
__version__ = "0.1.0"
