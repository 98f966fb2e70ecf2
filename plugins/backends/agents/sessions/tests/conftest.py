"""Fixtures: the qwen3 family, a tiny Qwen3 model on a real embedded engine process, and a
session server running in a background event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Qwen3 token ids of the scripted turns (``<think>ok</think>\n\n`` then a tool call or "Done.").
THINK, OK, END_THINK, NN = 151667, 562, 151668, 271
TOOL_CALL = [151657, 4913, 606, 3252, 21020, 2198, 16370, 22317, 8926, 788, 16, 3417, 151658]
DONE = [17453, 13]
IM_END, NL = 151645, 198
#: Each scripted token and its successors (equal odds when several).
SCRIPT: dict[int, list[int]] = {NL: [THINK], THINK: [OK], OK: [END_THINK], END_THINK: [NN]}
SCRIPT[NN] = [TOOL_CALL[0], DONE[0]]
for seq in ([*TOOL_CALL, IM_END], [*DONE, IM_END]):
    for a, b in itertools.pairwise(seq):
        SCRIPT[a] = [b]
#: A script whose every reply calls the tool, and whose call's JSON is broken half the time:
#: after ``"city":1`` comes ``}}`` or a lone ``}`` (``{"name":...,"arguments":{"city":1}``).
BRACE = 92
BROKEN_SCRIPT = {**SCRIPT, NN: [TOOL_CALL[0]], TOOL_CALL[-3]: [TOOL_CALL[-2], BRACE]}
BROKEN_SCRIPT[BRACE] = [TOOL_CALL[-1]]


def make_script_model(
    path: Path,
    *,
    hidden: int = 32,
    seed: int = 0,
    moe: bool = False,
    mix: int | None = None,
    vocab_size: int = 151936,
    script: dict[int, list[int]] | None = None,
) -> Path:
    """A tiny random Qwen3 (Qwen3's vocabulary size) whose next token depends only on the
    current one, following :data:`SCRIPT` after the generation prompt's last token.

    The attention and MLP outputs are zeroed, so the last hidden state is the normalised
    embedding of the current token; scripted tokens get one-hot embeddings and the LM head maps
    each to its successors with a logit of 40 (every other logit is near 0). Generation after
    ``<|im_start|>assistant\\n`` is then ``<think>ok</think>\\n\\n`` followed, with equal odds,
    by ``<tool_call>{"name":"lookup","arguments":{"city":1}}</tool_call><|im_end|>`` or
    ``Done.<|im_end|>``: a random model that calls tools, so the parsers run on real engine
    output. Everything else about the model stays random. With ``moe``, a Qwen3-MoE (4 experts,
    top-2, in each of 2 layers) built the same way: its experts' outputs are zeroed too.

    ``mix`` (a seed): small random attention and MLP (or expert) outputs are added back, and an
    MoE's routers sharpened: the script still decides the tokens, while every log-prob (and the
    experts each position is routed to) depends on the whole context.

    ``vocab_size``: a larger vocabulary, for a family whose ids go beyond Qwen3's.

    ``script``: another successor table than :data:`SCRIPT` (e.g. :data:`BROKEN_SCRIPT`).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=8192,
        eos_token_id=IM_END,
        bos_token_id=151643,
        tie_word_embeddings=False,
    )
    if moe:
        cfg: Any = Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=2,
            **common,
        )
    else:
        cfg = Qwen3Config(intermediate_size=64, num_hidden_layers=1, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    script = SCRIPT if script is None else script
    sources = sorted(script)
    assert len(sources) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            mlp = layer.mlp.experts if moe else layer.mlp
            mlp.down_proj.zero_() if moe else mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for i, token in enumerate(sources):
            emb[token].zero_()
            emb[token, i] = 1.0
            for nxt in script[token]:
                head[nxt, i] = 40.0 / hidden**0.5
        if mix is not None:
            gen = torch.Generator().manual_seed(mix)
            for layer in model.model.layers:
                down = layer.mlp.experts.down_proj if moe else layer.mlp.down_proj.weight
                for w in (layer.self_attn.o_proj.weight, down):
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
                if moe:
                    gate = layer.mlp.gate.weight
                    gate.copy_(torch.randn(gate.shape, generator=gen) * 2.0)
    model.save_pretrained(path)
    return path


@contextlib.contextmanager
def live_engine(model: Path, *, true_on_policy: bool = False, **config: Any) -> Iterator[str]:
    """A live embedded engine process serving ``model``, batching up to 3 requests; its URL."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    options = {"max_running_requests": 3, "context_length": 2048, "startup_timeout_s": 180}
    extra = {"true_on_policy": True} if true_on_policy else {}
    launcher = build(EmbeddedEngineConfig(**{**options, **config}), **extra)
    url = launcher.launch(str(model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


def weather_rollouts(
    url: str, family: Any, tools: Any, loop_thread: LoopThread, *, routed: bool = False
) -> list[Any]:
    """Two groups of three session rollouts (up to 4 turns, the lookup tool answering "sunny")
    of the weather question against the engine at ``url``; ``routed``: through the fleet's
    request path that asks for the routing record, as a run with ``rollout.routing`` does."""
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions
    from miles_sessions.rollout import build as build_rollout

    from miles_core.runtime.fleet import RoutedRequests

    rollout = build_rollout(SessionRolloutOptions(max_turns=4, max_new_tokens=24))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
    }

    async def go() -> list[Any]:
        async with EngineClient(url, timeout_s=120) as client:
            engine: Any = RoutedRequests(client) if routed else client
            try:
                return [
                    await rollout(
                        prompt,
                        group_size=3,
                        engine=engine,
                        reward=lambda s, p: float(len(s.metadata["turns"])),
                        family=family,
                        step=1,
                    )
                    for _ in range(2)
                ]
            finally:
                await rollout.close()

    groups: list[Any] = loop_thread.run(go(), timeout=300)
    return groups


@pytest.fixture(scope="session")
def sessions_support() -> Any:
    """:func:`live_engine` and :func:`weather_rollouts` (test modules are imported by path, so
    helpers come as fixtures)."""

    class _Support:
        engine = staticmethod(live_engine)
        rollouts = staticmethod(weather_rollouts)

    return _Support


@pytest.fixture(scope="session")
def family() -> Any:
    """The qwen3 family (thinking on, keep-reasoning template)."""
    from miles_modelfamilies.qwen3 import build

    return build()


@pytest.fixture(scope="session")
def script_model() -> Any:
    """:func:`make_script_model`, for a test that builds its own variant."""
    return make_script_model


@pytest.fixture(scope="session")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live embedded engine process serving the scripted tiny Qwen3."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    model = make_script_model(tmp_path_factory.mktemp("script-qwen3"))
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=4, context_length=8192, num_threads=1, startup_timeout_s=180
        )
    )
    url = launcher.launch(str(model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


@pytest.fixture(scope="session")
def broken_engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live embedded engine process serving a scripted tiny Qwen3 that always calls the tool
    and breaks the call's JSON half the time (:data:`BROKEN_SCRIPT`)."""
    model = make_script_model(tmp_path_factory.mktemp("broken-qwen3"), script=BROKEN_SCRIPT)
    with live_engine(model, context_length=4096, num_threads=1) as url:
        yield url


class LoopThread:
    """An asyncio loop in a daemon thread, for running servers beside synchronous clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    """One background event loop for the whole test session."""
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def start_server(loop_thread: LoopThread, family: Any, engine_url: str):  # type: ignore[no-untyped-def]
    """``start_server(**options) -> (server, url)``; every server is stopped at the end."""
    from miles_engine_client import EngineClient
    from miles_sessions.options import SessionServerOptions
    from miles_sessions.server import SessionServer

    started: list[tuple[Any, Any]] = []

    def start(**options: Any) -> tuple[Any, str]:
        async def go() -> tuple[Any, str]:
            engine = EngineClient(engine_url, timeout_s=120)
            server = SessionServer(family, engine, SessionServerOptions(**options))
            url = await server.start()
            started.append((server, engine))
            return server, url

        return loop_thread.run(go())  # type: ignore[no-any-return]

    yield start

    async def stop_all() -> None:
        for server, engine in started:
            await server.stop()
            await engine.close()

    loop_thread.run(stop_all())


@pytest.fixture(scope="session")
def session_server(start_server) -> tuple[Any, str]:  # type: ignore[no-untyped-def]
    """A session server on loopback without a token, verifying its render window."""
    return start_server(max_new_tokens=64, verify_window=True)  # type: ignore[no-any-return]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather of a city by number.",
            "parameters": {"type": "object", "properties": {"city": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="session")
def tools() -> list[dict[str, Any]]:
    """The tool schemas the sessions offer."""
    return TOOLS


def _new_session(url: str, mode: str = "linear", token: str | None = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(f"{url}/sessions", json={"mode": mode}, headers=headers)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["base_url"] == f"/sessions/{body['id']}/v1"
    return str(body["id"])


@pytest.fixture(scope="session")
def new_session():  # type: ignore[no-untyped-def]
    """``new_session(url, mode="linear", token=None) -> session id`` over HTTP."""
    return _new_session
