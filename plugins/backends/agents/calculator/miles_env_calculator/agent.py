"""The agent for the ``session`` rollout function (``miles-sessions``):
``agent="miles_env_calculator.agent:calculator_agent"``.

It speaks the session URL's OpenAI-compatible chat API through the official ``openai`` client
(``miles_sessions.agents.openai_tool_loop``, the ``agent`` extra), offers one tool,
``calculate(expression)``, answers every call with the value from
:func:`~miles_env_calculator.calc.calculate` (or the reason it was refused), and stops at the
first reply without tool calls or after ``max_turns`` replies. The last reply is what the
``last_number`` reward grades. A prompt record's ``temperature`` is sent with every request;
otherwise the session's applies (the run's, greedy in the held-out evaluation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from miles_env_calculator.calc import CalcError, calculate, format_number
from miles_env_calculator.tasks import CALCULATE_TOOL


def tool_result(call: Mapping[str, Any]) -> str:
    """The text answering one tool call (OpenAI format): the value, or an error naming why."""
    function = call.get("function") or {}
    if function.get("name") != "calculate":
        return "error: the only tool is calculate(expression)"
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return "error: the arguments are not JSON"
    expression = args.get("expression") if isinstance(args, Mapping) else None
    if not isinstance(expression, str):
        return "error: calculate needs an 'expression' string"
    try:
        return format_number(calculate(expression))
    except CalcError as exc:
        return f"error: {exc}"


async def calculator_agent(
    *,
    base_url: str,
    api_key: str,
    prompt: Mapping[str, Any],
    seed: int,
    max_turns: int,
) -> None:
    """Drive one episode with the official ``openai`` client (see the module docstring)."""
    from miles_sessions.agents import openai_tool_loop  # the ``agent`` extra

    async def answer(call: Mapping[str, Any]) -> str:
        return tool_result(call)

    extra: dict[str, Any] = {}
    if prompt.get("temperature") is not None:
        extra["temperature"] = float(prompt["temperature"])
    await openai_tool_loop(
        base_url=base_url,
        api_key=api_key,
        messages=[{"role": "user", "content": str(prompt["prompt"])}],
        tools=[CALCULATE_TOOL],
        answer=answer,
        seed=seed,
        max_turns=max_turns,
        **extra,
    )
