"""Registers the ``sglang`` router (``sglang-router`` in front of several engines) with Miles.

Importing this module is cheap: the router class is named by a ``"module:attr"`` string and
imported only when a run builds it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import Router, hookimpl


class SglangRouterOptions(BaseModel):
    """Options of the ``sglang`` router: one ``sglang-router`` process per run."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["round_robin", "power_of_two", "cache_aware", "random"] = Field(
        "round_robin",
        description="how the router picks an engine for each request: round_robin (the "
        "default), power_of_two (the less loaded of two random engines; it polls GET "
        "/get_load, which SGLang 0.5.23 does not serve), cache_aware (longest prefix match, "
        "balanced by load; pays off on engines with a prefix cache), random",
    )
    host: str | None = Field(
        None,
        description="address the router listens on (default: this node's address, "
        "MILES_NODE_ADDRESS, else 127.0.0.1); beyond loopback it requires MILES_API_KEY",
    )
    port: int | None = Field(None, ge=1, le=65535, description="default: a free port")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of the router's Prometheus exporter, which it always starts "
        "(default: a free port, so that several routers can run on one host)",
    )
    startup_timeout_s: float = Field(
        60.0, gt=0, description="how long start() and set_engines() wait for the router to serve"
    )
    request_timeout_s: int = Field(
        1800, ge=1, description="the router gives up on one forwarded request after this"
    )
    max_retries: int = Field(
        5,
        ge=0,
        description="retries of a request whose engine failed to answer (connection error, "
        "5xx, 429, 408), on another engine when there is one; 0 disables retries",
    )
    health_check_interval_s: int = Field(
        60, ge=1, description="interval of the router's own health probe of each engine"
    )
    shutdown_grace_s: int = Field(
        5,
        ge=0,
        description="on stop, how long the router may finish requests in flight before it is "
        "killed",
    )
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    log_dir: str | None = Field(
        None, description="folder of the router's log file (default: the system temp folder)"
    )


@hookimpl
def miles_register_routers(register):  # type: ignore[no-untyped-def]
    """Register the ``sglang`` router."""
    register(
        Router(
            name="sglang",
            factory="miles_engine_client.sglang_router:SglangRouter",
            config=SglangRouterOptions,
            description="sglang-router (Rust) in front of the engines: generation goes through "
            "it, engines are added and removed at run time through its /workers API",
        )
    )
