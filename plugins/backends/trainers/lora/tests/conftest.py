"""A tiny random Llama checkpoint, groups and reference helpers for the LoRA adapter's tests,
from :mod:`miles_trainer_common.testing` (the trainer backends' tests share them): the groups
have no untrained tokens, and ``hf.logprobs`` gives the log-probs alone, without grad."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from miles_trainer_common.testing import (  # noqa: F401 (a fixture pytest finds here)
    hf_model,
    hf_response_logprobs,
    llama_path,
    make_groups,
)

from miles_core.data import Group


@pytest.fixture
def groups() -> Callable[..., list[Group]]:
    """``make_groups`` without untrained tokens in the responses."""
    return partial(make_groups, env_tokens=False)


@pytest.fixture
def hf() -> Any:
    """Reference helpers: ``hf.model(path)`` and ``hf.logprobs(model, groups)``."""

    class _HF:
        model = staticmethod(hf_model)
        logprobs = staticmethod(hf_response_logprobs)

    return _HF
