"""Behavioural contract of a rollout engine, as a pytest base class.

A rollout-engine plugin subclasses :class:`EngineContract` in one of its test modules and
provides a fixture named ``engine`` (module scope recommended: one live server for the whole
suite) that yields an object with:

* ``client`` — an async client with the methods of ``miles_engine_client.EngineClient``
  (``generate``, ``input_logprobs``, ``abort_request``, ``pause_generation``,
  ``continue_generation``, ``flush_cache``, ``get_weight_version``,
  ``update_weights_from_disk``, ``health``, ``health_generate``, ``get_model_info``
  (``/model_info``), ``close``) and a ``base_url`` attribute. Every test runs its own
  event loop and calls ``close()`` at its end, so the client must open its HTTP session
  lazily in the running loop (``EngineClient`` does);
* ``model_path`` — the checkpoint folder the server started with;
* ``alt_model_path`` — a checkpoint of the same architecture with different weights;
* ``vocab_size`` — the model's vocabulary size.

:class:`EngineUnderTest` is a ready-made holder for these. The suite checks only behaviour of
SGLang's native HTTP API that Miles relies on; engine-specific extensions are tested by each
plugin itself. It leaves the engine as it found it (weights, version, not paused), so a
plugin's other tests may share the server. Prompts use ids below 16 and at most
``EngineContract.long_tokens`` (200) new tokens: the served context must hold 220 tokens.

This module imports neither torch nor any HTTP library; it is imported only by tests.
"""

from __future__ import annotations

import asyncio
import math
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from miles_core.hosts import auth_headers

T = TypeVar("T")

#: A short prompt every engine accepts (ids well inside any vocabulary).
PROMPT: list[int] = [3, 5, 7, 11, 13]


@dataclass
class EngineUnderTest:
    """What the ``engine`` fixture yields: a client of a live server and its checkpoints."""

    client: Any
    model_path: str
    alt_model_path: str
    vocab_size: int


