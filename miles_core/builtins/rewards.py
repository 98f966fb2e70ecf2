"""Built-in reward functions for tasks whose prompt record carries a reference answer."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import RewardFunction
from miles_core.data import Sample

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _response_text(sample: Sample) -> str:
    text = sample.metadata.get("response_text")
    if not isinstance(text, str):
        raise ValueError("sample.metadata['response_text'] is missing: the rollout must decode it")
    return text


class ExactMatchOptions(BaseModel):
    """Options of ``exact_match``."""

    model_config = ConfigDict(extra="forbid")
    answer_key: str = Field("answer", description="prompt-record field holding the answer")
    strip: bool = True
    case_sensitive: bool = True


class ExactMatch:
    """1.0 when the response equals the reference answer, else 0.0."""

    def __init__(self, options: ExactMatchOptions) -> None:
        self.options = options

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        got, want = _response_text(sample), str(prompt[self.options.answer_key])
        if self.options.strip:
            got, want = got.strip(), want.strip()
        if not self.options.case_sensitive:
            got, want = got.lower(), want.lower()
        return 1.0 if got == want else 0.0


class LastNumberOptions(BaseModel):
    """Options of ``last_number``."""

    model_config = ConfigDict(extra="forbid")
    answer_key: str = Field("answer", description="prompt-record field holding the answer")
    tolerance: float = Field(1e-6, ge=0.0)


class LastNumber:
    """1.0 when the last number in the response equals the numeric reference answer."""

    def __init__(self, options: LastNumberOptions) -> None:
        self.options = options

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        found = _NUMBER.findall(_response_text(sample))
        if not found:
            return 0.0
        got = float(found[-1].replace(",", ""))
        want = float(str(prompt[self.options.answer_key]).replace(",", ""))
        return 1.0 if math.isclose(got, want, abs_tol=self.options.tolerance) else 0.0


@hookimpl
def miles_register_reward_functions(register):  # type: ignore[no-untyped-def]
    register(
        RewardFunction(
            name="exact_match",
            factory=ExactMatch,
            config=ExactMatchOptions,
            description="1 if the response equals the prompt's answer",
        )
    )
    register(
        RewardFunction(
            name="last_number",
            factory=LastNumber,
            config=LastNumberOptions,
            description="1 if the last number in the response equals the answer",
        )
    )
