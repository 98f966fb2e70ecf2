"""A model family built from a chat template, a tokenizer and parsers.

Implements :class:`miles_core.contracts.Family`, plus what the gates and the session server use:
``tokenize``/``encode``, ``decode``, ``stop_token_ids``, the roles that may be appended, and a
fingerprint split into parts so a stale certificate can say what changed.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from miles_modelfamilies import parsers, rendering
from miles_modelfamilies.parsers import TaggedJsonToolParser, ThinkReasoningParser
from miles_modelfamilies.rendering import compile_template
from miles_modelfamilies.tokenizer import TextTokenizer

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
#: Rewrites messages and tools before the template sees them (family conventions the template
#: itself lacks, such as SmolLM2's tool calls written into the content).
Prepare = Callable[[Messages, Tools], tuple[Messages, Tools]]


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _identity(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    return messages, tools


@dataclass
class TemplateFamily:
    """A family: chat template and its arguments, tokenizer, parsers, stop tokens and roles.

    Attributes:
        name: the family name users select (``qwen3``).
        template: the chat template text (jinja2).
        template_args: extra variables the template reads (``enable_thinking``).
        tokenizer: the family's tokenizer.
        stop_tokens: strings that end an assistant turn; each is one token.
        roles: roles the template renders (and a session may append).
        thinking: whether assistant turns carry reasoning in this configuration.
        always_reasons: the generation prompt opens the reasoning block, so every assistant turn
            has reasoning (the gates give turns without any a filler reasoning).
        system_anywhere: the template renders system messages after the first one.
        tool_parser: splits tool calls out of generated text.
        reasoning_parser: splits reasoning out of generated text, or ``None``.
        prepare: rewrites messages/tools before rendering (its source is fingerprinted).
        special_tokens: variables such as ``bos_token`` passed to the template.
        source_modules: modules whose source the parser hash covers.
        description: one line for ``miles family list``.
    """

    name: str
    template: str
    tokenizer: TextTokenizer
    stop_tokens: tuple[str, ...]
    template_args: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")
    thinking: bool = False
    always_reasons: bool = False
    system_anywhere: bool = True
    tool_parser: Any = field(default_factory=TaggedJsonToolParser)
    reasoning_parser: ThinkReasoningParser | None = None
    prepare: Prepare = _identity
    special_tokens: dict[str, str] = field(default_factory=dict)
    source_modules: tuple[ModuleType, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        self._compiled = compile_template(self.template)
        self.stop_token_ids: tuple[int, ...] = tuple(
            self.tokenizer.token_id(t) for t in self.stop_tokens
        )
        self._parts = self._fingerprint_parts()

    # --- rendering and tokens ------------------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """Render ``messages`` with the family's template (no tokenization)."""
        msgs, tls = self.prepare(copy.deepcopy(list(messages)), copy.deepcopy(tools))
        return str(
            self._compiled.render(
                messages=msgs,
                tools=tls,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **self.template_args,
            )
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text (special tokens as their ids, nothing added)."""
        return self.tokenizer.encode(text)

    encode = tokenize

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(ids)

    # --- parsing -------------------------------------------------------------------------------

    def parse_assistant(self, text: str) -> dict[str, Any]:
        """Split generated text into ``content``, ``reasoning_content`` and ``tool_calls``
        (OpenAI format; ``None`` when absent). A trailing stop token (and whitespace after it)
        is dropped; tool-call
        blocks whose JSON does not parse stay in the content and are listed under
        ``tool_call_errors``."""
        # The text may end with the stop token and what the template writes after it ("\n").
        tail = text.rstrip()
        for stop in self.stop_tokens:
            if tail.endswith(stop):
                text = tail[: -len(stop)]
                break
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text)
        content, calls, errors = self.tool_parser.split(text)
        out: dict[str, Any] = {
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": calls or None,
        }
        if errors:
            out["tool_call_errors"] = errors
        return out

    # --- fingerprint ---------------------------------------------------------------------------

    def _fingerprint_parts(self) -> dict[str, str]:
        # parse_assistant lives in this module: its source is part of the parsers' hash; the
        # sandbox set-up changes what a template renders, so it is part of the template's.
        modules = (parsers, sys.modules[__name__], *self.source_modules)
        sources = [inspect.getsource(m) for m in modules]
        sources.append(inspect.getsource(self.prepare))
        parser_desc = json.dumps(
            {
                "version": parsers.PARSERS_VERSION,
                "tool": repr(self.tool_parser),
                "reasoning": repr(self.reasoning_parser),
            }
        )
        family_desc = json.dumps(
            {
                "stop_tokens": list(self.stop_tokens),
                "stop_token_ids": list(self.stop_token_ids),
                "roles": list(self.roles),
                "thinking": self.thinking,
                "always_reasons": self.always_reasons,
                "system_anywhere": self.system_anywhere,
            }
        )
        return {
            "template": _sha(self.template + "\0" + inspect.getsource(rendering)),
            "template_args": _sha(
                json.dumps(
                    {"args": self.template_args, "special": self.special_tokens}, sort_keys=True
                )
            ),
            "tokenizer": self.tokenizer.digest,
            "parsers": _sha(parser_desc + "\0".join(sources)),
            "family": _sha(family_desc),
        }

    def fingerprint_parts(self) -> dict[str, str]:
        """sha256 of each part: template, template_args, tokenizer, parsers, family (stops and
        roles)."""
        return dict(self._parts)

    def fingerprint(self) -> str:
        """sha256 over all parts: what a gate certificate is bound to."""
        return _sha(json.dumps(self._parts, sort_keys=True))

    def run_engine_gate(self, report: Any, **options: Any) -> Any:
        """The engine gate (:mod:`miles_modelfamilies.engine_gate`): a real engine, reached
        through the engine contract alone, drives a scripted session; adds to ``report``.
        ``options``: :class:`~miles_modelfamilies.options.EngineGateOptions`."""
        from miles_modelfamilies.engine_gate import run_engine_gate

        return run_engine_gate(self, report, **options)

    def replace_template(self, template: str) -> TemplateFamily:
        """The same family with another template text (to test a variant before shipping it)."""
        clone = copy.copy(self)
        clone.template = template
        clone.__post_init__()
        return clone
