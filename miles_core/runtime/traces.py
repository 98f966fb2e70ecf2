"""Per-rollout traces: a bounded sample of each step's trained groups, one JSON line per sample
in ``<run dir>/traces.jsonl`` (the run config's ``traces`` section), loadable with
``pandas.read_json(path, lines=True)``.

A line's keys (absent where the run has nothing to put there):

* ``step``, ``group`` (the group id), ``sample`` (its index in the group), ``adapter``;
* ``prompt``, ``response``: the texts (the prompt's tokens decoded by the run's family, the
  response as the rollout function decoded it);
* ``reward``, ``finish`` (the finish reason), ``n`` (response tokens in all);
* per kept response token: ``ids`` (token id), ``mask`` (1 where trained), ``lp_e`` (the
  engine's log-prob), ``lp_t`` (the trainer's, before the step's update; ``null`` with a
  backend that does not report it), ``lp_d`` (``lp_t - lp_e``; ``null`` where not trained),
  ``ver`` (the weight version that produced it); ``agree`` (a run with ``rollout.routing``:
  the fraction of MoE layers whose engine-recorded experts are the trainer's own top-k at the
  position that predicts the token, as the forward of ``lp_t`` routed it; ``null`` where the
  token had no record);
* an agent episode's ``turns`` (the session's turn indices), ``turn_rewards`` (when its reward
  scored each turn) and ``messages`` (role, content and tool calls of each message);
* ``cut``: response tokens and text characters left out of this line; ``dropped``: samples of
  this step left out of the file by the byte cap.

Floats are rounded to 6 digits. A step's lines never exceed ``traces.max_bytes_per_step``:
each sample keeps its first ``max_tokens_per_sample`` tokens and ``CHARS_PER_TOKEN`` characters
of each text per token kept; over the cap, every line keeps the most tokens (and text) that
fit, down to none (and ``MIN_CHARS``), then samples are dropped from the end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from miles_core.config import TracesSection
from miles_core.data import Group, Sample

#: the file's name in the run's folder
FILE_NAME = "traces.jsonl"
#: the fewest characters a text keeps when the byte cap cuts texts
MIN_CHARS = 64
#: characters a text may hold per kept token, before the byte cap cuts it
CHARS_PER_TOKEN = 8


def _round(x: float) -> float | None:
    """6 digits; ``None`` for a value JSON cannot hold (an infinite log-prob)."""
    x = float(x)
    return round(x, 6) if math.isfinite(x) else None


def _cut_text(text: str | None, chars: int) -> tuple[str | None, int]:
    """``text`` cut to ``chars`` characters, and how many were cut."""
    if text is None or len(text) <= chars:
        return text, 0
    return text[:chars], len(text) - chars


@dataclass
class _Traced:
    """One traced sample and what its line is made of, before any cut."""

    step: int
    group: Group
    index: int
    sample: Sample
    prompt: str | None

    @cached_property
    def per_token(self) -> dict[str, list[Any] | None]:
        """The per-token lists of every response token (cut per line by slicing)."""
        s = self.sample
        out: dict[str, list[Any] | None] = {"ids": s.response_ids, "mask": s.loss_mask}
        out["lp_e"] = [_round(x) for x in s.logprobs]
        trainer = s.trainer_logprobs
        out["lp_t"] = out["lp_d"] = None
        if trainer is not None:
            out["lp_t"] = [_round(x) for x in trainer]
            out["lp_d"] = [
                _round(t - e) if m and math.isfinite(e) else None
                for t, e, m in zip(trainer, s.logprobs, s.loss_mask, strict=True)
            ]
        out["ver"] = s.versions
        if s.trainer_expert_agreement is not None:
            out["agree"] = [None if x is None else _round(x) for x in s.trainer_expert_agreement]
        return out

    def line(self, tokens: int, chars: int) -> dict[str, Any]:
        """The sample's line with at most ``tokens`` response tokens and ``chars`` characters
        of each text."""
        s = self.sample
        n = len(s.response_ids)
        k = min(tokens, n)
        prompt, cut_p = _cut_text(self.prompt, chars)
        response, cut_r = _cut_text(s.metadata.get("response_text"), chars)
        out: dict[str, Any] = {"step": self.step, "group": self.group.group_id}
        out["sample"] = self.index
        if s.adapter is not None:
            out["adapter"] = s.adapter
        out.update(prompt=prompt, response=response)
        out["reward"] = None if s.reward is None else _round(s.reward)
        out.update(finish=s.finish_reason, n=n)
        out.update({key: None if v is None else v[:k] for key, v in self.per_token.items()})
        cut_m = 0
        if "turns" in s.metadata:
            out["turns"] = list(s.metadata["turns"])
        if s.turn_rewards is not None:
            out["turn_rewards"] = [_round(x) for x in s.turn_rewards]
        if "messages" in s.metadata:
            out["messages"], cut_m = _messages(s.metadata["messages"], chars)
        out["cut"] = {"tokens": n - k, "chars": cut_p + cut_r + cut_m}
        out["dropped"] = 0  # counted in the size before any sample is dropped
        return out


def _messages(messages: Sequence[Mapping[str, Any]], chars: int) -> tuple[list[Any], int]:
    """An episode's messages (role, content, tool calls as JSON text), each text cut to
    ``chars``; and the characters cut."""
    out: list[dict[str, Any]] = []
    cut = 0
    for m in messages:
        content, c1 = _cut_text(str(m.get("content") or ""), chars)
        entry: dict[str, Any] = {"role": m.get("role"), "content": content}
        calls = m.get("tool_calls")
        c2 = 0
        if calls:
            entry["tool_calls"], c2 = _cut_text(json.dumps(calls, default=str), chars)
        cut += c1 + c2
        out.append(entry)
    return out, cut


def _dump(line: Mapping[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n"


def _size(lines: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(_dump(x).encode()) for x in lines)


def _lines(traced: Sequence[_Traced], tokens: int) -> list[dict[str, Any]]:
    """Every line with at most ``tokens`` tokens and ``CHARS_PER_TOKEN`` characters of text
    per token (at least ``MIN_CHARS``)."""
    chars = max(MIN_CHARS, CHARS_PER_TOKEN * tokens)
    return [t.line(tokens, chars) for t in traced]


def fit(traced: Sequence[_Traced], max_tokens: int, max_bytes: int) -> list[dict[str, Any]]:
    """The lines of ``traced`` within ``max_bytes`` in all (module docstring): the most
    tokens per line (and text) that fit first, then samples dropped from the end, each line
    counting the drops."""
    lines = _lines(traced, max_tokens)
    if _size(lines) > max_bytes:
        # the size grows with the tokens kept: the largest count that fits, by bisection
        low, high = 0, max_tokens - 1
        while low < high:
            mid = (low + high + 1) // 2
            if _size(_lines(traced, mid)) <= max_bytes:
                low = mid
            else:
                high = mid - 1
        lines = _lines(traced, low)
    dropped = 0
    while lines:
        for line in lines:
            line["dropped"] = dropped
        if _size(lines) <= max_bytes:
            break
        lines.pop()
        dropped += 1
    return lines


class Traces:
    """Writes a step's traces to ``<run_dir>/traces.jsonl`` (module docstring)."""

    def __init__(self, options: TracesSection, run_dir: Path) -> None:
        self.options = options
        self.path = run_dir / FILE_NAME
        self.failed = False

    def due(self, step: int) -> bool:
        """Whether step ``step`` is traced."""
        o = self.options
        return not self.failed and o.groups_per_step > 0 and o.every > 0 and step % o.every == 0

    def write(
        self, step: int, groups: Sequence[Group], family: Any, log: Callable[[str], None]
    ) -> dict[str, float]:
        """Append step ``step``'s lines (its first ``groups_per_step`` groups) when it is due;
        returns ``traces/bytes`` and ``traces/samples`` written and ``traces/dropped``
        (nothing when not due). A file that cannot be written is reported once through
        ``log``, and tracing stops (the run goes on)."""
        if not self.due(step):
            return {}
        traced = [
            _Traced(step, g, i, s, _prompt_text(s, g, family))
            for g in groups[: self.options.groups_per_step]
            for i, s in enumerate(g.samples)
        ]
        lines = fit(traced, self.options.max_tokens_per_sample, self.options.max_bytes_per_step)
        text = "".join(_dump(x) for x in lines)
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            self.failed = True
            log(f"traces: {self.path} could not be written ({exc}); tracing stops for this run")
            return {}
        return {
            "traces/bytes": float(len(text.encode())),
            "traces/samples": float(len(lines)),
            "traces/dropped": float(len(traced) - len(lines)),
        }


def _prompt_text(sample: Sample, group: Group, family: Any) -> str | None:
    """The prompt as the engine saw it (its tokens decoded by the run's family), else the
    prompt record's ``prompt``."""
    if family is not None and sample.prompt_ids:
        return str(family.decode(list(sample.prompt_ids)))
    prompt = group.prompt.get("prompt")
    return None if prompt is None else str(prompt)
