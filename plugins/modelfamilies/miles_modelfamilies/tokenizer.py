"""The two tokenizer back-ends families use, behind one small interface.

Both load from files (no network, no transformers): a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library, or a tiktoken BPE rank file. Each exposes a ``digest`` over what
determines its ids (vocabulary, merges, special tokens, pre-tokenization), which goes into the
family fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

#: An added token written like an XML tag (``<think>``, ``</tool_call>``) that the tokenizer
#: does not mark special: markup a model writes inside its own turn and which Hugging Face's
#: tokenizers match even with ``split_special_tokens``. Every other added token (``<|im_end|>``,
#: ``<|endoftext|>``, DeepSeek's ``<｜User｜>``) is control markup: only a template may write it.
_TAG = re.compile(r"</?\w+>")


def is_control(text: str, *, special: bool) -> bool:
    """Whether the added token ``text`` is control markup (see :data:`_TAG`)."""
    return special or _TAG.fullmatch(text) is None


class TextTokenizer(Protocol):
    """What a family needs from a tokenizer. ``encode`` encodes special tokens in the text as
    their single ids, as ``apply_chat_template(tokenize=True)`` does; ``encode_text`` encodes
    the control tokens' strings as ordinary text (as ``split_special_tokens=True`` does)."""

    digest: str

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def control_tokens(self) -> tuple[str, ...]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, token: str) -> int: ...

    def special_ids(self) -> frozenset[int]: ...

    def size(self) -> int:
        """Number of token ids (ordinary and added)."""
        ...


class JsonTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # imported on use: the plugin module stays light

        data = Path(path).read_bytes()
        self.path = Path(path)
        self.digest = hashlib.sha256(data).hexdigest()
        self._tok = Tokenizer.from_str(data.decode("utf-8"))
        added = self._tok.get_added_tokens_decoder().values()
        self._controls = tuple(
            t.content for t in added if is_control(t.content, special=bool(t.special))
        )
        # A second instance that leaves every control token's text unmatched: the controls
        # marked special (DeepSeek's role tokens are not) and ``encode_special_tokens`` on. A
        # separate instance, because a shared flag toggled per call would race between threads.
        spec = json.loads(data)
        controls = set(self._controls)
        for token in spec.get("added_tokens", []):
            if token.get("content") in controls:
                token["special"] = True
        self._plain = Tokenizer.from_str(json.dumps(spec))
        self._plain.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no BOS/EOS added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with control tokens' strings split as ordinary text (tag-like
        added tokens such as ``<think>`` are still matched)."""
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def control_tokens(self) -> tuple[str, ...]:
        """The added tokens only a template may write (see :func:`is_control`)."""
        return self._controls

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def token_id(self, token: str) -> int:
        """Id of one token; an error if the vocabulary lacks it."""
        found = self._tok.token_to_id(token)
        if found is None:
            raise KeyError(f"token {token!r} is not in the vocabulary of {self.path}")
        return int(found)

    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens (control and markup tokens such as ``<|im_end|>``)."""
        return frozenset(int(i) for i in self._tok.get_added_tokens_decoder())

    def size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))


class TiktokenTokenizer:
    """A tiktoken BPE rank file plus special tokens, with NFC normalization first (as the Qwen
    tokenizers do)."""

    def __init__(
        self, ranks_file: Path, *, pattern: str, special_tokens: Sequence[tuple[int, str]]
    ) -> None:
        import base64

        import tiktoken

        data = Path(ranks_file).read_bytes()
        ranks = {
            base64.b64decode(tok): int(rank)
            for tok, rank in (line.split() for line in data.splitlines() if line)
        }
        specials = {text: index for index, text in special_tokens}
        self._enc = tiktoken.Encoding(
            "miles-tiktoken", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        self._specials = specials
        self._controls = tuple(t for t in specials if is_control(t, special=False))
        # Tag-like added tokens stay matched in text, as in the Hugging Face tokenizers.
        self._tags = frozenset(specials) - frozenset(self._controls)
        meta = json.dumps({"pattern": pattern, "special": sorted(specials.items()), "nfc": True})
        self.digest = hashlib.sha256(data + meta.encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (NFC-normalized), special tokens allowed anywhere."""
        return list(self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all"))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` (NFC-normalized) with control tokens' strings as ordinary
        text; tag-like added tokens (``<think>``) are still matched."""
        return list(
            self._enc.encode(
                unicodedata.normalize("NFC", text),
                allowed_special=self._tags,
                disallowed_special=(),
            )
        )

    def control_tokens(self) -> tuple[str, ...]:
        """The special tokens only a template may write (see :func:`is_control`)."""
        return self._controls

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included. An id past the vocabulary (a model's
        embedding is often padded beyond its tokenizer, and an untrained one samples there)
        decodes to U+FFFD instead of failing the whole sample."""
        ids = list(ids)
        limit = self._enc.n_vocab
        if all(0 <= i < limit for i in ids):
            return str(self._enc.decode(ids))
        out, run = [], []
        for i in ids:
            if 0 <= i < limit:
                run.append(i)
                continue
            out.append(self._enc.decode(run) if run else "")
            out.append("\ufffd")
            run = []
        out.append(self._enc.decode(run) if run else "")
        return "".join(out)

    def token_id(self, token: str) -> int:
        """Id of a special token or of a single-token string."""
        if token in self._specials:
            return self._specials[token]
        ids = self.encode(token)
        if len(ids) != 1:
            raise KeyError(f"{token!r} is not a single token")
        return ids[0]

    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens."""
        return frozenset(self._specials.values())

    def size(self) -> int:
        """Number of token ids: the ranks and the special tokens."""
        return int(max(self._enc.n_vocab, max(self._specials.values(), default=-1) + 1))
