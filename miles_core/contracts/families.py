"""What the gates, the rollouts and the session server ask of a model family, and the defaults
a family can inherit.

:class:`Family` declares every attribute and method they read; nothing outside it is looked
up on a family object. :class:`FamilyDefaults` holds the values a family may leave as they are
(the roles a ChatML template renders, no reasoning, no escaping of agent text, no engine
gate): the shipped families subclass it, and a third-party family may too, or declare every
member itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from miles_core.families.report import GateReport


@runtime_checkable
class Family(Protocol):
    """A verified pairing of chat template, tool-call parser and reasoning parser."""

    name: str
    #: One line for ``miles family list``.
    description: str
    #: Roles the template renders and a session may append.
    roles: tuple[str, ...]
    #: Whether assistant turns carry reasoning in this configuration.
    thinking: bool
    #: The generation prompt opens the reasoning block, so every assistant turn has reasoning
    #: (the gates give turns without any a filler reasoning).
    always_reasons: bool
    #: The template renders system messages after the first one.
    system_anywhere: bool
    #: Strings that end an assistant turn (each one token), shown by ``miles family list``.
    stop_tokens: tuple[str, ...]
    stop_token_ids: tuple[int, ...]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text: special tokens as their ids, nothing added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def fingerprint_parts(self) -> dict[str, str]:
        """sha256 per part (template, template arguments, tokenizer, parsers...), so a stale
        certificate can say what changed; ``fingerprint`` hashes them together."""
        ...

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str: ...

    def render_escaped(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """:meth:`render` with the control-token strings of agent text escaped, so that
        :meth:`tokenize` encodes them as text (the session server renders with it)."""
        ...

    def unescape(self, text: str) -> str:
        """Text from :meth:`render_escaped` as :meth:`render` writes it."""
        ...

    def parse_assistant(self, text: str) -> dict[str, Any]:
        """Split generated text into content, reasoning and tool calls."""
        ...

    def fingerprint(self) -> str:
        """Hash of template, tokenizer and parsers that a gate certificate is bound to."""
        ...

    def run_engine_gate(self, report: GateReport, **options: Any) -> GateReport:
        """The engine gate: a real engine drives a scripted session through the family's stop
        tokens and parsers; adds its failures and details to ``report``. ``options`` are the
        family's own (``url``, ``model``...)."""
        ...


class FamilyDefaults:
    """The defaults of :class:`Family`'s optional members. A subclass still brings ``name``,
    ``stop_token_ids``, ``render``, ``parse_assistant``, ``tokenize``, ``decode`` and
    ``fingerprint``, and overrides what differs."""

    name: str
    description: str = ""
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")
    thinking: bool = False
    always_reasons: bool = False
    system_anywhere: bool = True
    stop_tokens: tuple[str, ...] = ()

    def render_escaped(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The plain render: without an escape, agent text is rendered as written."""
        render = self.render  # type: ignore[attr-defined]
        return str(render(messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def unescape(self, text: str) -> str:
        """``text`` itself (:meth:`render_escaped` escapes nothing)."""
        return text

    def fingerprint_parts(self) -> dict[str, str]:
        """No parts: a stale certificate says only that the fingerprint changed."""
        return {}

    def run_engine_gate(self, report: GateReport, **options: Any) -> GateReport:
        """A family without an engine gate fails it, saying so."""
        report.add_failure(
            "engine",
            "scripted_session",
            "family",
            f"family {self.name!r} has no engine gate (run_engine_gate)",
        )
        return report
