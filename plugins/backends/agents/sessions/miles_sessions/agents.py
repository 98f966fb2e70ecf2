"""Agents the ``session`` rollout function can run: async callables that drive one session
through its OpenAI-compatible URL.

An agent is called as ``await agent(base_url=..., api_key=..., prompt=..., seed=...,
max_turns=...)`` and talks to ``{base_url}/chat/completions`` like any OpenAI client would; the
session server records the tokens. Name your own with the rollout option
``agent="package.module:function"``; :func:`openai_tool_loop` runs the chat-and-tool loop of
one with the official ``openai`` client, given how to answer a tool call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

#: answers one tool call (OpenAI format) with the tool message's text
ToolAnswer = Callable[[Mapping[str, Any]], Awaitable[str]]


async def openai_tool_loop(
    *,
    base_url: str,
    api_key: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    answer: ToolAnswer,
    seed: int,
    max_turns: int,
    **params: Any,
) -> list[dict[str, Any]]:
    """Chat turns through the official ``openai`` client (the ``agent`` extra) until a reply
    without tool calls or ``max_turns`` replies; every tool call is answered with ``await
    answer(call)``. Turn ``t`` asks with ``seed + t`` and ``params`` (``temperature``...);
    returns ``messages``, extended with each reply and tool message."""
    import openai  # the ``agent`` extra; needed only here

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    try:
        for turn in range(max_turns):
            completion = await client.chat.completions.create(
                model="policy",
                messages=messages,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
                seed=seed + turn,
                **params,
            )
            reply = completion.choices[0].message.model_dump(exclude_none=True)
            messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                text = await answer(call)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
    finally:
        await client.close()
    return messages


async def tool_loop(
    *,
    base_url: str,
    api_key: str,
    prompt: Mapping[str, Any],
    seed: int,
    max_turns: int,
) -> None:
    """A chat agent with static tools: sends the prompt's ``messages`` (or ``prompt`` as one
    user message) and ``tools``; answers every tool call from the prompt record's
    ``tool_results`` (tool name -> text; an unknown tool gets an error text), and stops at the
    first reply without tool calls or after ``max_turns`` replies.

    A malformed tool call (the server's ``miles.tool_call_errors``) is handled by the record's
    ``on_malformed_tool_call``: ``continue`` (default) answers it with the error (a call kept
    with its generated arguments: its tool message; a block that did not parse: a user
    message) and goes on; ``end`` ends the episode there."""
    if "messages" in prompt:
        messages = [dict(m) for m in prompt["messages"]]
    else:
        messages = [{"role": "user", "content": str(prompt["prompt"])}]
    results = dict(prompt.get("tool_results") or {})
    rule = prompt.get("on_malformed_tool_call", "continue")
    if rule not in ("continue", "end"):
        raise ValueError(f"on_malformed_tool_call {rule!r} is not 'continue' or 'end'")
    body: dict[str, Any] = {"messages": messages}
    if prompt.get("tools"):
        body["tools"] = prompt["tools"]
    headers = {"Authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for turn in range(max_turns):
            body["seed"] = seed + turn
            async with http.post(f"{base_url}/chat/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"chat completion failed ({resp.status}): {data}")
            reply = data["choices"][0]["message"]
            messages.append(reply)
            errors = (data.get("miles") or {}).get("tool_call_errors") or []
            if errors and rule == "end":
                return
            bad = {e["id"]: e["error"] for e in errors if e["id"] is not None}
            unparsed = [e["error"] for e in errors if e["id"] is None]
            for call in reply.get("tool_calls") or []:
                name = call["function"]["name"]
                if call["id"] in bad:
                    content = f"error: malformed call: {bad[call['id']]}"
                else:
                    content = results.get(name, f"error: no tool named {name!r}")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
            if unparsed:
                note = "error: a tool call could not be parsed: " + "; ".join(unparsed)
                messages.append({"role": "user", "content": note})
            elif not reply.get("tool_calls"):
                return
