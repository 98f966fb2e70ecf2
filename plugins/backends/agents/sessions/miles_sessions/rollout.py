"""The ``session`` rollout function: multi-turn agentic rollouts through the session server.

For each prompt it opens ``group_size`` sessions on an in-process session server (loopback,
a random token), runs the configured agent on each through the session's OpenAI-compatible
URL, and returns the sessions' training samples as the group (one per session in linear mode,
one per kept branch in branching mode), each scored by the run's reward function. The run's
``temperature``, ``top_p`` and ``top_k`` apply where the agent's requests give none (greedy in
the held-out evaluation), and each sample records what its turns were drawn with.

Every episode's stored tokens are checked against the engine's: each turn's context and reply
must be one generation's input and output ids (:class:`EngineRecord`); the samples count the
turns checked and the mismatches (``counts/tito_turns``, ``counts/tito_mismatches``).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import random
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core.builtins.rollouts import score
from miles_core.contracts import RewardFn
from miles_core.data import Group, Sample


class SessionRolloutOptions(BaseModel):
    """Options of the ``session`` rollout function."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(
        "miles_sessions.agents:tool_loop",
        description="'module:function' of the async agent driving each session",
    )
    mode: Literal["linear", "branching"] = "linear"
    max_turns: int = Field(8, ge=1, description="passed to the agent")
    max_new_tokens: int = Field(512, ge=1, description="per turn, unless the agent asks")
    window: Literal["turn", "full"] = "turn"


class EngineRecord:
    """An engine client that keeps, for one session, a hash of every generation's input and
    output token ids as the engine saw and returned them (a few bytes a call, however long the
    context); :meth:`check` holds a session's stored turns against them (TITO: tokens in,
    tokens out)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: set[int] = set()

    async def generate(self, input_ids: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        result = await self.engine.generate(input_ids, sampling_params, **kwargs)
        self.calls.add(hash((tuple(input_ids), tuple(result.output_ids))))
        return result

    def check(self, leaf: Any) -> dict[str, float]:
        """The counts of one stored path (a sample), ending at ``leaf``: ``tito_turns``, the
        turns checked, and ``tito_mismatches``, those whose context (every stored token
        before the reply) and reply are not one generation's input and output ids."""
        context: list[int] = []
        mismatches = 0
        path = leaf.path()
        for turn in path:
            context.extend(turn.env_ids)
            mismatches += hash((tuple(context), tuple(turn.gen_ids))) not in self.calls
            context.extend(turn.gen_ids)
        return {"tito_turns": float(len(path)), "tito_mismatches": float(mismatches)}


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"agent {path!r} must be 'module:function'")
    return getattr(importlib.import_module(module), attr)


class SessionRollout:
    """Builds groups from agent sessions (see the module docstring)."""

    def __init__(self, options: SessionRolloutOptions | None = None) -> None:
        self.options = options or SessionRolloutOptions()
        self._server: Any = None
        self._token = secrets.token_urlsafe(24)
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def _server_for(self, family: Any) -> Any:
        """One server for the run's groups, which may run at once (the asynchronous loop);
        each session generates on the engine its group was given."""
        from miles_sessions.options import SessionServerOptions
        from miles_sessions.server import SessionServer

        # One start for concurrent first callers (the held-out evaluation starts all its
        # episodes at once): without the lock they would get the server before it listens.
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            if self._server is None or self._server.family is not family:
                if self._server is not None:
                    await self._server.stop()
                server = SessionServer(
                    family,
                    None,
                    SessionServerOptions(
                        token=self._token,
                        max_new_tokens=self.options.max_new_tokens,
                        window=self.options.window,
                    ),
                )
                await server.start()
                self._server = server
        return self._server

    async def close(self) -> None:
        """Stop the in-process session server."""
        if self._server is not None:
            await self._server.stop()
            self._server = None

    async def __call__(
        self,
        prompt: Mapping[str, Any],
        *,
        group_size: int,
        engine: Any,
        reward: RewardFn,
        **context: Any,
    ) -> Group:
        family = context.get("family")
        if family is None:
            raise ValueError(
                "rollout function 'session' needs model.family to render and tokenize turns; "
                "name the model's family in the run config"
            )
        agent = _resolve(self.options.agent)
        server = await self._server_for(family)
        key = json.dumps(
            [context.get("seed", 0), context.get("step", 0), dict(prompt)], default=str
        )
        rng = random.Random(hashlib.sha256(key.encode()).hexdigest())
        # the run's temperature, top_p and top_k (greedy in the held-out evaluation) where
        # the agent's requests give none
        sampling = context.get("sampling_params") or {}
        records = [EngineRecord(engine) for _ in range(group_size)]
        sessions = [
            server.new_session(self.options.mode, engine=record, sampling=sampling)
            for record in records
        ]
        outcomes = await asyncio.gather(
            *(
                agent(
                    base_url=f"{server.url}/sessions/{s.id}/v1",
                    api_key=self._token,
                    prompt=prompt,
                    seed=rng.randrange(2**31),
                    max_turns=self.options.max_turns,
                )
                for s in sessions
            ),
            return_exceptions=True,
        )
        samples: list[Sample] = []
        for session, record, outcome in zip(sessions, records, outcomes, strict=True):
            got = session.samples()
            for leaf, sample in zip(session.leaves(), got, strict=True):
                sample.counts.update(record.check(leaf))
            server.sessions.pop(session.id, None)
            if isinstance(outcome, BaseException) or not got:
                failed = got[0] if got else Sample(prompt_ids=[])
                failed.finish_reason = "error"
                failed.metadata["error"] = (
                    f"{type(outcome).__name__}: {outcome}"
                    if isinstance(outcome, BaseException)
                    else "the agent finished without a turn"
                )
                samples.append(failed)
                continue
            for sample in got:
                last = sample.metadata["messages"][-1]
                sample.metadata["response_text"] = last.get("content") or ""
                if not sample.failed:  # a reward bug fails the sample, not the run
                    score(sample, prompt, reward)
                samples.append(sample)
        return Group(samples=samples, prompt=dict(prompt))


def build(options: SessionRolloutOptions | None = None) -> SessionRollout:
    """Factory of the ``session`` rollout function."""
    return SessionRollout(options)
