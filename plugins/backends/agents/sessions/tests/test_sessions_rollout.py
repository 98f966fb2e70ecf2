"""The ``session`` rollout function: registered through the entry point, passes the core's
contract check, and builds scored groups of multi-turn samples on a real engine."""

from __future__ import annotations

from typing import Any

import pytest


def _record() -> Any:
    from miles_core.components import Kind
    from miles_core.plugins import load_plugins

    return load_plugins().registry.get(Kind.ROLLOUT_FUNCTION, "session")


def test_sessions_rollout_registered_and_contract() -> None:
    from miles_sessions.rollout import SessionRollout, SessionRolloutOptions

    from miles_core.testing.contracts import check_component

    record = _record()
    assert record.config is SessionRolloutOptions
    assert isinstance(check_component(record), SessionRollout)
    with pytest.raises(ValueError, match="mode"):
        SessionRolloutOptions.model_validate({"mode": "tree"})


@pytest.mark.parametrize("mode", ["linear", "branching"])
def test_sessions_rollout_group(
    mode: str, family: Any, engine_url: str, loop_thread: Any, tools: Any
) -> None:
    from miles_engine_client import EngineClient
    from miles_sessions.rollout import SessionRolloutOptions, build

    rollout = build(SessionRolloutOptions(mode=mode, max_turns=6, max_new_tokens=32))
    prompt = {
        "messages": [{"role": "user", "content": "Weather in city 1?"}],
        "tools": tools,
        "tool_results": {"lookup": "sunny"},
    }

    def reward(sample: Any, prompt: Any) -> float:
        return float(len(sample.metadata["turns"]))

    async def go() -> Any:
        async with EngineClient(engine_url, timeout_s=60) as engine:
            try:
                return await rollout(
                    prompt, group_size=3, engine=engine, reward=reward, family=family, step=1
                )
            finally:
                await rollout.close()

    group = loop_thread.run(go())
    assert len(group.samples) == 3
    for s in group.samples:
        s.check()
        turns = len(s.metadata["turns"])
        assert s.reward == float(turns) and 1 <= turns <= 6
        # Every turn but the last called the tool; the last answered (or hit max_turns).
        text = family.decode(s.response_ids)
        assert text.count("<tool_response>\nsunny\n</tool_response>") == turns - 1
        assert sum(s.loss_mask) == len([v for v in s.versions if v == 0])
        # every stored turn, on every branch, is one of the engine's generations
        assert s.counts["tito_turns"] == turns and s.counts["tito_mismatches"] == 0
        assert s.metadata["response_text"] in ("Done.", "")


def test_session_rollout_starts_one_listening_server_for_concurrent_episodes() -> None:
    """The held-out evaluation starts all its episodes at once: every one must get the same
    session server, already listening (not one whose URL is still empty)."""
    import asyncio

    aiohttp = pytest.importorskip("aiohttp")
    from miles_modelfamilies.smollm2 import build as smollm2_family
    from miles_sessions.rollout import SessionRollout

    async def main() -> list[str]:
        rollout = SessionRollout()
        family = smollm2_family()

        async def url_when_given() -> tuple[Any, str]:
            server = await rollout._server_for(family)
            return server, server.url  # what an episode builds its base URL from

        try:
            given = await asyncio.gather(*(url_when_given() for _ in range(8)))
            assert all(server is given[0][0] for server, _ in given)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{given[0][1]}/v1/models") as resp:
                    assert resp.status in (200, 401)
            return [url for _, url in given]
        finally:
            await rollout.close()

    urls = asyncio.run(main())
    assert all(u.startswith("http://127.0.0.1:") for u in urls)
