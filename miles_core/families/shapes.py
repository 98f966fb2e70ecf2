"""The conversation shapes the CPU gate renders: every way a multi-turn session grows.

Each shape is a complete conversation in the OpenAI chat format. The gate cuts it at every turn
boundary and checks that the template only ever appends. Shapes cover plain chat, system
messages (first and intermediate), single and parallel tool calls, long tool chains, a failed
call that is retried, reasoning on and off, and content that stresses tokenization (unicode,
code, whitespace at the edges of a message).

**Boundary shapes** (:data:`BOUNDARY_SHAPES`, part of :data:`SHAPES`). The CPU gate's
``tokens`` check fails when the tokens a session stores, piece by piece, are not the canonical
tokens of the whole render. A piece boundary is safe when a special token sits on it
(``<|im_end|>``, ``<｜Assistant｜>``); where a template writes one turn's text straight after
another's, the first token of the new turn can merge with the last of the old one. These shapes
put a system message right before an assistant turn with no user turn between: right after a
tool result (the retry pattern of agent frameworks), right after a user turn, right after an
assistant turn. The system text ends in ``.`` and the assistant's text starts with a word: a
render that writes ``...step 2.Got ...`` tokenizes whole as ``'.G', 'ot'`` where the engine
generated ``'.', 'Got'``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class ConversationShape:
    """One conversation the gate renders, cut at every turn boundary.

    Attributes:
        name: short identifier shown in reports (``parallel_tool_calls``).
        description: one line saying what the shape exercises.
        messages: the whole conversation.
        tools: the tool schemas passed to the template, or ``None``.
    """

    name: str
    description: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None
    tags: frozenset[str] = field(default_factory=frozenset)

    def conversation(self) -> list[Message]:
        """A deep copy of the messages, so a template cannot alter the shape for the next run."""
        return copy.deepcopy(list(self.messages))

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """A deep copy of the tool schemas, or ``None``."""
        return None if self.tools is None else copy.deepcopy(list(self.tools))

    @property
    def roles(self) -> frozenset[str]:
        """The roles the conversation uses."""
        return frozenset(m["role"] for m in self.messages)

    @property
    def has_reasoning(self) -> bool:
        """Whether an assistant turn carries reasoning (the shape needs thinking on)."""
        return any(m.get("reasoning_content") for m in self.messages)


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in params.items()},
                "required": list(params),
            },
        },
    }


WEATHER = _tool("get_weather", "Current weather of a city.", city="string")
SEARCH = _tool("search", "Search the web.", query="string")
CALC = _tool("calculator", "Evaluate an arithmetic expression.", expression="string")
TOOLS = (WEATHER, SEARCH, CALC)


def _call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # Arguments are a JSON string, as the OpenAI API sends them back.
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def _assistant(
    text: str = "", *, reasoning: str | None = None, calls: list[dict[str, Any]] | None = None
) -> Message:
    m: Message = {"role": "assistant", "content": text}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def _result(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _shape(
    name: str, description: str, *messages: Message, tools: tuple[dict[str, Any], ...] | None = None
) -> ConversationShape:
    return ConversationShape(name, description, tuple(messages), tools)


#: The shapes of every session's growth (without the boundary shapes).
BASE_SHAPES: tuple[ConversationShape, ...] = (
    _shape("single_turn", "one user question, one answer", _user("Hi!"), _assistant("Hello!")),
    _shape(
        "system_first",
        "a system message then one exchange",
        _system("You are terse."),
        _user("Capital of France?"),
        _assistant("Paris."),
    ),
    _shape(
        "multi_turn",
        "three user/assistant exchanges",
        _user("Pick a number."),
        _assistant("7."),
        _user("Double it."),
        _assistant("14."),
        _user("Now halve that."),
        _assistant("7 again."),
    ),
    _shape(
        "intermediate_system",
        "a system message injected between turns",
        _system("Be helpful."),
        _user("Tell me a fact."),
        _assistant("Honey never spoils."),
        _system("From now on answer in French."),
        _user("Another one."),
        _assistant("Les pieuvres ont trois coeurs."),
    ),
    _shape(
        "single_tool_call",
        "one tool call, its result, the final answer",
        _user("Weather in Oslo?"),
        _assistant(calls=[_call(0, "get_weather", {"city": "Oslo"})]),
        _result("call_0", '{"temp_c": -3, "sky": "snow"}'),
        _assistant("It is -3 °C and snowing in Oslo."),
        tools=TOOLS,
    ),
    _shape(
        "parallel_tool_calls",
        "two tool calls in one turn, answered together",
        _user("Weather in Oslo and in Lima?"),
        _assistant(
            calls=[
                _call(0, "get_weather", {"city": "Oslo"}),
                _call(1, "get_weather", {"city": "Lima"}),
            ]
        ),
        _result("call_0", '{"temp_c": -3}'),
        _result("call_1", '{"temp_c": 19}'),
        _assistant("Oslo: -3 °C. Lima: 19 °C."),
        tools=TOOLS,
    ),
    _shape(
        "content_and_tool_call",
        "an assistant turn with text before its tool call",
        _user("What is 12*34?"),
        _assistant("Let me compute that.", calls=[_call(0, "calculator", {"expression": "12*34"})]),
        _result("call_0", "408"),
        _assistant("12*34 = 408."),
        tools=TOOLS,
    ),
    _shape(
        "long_tool_chain",
        "five tool calls in a row before the answer",
        _user("Research the tallest building, then compute its height in feet."),
        _assistant(calls=[_call(0, "search", {"query": "tallest building"})]),
        _result("call_0", "Burj Khalifa"),
        _assistant(calls=[_call(1, "search", {"query": "Burj Khalifa height"})]),
        _result("call_1", "828 m"),
        _assistant(calls=[_call(2, "calculator", {"expression": "828*3.28084"})]),
        _result("call_2", "2716.54"),
        _assistant(calls=[_call(3, "search", {"query": "Burj Khalifa completion year"})]),
        _result("call_3", "2010"),
        _assistant(calls=[_call(4, "calculator", {"expression": "2026-2010"})]),
        _result("call_4", "16"),
        _assistant("The Burj Khalifa (2010) is 828 m, about 2717 ft tall."),
        tools=TOOLS,
    ),
    _shape(
        "tool_retry",
        "a failed tool call, corrected and retried",
        _user("Compute 2^10."),
        _assistant(calls=[_call(0, "calculator", {"expression": "2^^10"})]),
        _result("call_0", "error: invalid syntax '2^^10'"),
        _assistant("Retrying.", calls=[_call(1, "calculator", {"expression": "2**10"})]),
        _result("call_1", "1024"),
        _assistant("2^10 = 1024."),
        tools=TOOLS,
    ),
    _shape(
        "parallel_then_user",
        "parallel tool calls, then the user follows up",
        _system("You can use tools."),
        _user("Search cats and dogs."),
        _assistant(
            calls=[_call(0, "search", {"query": "cats"}), _call(1, "search", {"query": "dogs"})]
        ),
        _result("call_0", "Cats purr."),
        _result("call_1", "Dogs bark."),
        _assistant("Cats purr; dogs bark."),
        _user("And birds?"),
        _assistant(calls=[_call(2, "search", {"query": "birds"})]),
        _result("call_2", "Birds sing."),
        _assistant("Birds sing."),
        tools=TOOLS,
    ),
    _shape(
        "tools_without_system",
        "tool schemas given but no system message",
        _user("Is it raining in Rome?"),
        _assistant(calls=[_call(0, "get_weather", {"city": "Rome"})]),
        _result("call_0", '{"rain": false}'),
        _assistant("No rain in Rome."),
        tools=(WEATHER,),
    ),
    _shape(
        "thinking_single",
        "one answer with reasoning",
        _user("Is 91 prime?"),
        _assistant("No: 91 = 7 * 13.", reasoning="91 / 7 = 13, so it is composite."),
    ),
    _shape(
        "thinking_multi_turn",
        "reasoning on every turn across several exchanges",
        _user("Is 91 prime?"),
        _assistant("No.", reasoning="91 = 7 * 13."),
        _user("Is 97 prime?"),
        _assistant("Yes.", reasoning="No divisor up to 9 divides 97."),
        _user("And 99?"),
        _assistant("No.", reasoning="99 = 9 * 11."),
    ),
    _shape(
        "thinking_tool_chain",
        "reasoning before each tool call and before the answer",
        _user("Weather in Paris, in Fahrenheit?"),
        _assistant(
            reasoning="I need the weather first.",
            calls=[_call(0, "get_weather", {"city": "Paris"})],
        ),
        _result("call_0", '{"temp_c": 20}'),
        _assistant(
            reasoning="Convert 20 C.", calls=[_call(1, "calculator", {"expression": "20*9/5+32"})]
        ),
        _result("call_1", "68"),
        _assistant("68 °F in Paris.", reasoning="20 C is 68 F."),
        _user("Thanks! And tomorrow?"),
        _assistant("I cannot forecast.", reasoning="The tool gives current weather only."),
        tools=TOOLS,
    ),
    _shape(
        "thinking_mixed",
        "reasoning on some turns and not on others",
        _user("Say hi."),
        _assistant("Hi!"),
        _user("What is 17*3?"),
        _assistant("51.", reasoning="17*3 = 51."),
        _user("Say bye."),
        _assistant("Bye!"),
    ),
    _shape(
        "all_roles",
        "system, user, assistant and tool turns, plus a second system message",
        _system("You are an agent."),
        _user("Find the population of Kyoto."),
        _assistant(calls=[_call(0, "search", {"query": "Kyoto population"})]),
        _result("call_0", "1.46 million"),
        _assistant("About 1.46 million."),
        _system("The user is in a hurry."),
        _user("Shorter?"),
        _assistant("1.5M."),
        tools=TOOLS,
    ),
    _shape(
        "unicode_and_code",
        "non-ASCII text, emoji and a fenced code block",
        _user("Écris « bonjour » en japonais 🙂 et donne du code."),
        _assistant("こんにちは！\n```python\nprint('こんにちは')\n```"),
        _user("Merci — et en grec ?"),
        _assistant("Γειά σου."),
    ),
    _shape(
        "edge_whitespace",
        "messages starting or ending with spaces and newlines",
        _user("  indented question\n"),
        _assistant(" leading space and trailing newline\n"),
        _user("\nnew line first"),
        _assistant("ok "),
    ),
    _shape(
        "user_retry",
        "the user rejects an answer and asks again",
        _user("What is 7*8?"),
        _assistant("54."),
        _user("That is wrong, try again."),
        _assistant("Sorry: 7*8 = 56."),
    ),
    _shape(
        "null_content_tool_call",
        "a tool-call turn whose content is null, as OpenAI clients send it",
        _user("Weather in Quito?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call(0, "get_weather", {"city": "Quito"})],
        },
        _result("call_0", '{"temp_c": 14}'),
        _assistant("14 °C in Quito."),
        tools=TOOLS,
    ),
    _shape(
        "empty_tool_result",
        "a tool that returns nothing",
        _user("Clear the cache."),
        _assistant(calls=[_call(0, "search", {"query": ""})]),
        _result("call_0", ""),
        _assistant("Done."),
        tools=TOOLS,
    ),
)


def _tool_then_system(thinking: bool) -> tuple[Message, ...]:
    """A tool call, its result, a system message, the answer (reasoning on each turn or none)."""
    first = "I need the weather of Oslo." if thinking else None
    last = "Got the result: it is cold." if thinking else None
    return (
        _user("Weather in Oslo?"),
        _assistant("", reasoning=first, calls=[_call(0, "get_weather", {"city": "Oslo"})]),
        _result("call_0", '{"temp_c": -3}'),
        _system("The tool answered. Now answer in one sentence."),
        _assistant("Got it: -3 °C in Oslo.", reasoning=last),
    )


def _system_between(before: Message, thinking: bool) -> tuple[Message, ...]:
    """``before`` (a user or an assistant turn), a system message, then an assistant turn."""
    reasoning = "Got the rule: be brief." if thinking else None
    start: tuple[Message, ...] = () if before["role"] == "user" else (_user("Hi."),)
    return (
        *start,
        before,
        _system("Reply in at most five words."),
        _assistant("Got it. Paris is the capital.", reasoning=reasoning),
    )


def _boundary_shapes() -> tuple[ConversationShape, ...]:
    out = []
    for thinking in (False, True):
        tail = "_thinking" if thinking else ""
        mode = " (reasoning on every assistant turn)" if thinking else ""
        greeting = _assistant("Hello.", reasoning="A greeting." if thinking else None)
        out += [
            ConversationShape(
                f"system_after_tool_result{tail}",
                "a system message right after a tool result and right before the answer" + mode,
                _tool_then_system(thinking),
                TOOLS,
            ),
            ConversationShape(
                f"system_after_user{tail}",
                "a system message between a user turn and the assistant's answer" + mode,
                _system_between(_user("Capital of France?"), thinking),
            ),
            ConversationShape(
                f"system_after_assistant{tail}",
                "a system message right after an assistant turn, then another assistant turn"
                + mode,
                _system_between(greeting, thinking),
            ),
        ]
    return tuple(out)


#: Shapes where a system message meets an assistant turn with no user turn between.
BOUNDARY_SHAPES: tuple[ConversationShape, ...] = _boundary_shapes()

#: Every shape the CPU gate renders by default (``miles family verify`` runs them all).
SHAPES: tuple[ConversationShape, ...] = (*BASE_SHAPES, *BOUNDARY_SHAPES)
