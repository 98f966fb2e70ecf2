"""An agent for the ``session`` rollout function (``miles-sessions``) that gives the model a
sandboxed shell: ``agent="miles_env_terminal.agent:terminal_agent"``.

It speaks the OpenAI-compatible chat API of the session URL it is given through the official
``openai`` client (``miles_sessions.agents.openai_tool_loop``, the ``agent`` extra), offers one
tool, ``shell(command)``, runs every call in an :class:`~miles_env_terminal.episode.Episode` of the
prompt record's ``task_id`` and answers with the command's output. The transcript (kept by the
session server in ``sample.metadata['messages']``) holds every command, which is what the
``terminal_tests`` reward replays in a fresh sandbox to grade the episode.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from miles_env_terminal.episode import Episode
from miles_env_terminal.sandbox import SandboxLimits

#: The tool offered to the model.
SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a bash command in your working directory and return its exit "
        "code, stdout and stderr. Nothing runs in the background between commands.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}

#: Characters of a command's result shown to the model.
MAX_OBSERVATION = 4000


def shell_command(call: Mapping[str, Any]) -> str | None:
    """The command of a ``shell`` tool call (OpenAI format), or ``None`` for another call."""
    function = call.get("function") or {}
    if function.get("name") != "shell":
        return None
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    command = args.get("command") if isinstance(args, Mapping) else None
    return command if isinstance(command, str) else None


async def terminal_agent(
    *,
    base_url: str,
    api_key: str,
    prompt: Mapping[str, Any],
    seed: int,
    max_turns: int,
    limits: SandboxLimits | None = None,
) -> None:
    """Drive one episode with the official ``openai`` client: chat turns until a reply
    without tool calls or ``max_turns``."""
    from miles_sessions.agents import openai_tool_loop  # the ``agent`` extra

    if "messages" in prompt:
        messages = [dict(m) for m in prompt["messages"]]
    else:
        messages = [{"role": "user", "content": str(prompt["prompt"])}]
    episode = Episode(limits, max_steps=max(max_turns, 1) * 4)

    async def answer(call: Mapping[str, Any]) -> str:
        command = shell_command(call)
        if command is None:
            return "error: the only tool is shell(command)"
        # a blocking subprocess: off the event loop, so that the group's other episodes run
        # meanwhile
        obs = await asyncio.to_thread(episode.step, command)
        return obs.text[:MAX_OBSERVATION]

    try:
        await asyncio.to_thread(episode.reset, dict(prompt))
        await openai_tool_loop(
            base_url=base_url,
            api_key=api_key,
            messages=messages,
            tools=[SHELL_TOOL],
            answer=answer,
            seed=seed,
            max_turns=max_turns,
        )
    finally:
        await asyncio.to_thread(episode.close)
