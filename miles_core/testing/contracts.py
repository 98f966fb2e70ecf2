"""Contract checks that any plugin's components must pass; plugin authors call them in tests.

``check_component`` checks the registration record (name, options schema, compatibility
declarations, factory) and, with ``build=True``, builds the object and checks it against its
kind's protocol and behaviour. Engine, transport and backend plugins add the behavioural suites
of their kinds (real servers, real process groups) on top.
"""

from __future__ import annotations

import copy
import json
import tempfile
from typing import Any

from pydantic import BaseModel, ValidationError

from miles_core import contracts as c
from miles_core.components import Component, Kind
from miles_core.data import Group, Sample

PROTOCOLS: dict[Kind, type | None] = {
    Kind.TRAINER_BACKEND: c.Trainer,
    Kind.ROLLOUT_ENGINE: c.EngineLauncher,
    Kind.ALGORITHM: c.AlgorithmImpl,
    Kind.TRANSPORT: c.WeightTransport,
    Kind.MODEL_FAMILY: c.Family,
    Kind.MODALITY: None,
    Kind.ROLLOUT_FUNCTION: c.RolloutFn,
    Kind.REWARD_FUNCTION: c.RewardFn,
    Kind.SAMPLE_FILTER: c.SampleFilterFn,
    Kind.GROUP_FILTER: c.GroupFilterFn,
    Kind.LOSS_FUNCTION: c.LossFn,
    Kind.DATA_SOURCE: c.PromptSource,
    Kind.METRIC_SINK: c.MetricWriter,
    Kind.ROUTER: c.Router,
    Kind.SCHEDULE: c.Schedule,
    Kind.ADAPTER: c.AdapterImpl,
}


def _example_sample(reward: float | None = None) -> Sample:
    s = Sample(prompt_ids=[1, 2, 3], metadata={"response_text": "42"})
    s.append([4, 5], logprobs=[-0.5, -0.25], version=0)
    s.reward = reward
    return s


def check_options_schema(component: Component) -> None:
    """The options model exports a JSON schema and rejects unknown keys."""
    if component.config is None:
        return
    json.dumps(component.config.model_json_schema())
    try:
        component.config.model_validate({"__surely_not_an_option__": 1})
    except ValidationError as exc:
        kinds = {e["type"] for e in exc.errors()}
        assert "extra_forbidden" in kinds or "missing" in kinds, (
            f"{component.kind.label} {component.name!r}: its options model must forbid "
            "unknown keys (model_config = ConfigDict(extra='forbid'))"
        )
    else:
        raise AssertionError(
            f"{component.kind.label} {component.name!r}: its options model accepts unknown keys; "
            "set model_config = ConfigDict(extra='forbid') so typos are reported"
        )


def check_component(
    component: Component,
    *,
    build: bool = True,
    options: BaseModel | None = None,
    example: Sample | None = None,
) -> Any:
    """Check a registered component against its kind's contract; returns the built object
    (``None`` when ``build`` is False). ``example`` is the sample that rewards and filters are
    exercised on; pass one of your modality's when it is not text."""
    assert isinstance(component, Component), f"{component!r} is not a miles component record"
    check_options_schema(component)
    factory = component.load()
    assert callable(factory)
    json.dumps(component.describe())
    if not build:
        return None
    obj = component.build(options)
    proto = PROTOCOLS[component.kind]
    if proto is not None:
        assert isinstance(obj, proto), (
            f"{component.kind.label} {component.name!r} builds {type(obj).__name__}, which does "
            f"not implement miles_core.contracts.{proto.__name__}"
        )
    check = _BEHAVIOUR.get(component.kind)
    if check is not None:
        check(obj, example or _example_sample())
    return obj


def _reward(obj: Any, sample: Sample) -> None:
    value = obj(sample, {"prompt": "What is 6 * 7?", "answer": "42"})
    assert isinstance(value, (int, float)), f"a reward function returned {type(value).__name__}"


def _sample_filter(obj: Any, sample: Sample) -> None:
    assert isinstance(obj(sample), bool), "a sample filter must return a bool"


def _group_filter(obj: Any, sample: Sample) -> None:
    a, b = copy.deepcopy(sample), copy.deepcopy(sample)
    a.reward, b.reward = 0.0, 1.0
    group = Group(samples=[a, b])
    assert isinstance(obj(group), bool), "a group filter must return a bool"


def _data_source(obj: Any, _sample: Sample) -> None:
    it = iter(obj)
    first = next(it)
    assert isinstance(first, dict), "a data source yields dict prompt records"
    assert "prompt" in first or "messages" in first, "a prompt record needs prompt or messages"
    state = obj.state_dict()
    json.dumps(state)
    second = next(it)
    obj.load_state_dict(state)
    assert next(iter(obj)) == second, "a data source must resume from its state_dict"


def _metric_sink(obj: Any, _sample: Sample) -> None:
    with tempfile.TemporaryDirectory() as d:
        obj.open(d)
        obj.write(1, {"reward/mean": 0.5})
        obj.close()


_BEHAVIOUR = {
    Kind.REWARD_FUNCTION: _reward,
    Kind.SAMPLE_FILTER: _sample_filter,
    Kind.GROUP_FILTER: _group_filter,
    Kind.DATA_SOURCE: _data_source,
    Kind.METRIC_SINK: _metric_sink,
}