def run_with(engine: Any, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``fn(engine.client)`` in a fresh event loop, closing the client's session after."""

    async def main() -> T:
        try:
            return await fn(engine.client)
        finally:
            await engine.client.close()

    return asyncio.run(main())


async def expect_4xx(call: Coroutine[Any, Any, Any]) -> int:
    """Await ``call``; it must fail with an HTTP status in ``[400, 500)``. Returns the status.

    Works with any client whose errors carry the answer's status as ``.status`` (as
    ``EngineHTTPError`` does)."""
    try:
        result = await call
    except Exception as exc:  # the client's own error type is not known here
        status = getattr(exc, "status", None)
        assert isinstance(status, int) and 400 <= status < 500, (
            f"expected an HTTP 4xx answer, got {type(exc).__name__}: {exc}"
        )
        return status
    raise AssertionError(f"expected an HTTP 4xx answer, got success: {result!r}")


def post_raw(base_url: str, endpoint: str, data: bytes) -> int:
    """POST raw bytes as ``application/json``; returns the HTTP status."""
    req = urllib.request.Request(
        base_url.rstrip("/") + endpoint,
        data=data,
        headers={"Content-Type": "application/json", **auth_headers()},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}


def _seeded(n: int, seed: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed}


class EngineContract:
    """Contract tests of a rollout engine (SGLang native HTTP API, as Miles uses it).

    Subclass it as ``class TestMyEngineContract(EngineContract)`` next to a fixture ``engine``
    (see the module docstring). Class attributes tune the sizes to the engine's speed.
    """

    #: new tokens of a request that must still be running when it is aborted.
    long_tokens: int = 200
    #: seconds a request submitted while paused is watched to stay unfinished.
    pause_watch_s: float = 0.5
    #: largest |scored - sampled| log-prob difference of the same token under the same weights.
    score_atol: float = 1e-4

    # --- health and info --------------------------------------------------------------------

    def test_health(self, engine: Any) -> None:
        """``/health`` and ``/health_generate`` answer 200 on a live server."""

        async def go(c: Any) -> tuple[bool, bool]:
            return await c.health(), await c.health_generate()

        ok, ok_gen = run_with(engine, go)
        assert ok, "/health did not answer 200"
        assert ok_gen, "/health_generate did not answer 200"

    def test_model_info(self, engine: Any) -> None:
        """``/get_model_info`` reports a generation model."""
        info = run_with(engine, lambda c: c.get_model_info())
        assert info.get("is_generation") is True, info

    # --- generation -------------------------------------------------------------------------

    def test_generate_length_and_logprobs(self, engine: Any) -> None:
        """``ignore_eos`` + ``max_new_tokens`` gives exactly that many tokens, finish reason
        ``length``, and one finite log-prob <= 0 per generated token, in token order."""
        n = 12
        r = run_with(engine, lambda c: c.generate(PROMPT, _seeded(n, 1), return_logprob=True))
        assert len(r.output_ids) == n, r
        assert all(0 <= t < engine.vocab_size for t in r.output_ids), r.output_ids
        assert r.finish_reason == "length", r.raw.get("meta_info")
        assert len(r.logprobs) == n, r.logprobs
        assert all(math.isfinite(x) and x <= 0.0 for x in r.logprobs), r.logprobs
        triples = r.raw["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == r.output_ids, triples
        assert r.prompt_tokens == len(PROMPT) and r.completion_tokens == n, r.raw["meta_info"]

    def test_input_logprobs_equal_the_sampled_ones(self, engine: Any) -> None:
        """Scoring a sampled generation (temperature 1: sampled from the distribution the
        log-probs are of) as input, from the end of its prompt, gives the log-probs it was
        sampled with: the prompt log-prob path and the generation path agree."""
        n = 16

        async def go(c: Any) -> tuple[Any, list[float]]:
            r = await c.generate(PROMPT, _seeded(n, 5), return_logprob=True)
            return r, await c.input_logprobs(PROMPT + r.output_ids, start=len(PROMPT))

        r, scored = run_with(engine, go)
        assert len(r.output_ids) == n and len(scored) == n, (r.output_ids, scored)
        worst = max(abs(a - b) for a, b in zip(scored, r.logprobs, strict=True))
        assert worst <= self.score_atol, (worst, scored, r.logprobs)

    def test_stop_token_ids(self, engine: Any) -> None:
        """Generation stops right after a token of ``stop_token_ids``, which is included."""
        n = 24

        async def go(c: Any) -> tuple[Any, int, Any]:
            first = await c.generate(PROMPT, _seeded(n, 7))
            stop_tok = first.output_ids[n // 2]
            stopped = await c.generate(PROMPT, {**_seeded(n, 7), "stop_token_ids": [stop_tok]})
            return first, stop_tok, stopped

        first, stop_tok, stopped = run_with(engine, go)
        cut = first.output_ids.index(stop_tok) + 1
        assert stopped.output_ids == first.output_ids[:cut], (first.output_ids, stopped)
        assert stopped.finish_reason == "stop", stopped.raw.get("meta_info")
        assert stopped.matched_stop == stop_tok, stopped.raw.get("meta_info")

    def test_same_seed_same_tokens(self, engine: Any) -> None:
        """Two requests with the same ``sampling_seed`` and prompt give the same tokens."""
        n = 24

        async def go(c: Any) -> tuple[Any, Any]:
            a = await c.generate(PROMPT, _seeded(n, 1234))
            b = await c.generate(PROMPT, _seeded(n, 1234))
            return a, b

        a, b = run_with(engine, go)
        assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)

    def test_temperature_zero_deterministic(self, engine: Any) -> None:
        """Greedy decoding (temperature 0) gives the same tokens on every request."""
        n = 24

        async def go(c: Any) -> list[Any]:
            return [await c.generate(PROMPT, _greedy(n)) for _ in range(3)]

        runs = run_with(engine, go)
        assert len(runs[0].output_ids) == n
        assert all(r.output_ids == runs[0].output_ids for r in runs), [r.output_ids for r in runs]

    # --- weights and versions ---------------------------------------------------------------

    def test_weight_version(self, engine: Any) -> None:
        """The version ``/model_info`` reports is a string, and responses carry it."""

        async def go(c: Any) -> tuple[str, Any]:
            return await c.get_weight_version(), await c.generate(PROMPT, _greedy(2))

        version, r = run_with(engine, go)
        assert isinstance(version, str) and version != "", version
        assert r.weight_version == version, (r.weight_version, version)

    def test_update_weights_from_disk(self, engine: Any) -> None:
        """Loading other weights with a ``weight_version`` changes outputs and the version;
        a bad path is a 4xx that keeps the version; loading the original weights back
        restores the original outputs."""
        n = 16

        async def go(c: Any) -> dict[str, Any]:
            out: dict[str, Any] = {"start": await c.get_weight_version()}
            out["before"] = await c.generate(PROMPT, _greedy(n))
            try:
                await c.update_weights_from_disk(
                    str(engine.alt_model_path), weight_version="contract-alt"
                )
                out["alt_version"] = await c.get_weight_version()
                out["after"] = await c.generate(PROMPT, _greedy(n))
                out["bad_status"] = await expect_4xx(
                    c.update_weights_from_disk(
                        "/nonexistent/miles-contract-checkpoint", weight_version="contract-bad"
                    )
                )
                out["after_bad_version"] = await c.get_weight_version()
            finally:
                await c.update_weights_from_disk(
                    str(engine.model_path), weight_version=out["start"]
                )
            out["restored_version"] = await c.get_weight_version()
            out["restored"] = await c.generate(PROMPT, _greedy(n))
            return out

        o = run_with(engine, go)
        assert o["alt_version"] == "contract-alt", o["alt_version"]
        assert o["after"].weight_version == "contract-alt", o["after"].weight_version
        # Log-probs of the greedy path differ under other weights even if a token repeats.
        assert (o["after"].output_ids, o["after"].logprobs) != (
            o["before"].output_ids,
            o["before"].logprobs,
        ), "outputs did not change after loading other weights"
        assert o["after_bad_version"] == "contract-alt", o["after_bad_version"]
        assert o["restored_version"] == o["start"], o["restored_version"]
        assert o["restored"].output_ids == o["before"].output_ids

    # --- control ----------------------------------------------------------------------------

    def test_pause_then_continue(self, engine: Any) -> None:
        """A request submitted while paused does not finish until ``continue_generation``,
        then completes in full."""
        n = 8

        async def go(c: Any) -> tuple[bool, Any]:
            await c.pause_generation()
            try:
                task = asyncio.create_task(c.generate(PROMPT, _greedy(n)))
                await asyncio.sleep(self.pause_watch_s)
                done_while_paused = task.done()
            finally:
                await c.continue_generation()
            return done_while_paused, await asyncio.wait_for(task, 60)

        done_while_paused, r = run_with(engine, go)
        assert not done_while_paused, "a request finished while the engine was paused"
        assert len(r.output_ids) == n and r.finish_reason == "length", r

    def test_abort_running_request(self, engine: Any) -> None:
        """Aborting a running request by ``rid`` ends it with finish reason ``abort`` before
        its ``max_new_tokens``."""
        rid = "contract-abort-1"
        n = self.long_tokens

        async def go(c: Any) -> Any:
            task = asyncio.create_task(c.generate(PROMPT, _greedy(n), rid=rid))
            # Abort of an unknown rid is a no-op: repeat from the start until the request has
            # ended, so an abort that overtook the request's own arrival is not the last one (a
            # fast engine generates the whole request in about 50 ms).
            while not task.done():
                await c.abort_request(rid)
                await asyncio.sleep(0.005)
            return await task

        r = run_with(engine, go)
        assert r.finish_reason == "abort", r.raw.get("meta_info")
        assert len(r.output_ids) < n, len(r.output_ids)

    def test_flush_cache_when_idle(self, engine: Any) -> None:
        """``/flush_cache`` succeeds when no request runs or waits."""
        assert run_with(engine, lambda c: c.flush_cache()) is True

    # --- bad inputs -------------------------------------------------------------------------

    def test_bad_inputs_are_4xx_and_server_stays_healthy(self, engine: Any) -> None:
        """Ids outside the vocabulary, a negative ``max_new_tokens`` and malformed JSON are
        refused with a 4xx; the server then still answers health checks and generates."""
        vocab = int(engine.vocab_size)

        async def go(c: Any) -> tuple[list[int], int, bool, Any]:
            statuses = [
                await expect_4xx(c.generate([1, vocab], _greedy(2))),
                await expect_4xx(c.generate([1, vocab + 1000], _greedy(2))),
                await expect_4xx(c.generate([1, 2], {"max_new_tokens": -1})),
            ]
            raw = await asyncio.to_thread(post_raw, c.base_url, "/generate", b'{"input_ids": [1, 2')
            return statuses, raw, await c.health(), await c.generate(PROMPT, _greedy(4))

        statuses, raw, healthy, r = run_with(engine, go)
        assert 400 <= raw < 500, f"malformed JSON answered {raw}"
        assert all(400 <= s < 500 for s in statuses), statuses
        assert healthy, "/health failed after bad requests"
        assert len(r.output_ids) == 4, r
