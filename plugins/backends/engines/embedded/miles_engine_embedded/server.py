"""The HTTP server: SGLang's native API subset over the continuous-batching engine.

Run as ``python -m miles_engine_embedded.server --model-path DIR --port N``. Every body is
validated by :mod:`miles_engine_embedded.protocol`; a bad request is a 4xx with
``{"error": {"message": ...}}`` and never reaches the scheduler. The endpoint shapes are
documented in ``API.md`` beside this package.

The endpoints are served by route groups, one job each: generation
(:mod:`~miles_engine_embedded.generation_routes`), weight updates
(:mod:`~miles_engine_embedded.weight_routes`), LoRA adapters
(:mod:`~miles_engine_embedded.lora_routes`), admin and health
(:mod:`~miles_engine_embedded.admin_routes`), and the receiver route of every installed
transport that declares one (:mod:`~miles_engine_embedded.receiver_routes`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

# What every model load imports (4 s of CPU here), imported with this module rather than at the
# first load: a CPU server that is a fork of a fork server which imported this module
# (:class:`miles_core.forks.ForkedServer`) then starts without importing it again.
import transformers.modeling_utils  # noqa: F401
from aiohttp import web
from miles_engine_client.binding import BindRefused

from miles_core.hosts import resolve_host
from miles_engine_embedded.admin_routes import AdminRoutes
from miles_engine_embedded.engine import Engine
from miles_engine_embedded.generation_routes import FLUSH_MESSAGE, GenerationRoutes
from miles_engine_embedded.launcher import bind_listening
from miles_engine_embedded.lora import parse_lora_paths, read_adapter_folder
from miles_engine_embedded.lora_routes import LORA_DISTRIBUTED_PATH, LoraRoutes
from miles_engine_embedded.peer_routes import PeerRoutes
from miles_engine_embedded.receiver_routes import ReceiverRoutes, receiver_routes
from miles_engine_embedded.routing import (
    BODY_LIMITS,
    CONTROL_BODY_LIMIT,
    GENERATE_BODY_LIMIT,
    WEIGHTS_BODY_LIMIT,
    BadRequest,
    Route,
    RouteGroup,
    body_limit,
    build_app,
    error_response,
    errors_middleware,
    parse_body,
    weights_body_limit,
)
from miles_engine_embedded.weight_routes import WeightRoutes, reachable
from miles_engine_embedded.weights import ModelHolder

__all__ = [
    "BODY_LIMITS",
    "CONTROL_BODY_LIMIT",
    "FLUSH_MESSAGE",
    "GENERATE_BODY_LIMIT",
    "LORA_DISTRIBUTED_PATH",
    "ROUTE_GROUPS",
    "WEIGHTS_BODY_LIMIT",
    "BadRequest",
    "Route",
    "Server",
    "body_limit",
    "build_engine",
    "build_parser",
    "error_response",
    "errors_middleware",
    "main",
    "parse_body",
    "reachable",
    "start_compute_thread",
    "true_on_policy_refusal",
]

log = logging.getLogger("miles_engine_embedded")

#: The route groups of every embedded server, whose ``ROUTES`` name the endpoints each serves
#: (the transports' receiver routes come from the installed transport records).
ROUTE_GROUPS = (GenerationRoutes, WeightRoutes, LoraRoutes, AdminRoutes, PeerRoutes)


class Server:
    """HTTP front of one :class:`Engine`: holds one object per route group and mounts the
    routes of each."""

    def __init__(self, engine: Engine, *, tokenizer: Any = None, server_args: dict[str, Any]):
        self.engine = engine
        self.holder = engine.holder
        self.server_args = server_args
        #: adapters being unloaded: refused to new requests, dropped once none uses them
        unloading: set[str] = set()
        self.weights = WeightRoutes(engine, server_args=server_args)
        self.generation = GenerationRoutes(engine, tokenizer=tokenizer, unloading=unloading)
        self.adapters = LoraRoutes(engine, weights=self.weights, unloading=unloading)
        self.admin = AdminRoutes(
            engine, server_args=server_args, loaded_adapters=self.adapters.loaded
        )
        self.receivers: list[ReceiverRoutes] = receiver_routes(self.weights)
        self.peers = PeerRoutes(engine)

    def groups(self) -> list[RouteGroup]:
        """Every route group this server mounts."""
        return [
            self.generation, self.weights, self.adapters, self.admin, self.peers, *self.receivers
        ]  # fmt: skip

    def app(self) -> web.Application:
        """The aiohttp application with every route, and each route's body limit."""
        return build_app(
            self.groups(),
            weights_limit=weights_body_limit(self.server_args),
            on_shutdown=self._on_shutdown,
        )

    async def _on_shutdown(self, _app: web.Application) -> None:
        await asyncio.to_thread(self.engine.stop)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the server."""
    p = argparse.ArgumentParser(prog="python -m miles_engine_embedded.server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument(
        "--host",
        default=None,
        help="address to bind (default: this node's, MILES_NODE_ADDRESS, else 127.0.0.1); "
        "beyond loopback the server requires MILES_API_KEY",
    )
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
    args.host = resolve_host(args.host)
    try:
        sock = bind_listening(args.host, args.port, args.port_file)
    except BindRefused as exc:
        raise SystemExit(f"--host: {exc}") from None
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
