"""A model family built from a chat template, a tokenizer and parsers.

Implements :class:`miles_core.contracts.Family` (on :class:`~miles_core.contracts.FamilyDefaults`):
``tokenize``/``encode``, ``decode``, ``stop_token_ids``, the roles that may be appended, the
escaping of agent text, the engine gate, and a fingerprint split into parts so a stale
certificate can say what changed. What the engine gate needs per family beside that (the
checkpoint's vocabulary size, a real checkpoint to run) is declared here too.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from miles_core.contracts import FamilyDefaults
from miles_modelfamilies import parsers, rendering
from miles_modelfamilies.parsers import TaggedJsonToolParser, ThinkReasoningParser
from miles_modelfamilies.rendering import compile_template
from miles_modelfamilies.tokenizer import TextTokenizer

if TYPE_CHECKING:  # pragma: no cover
    from miles_core.families.report import GateReport

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
#: Rewrites messages and tools before the template sees them (family conventions the template
#: itself lacks, such as SmolLM2's tool calls written into the content).
Prepare = Callable[[Messages, Tools], tuple[Messages, Tools]]


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _identity(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    return messages, tools


#: Agent text is rendered with every control token's string replaced by a placeholder of two
#: private-use characters: ``_ESC`` then ``_BASE + k`` (k = 0 stands for ``_ESC`` itself, so
#: text that already holds it round-trips; k = i + 1 for the i-th control token). Neither is
#: part of any token's text, so after rendering the only control strings left are the
#: template's markup.
_ESC = "\U0010fffd"
_BASE = 0xF0000


class _TextEscape:
    """Escapes control-token strings in agent text and restores them in rendered text."""

    def __init__(self, controls: Sequence[str]) -> None:
        self.controls = tuple(sorted(set(controls), key=len, reverse=True))
        self._to = {_ESC: _ESC + chr(_BASE)}
        self._to.update({c: _ESC + chr(_BASE + i + 1) for i, c in enumerate(self.controls)})
        self._back = {v[1]: k for k, v in self._to.items()}
        # Longest first, so a control that contains another is matched whole (leftmost-longest,
        # as the tokenizers match added tokens).
        alts = "|".join(re.escape(c) for c in (_ESC, *self.controls))
        self._find = re.compile(alts)
        self._split = re.compile(
            "(" + "|".join(re.escape(c) for c in self.controls) + ")" if self.controls else "(?!)"
        )
        self._restore = re.compile(re.escape(_ESC) + "(.)", re.DOTALL)

    def escape(self, value: Any) -> Any:
        """``value`` (messages, tools: dicts, lists, strings) with control strings and the
        escape character replaced in every string, keys included."""
        if isinstance(value, str):
            if self._find.search(value) is None:
                return value
            return self._find.sub(lambda m: self._to[m.group(0)], value)
        if isinstance(value, dict):
            out = {self.escape(k): self.escape(v) for k, v in value.items()}
            if isinstance(value.get("arguments"), str):
                out["arguments"] = self._arguments(value["arguments"], out["arguments"])
            return out
        if isinstance(value, list):
            return [self.escape(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.escape(v) for v in value)
        return value

    def _arguments(self, text: str, escaped_text: str) -> str:
        """Tool-call arguments, which some families decode as JSON before rendering: a control
        string or the escape character written with JSON escapes (``\\u003c|im_end|>``)
        would reappear there, so such arguments are written again from their decoded value,
        escaped. Arguments whose escaping as text suffices are kept as written."""
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            return escaped_text
        escaped = self.escape(decoded)
        if escaped == decoded or json.loads(escaped_text) == escaped:
            return escaped_text
        return json.dumps(escaped, ensure_ascii=False)

    def restore(self, text: str) -> str:
        """Rendered text with the placeholders turned back into what the agent wrote."""
        if _ESC not in text:
            return text
        return self._restore.sub(lambda m: self._back.get(m.group(1), m.group(0)), text)

    def split(self, text: str) -> list[str]:
        """``text`` cut at control strings: text, control, text, control, ..., text."""
        return self._split.split(text)


@dataclass
class TemplateFamily(FamilyDefaults):
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
        vocab_size: embedding rows of the family's checkpoints (their config's ``vocab_size``;
            0: as many as the tokenizer has ids). The engine gate's scripted model has as many.
        gate_model: returns the folder of a real checkpoint the engine gate runs when given
            none (``None``: a scripted tiny model); called only by the engine gate.
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
    vocab_size: int = 0
    gate_model: Callable[[], str] | None = None

    def __post_init__(self) -> None:
        self._compiled = compile_template(self.template)
        self.stop_token_ids: tuple[int, ...] = tuple(
            self.tokenizer.token_id(t) for t in self.stop_tokens
        )
        self._set_escape()
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

    def _set_escape(self) -> None:
        """Set up the escaping of agent text (every ``__post_init__`` calls it)."""
        self._escape = _TextEscape(self.tokenizer.control_tokens())
        self._control_ids = {c: self.tokenizer.token_id(c) for c in self._escape.controls}

    def render_escaped(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """:meth:`render` with every control token's string inside the messages and tools
        (content, names, tool-call arguments, schemas) replaced by a placeholder, so that the
        control strings left in the result are the template's own markup. :meth:`tokenize`
        turns the placeholders back into the agent's text, encoded as ordinary text;
        :meth:`unescape` gives the text a client sees."""
        escape = self._escape
        return self.render(
            escape.escape(list(messages)),
            tools=escape.escape(tools),
            add_generation_prompt=add_generation_prompt,
        )

    def unescape(self, text: str) -> str:
        """Text from :meth:`render_escaped` as :meth:`render` writes it."""
        return self._escape.restore(text)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text, nothing added: each control token's string is its id
        (the template's markup), and the text between them, with the placeholders of
        :meth:`render_escaped` restored, is encoded as ordinary text, so what an agent wrote
        never becomes a control token. Added tokens are split out before pre-tokenization,
        so for text without placeholders this equals encoding the whole at once."""
        escape = self._escape
        if not self._control_ids:
            return self.tokenizer.encode(escape.restore(text))
        ids: list[int] = []
        for i, part in enumerate(escape.split(text)):
            if i % 2:
                ids.append(self._control_ids[part])
            elif part:
                ids.extend(self.tokenizer.encode_text(escape.restore(part)))
        return ids

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

    def run_engine_gate(self, report: GateReport, **options: Any) -> GateReport:
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
