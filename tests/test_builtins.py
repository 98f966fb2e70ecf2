"""The core's default plugins meet their contracts and do their jobs."""

from __future__ import annotations

import itertools
import json

import pytest

from miles_core.builtins.data_sources import JsonlOptions
from miles_core.components import Kind
from miles_core.data import Group, Sample
from miles_core.errors import MilesUserError
from miles_core.testing.contracts import check_component


def _scored(text: str, reward: float | None = None) -> Sample:
    s = Sample(prompt_ids=[1], metadata={"response_text": text})
    s.reward = reward
    return s


def test_rewards(miles_registry):
    reg = miles_registry()
    exact = check_component(reg.get(Kind.REWARD_FUNCTION, "exact_match"))
    last = check_component(reg.get(Kind.REWARD_FUNCTION, "last_number"))
    assert exact(_scored(" 42 "), {"answer": "42"}) == 1.0
    assert exact(_scored("41"), {"answer": "42"}) == 0.0
    assert last(_scored("6 * 7 = 42"), {"answer": 42}) == 1.0
    assert last(_scored("the answer is 1,234.0"), {"answer": "1234"}) == 1.0
    assert last(_scored("42 or 43"), {"answer": "42"}) == 0.0
    assert last(_scored("no idea"), {"answer": "42"}) == 0.0
    with pytest.raises(ValueError, match="response_text"):
        last(Sample(prompt_ids=[1]), {"answer": "1"})


def test_filters(miles_registry):
    reg = miles_registry()
    variance = check_component(reg.get(Kind.GROUP_FILTER, "reward_variance"))
    truncated = check_component(reg.get(Kind.SAMPLE_FILTER, "truncated"))
    assert not variance(Group(samples=[_scored("a", 1.0), _scored("b", 1.0)]))
    assert variance(Group(samples=[_scored("a", 1.0), _scored("b", 0.0)]))
    s = _scored("x")
    s.finish_reason = "length"
    assert not truncated(s) and truncated(_scored("y"))


def test_jsonl_source_skips_and_counts_bad_rows_and_resumes(miles_registry, tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)]
    path.write_text(
        "\n".join(
            [
                rows[0],
                "{not json",
                rows[1],
                "[1, 2]",
                rows[2],
                json.dumps({"question": "no prompt key"}),
                rows[3],
                rows[4],
            ]
        )
    )
    component = miles_registry().get(Kind.DATA_SOURCE, "jsonl")
    src = check_component(component, options=JsonlOptions(path=str(path), seed=3))
    assert src.skipped == 3 and len(src.rows) == 5
    fresh = component.build(JsonlOptions(path=str(path), seed=3))
    it = iter(fresh)
    first_epoch = [next(it)["prompt"] for _ in range(5)]
    assert sorted(first_epoch) == [f"q{i}" for i in range(5)]
    state = fresh.state_dict()
    upcoming = [next(it)["prompt"] for _ in range(3)]
    resumed = component.build(JsonlOptions(path=str(path), seed=3))
    resumed.load_state_dict(state)
    assert [r["prompt"] for r, _ in zip(resumed, range(3), strict=False)] == upcoming
    with pytest.raises(MilesUserError, match="line 2"):
        component.build(JsonlOptions(path=str(path), on_bad_row="error"))
    with pytest.raises(MilesUserError, match="does not exist"):
        component.build(JsonlOptions(path=str(tmp_path / "nope.jsonl")))


def test_jsonl_metric_sink_writes_one_line_per_step(miles_registry, tmp_path):
    sink = check_component(miles_registry().get(Kind.METRIC_SINK, "jsonl"))
    sink.open(str(tmp_path))
    sink.write(1, {"reward/mean": 0.25})
    sink.write(2, {"reward/mean": 0.5})
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["reward/mean"]) for x in lines] == [(1, 0.25), (2, 0.5)]


def test_stdout_sink(miles_registry, capsys):
    sink = check_component(miles_registry().get(Kind.METRIC_SINK, "stdout"))
    capsys.readouterr()
    sink.write(3, {"b": 2.0, "a": 1.0})
    assert capsys.readouterr().out == "step 3 | a 1 | b 2\n"


def test_reasoning_gym_source_and_reward(miles_registry):
    from miles_core.builtins.reasoning_gym import ReasoningGymOptions, ReasoningGymRewardOptions

    reg = miles_registry()
    options = ReasoningGymOptions(
        task="chain_sum", size=5, seed=7, task_config={"min_terms": 2, "max_terms": 2}
    )
    src = check_component(reg.get(Kind.DATA_SOURCE, "reasoning_gym"), options=options)
    record = next(iter(src))
    assert record["prompt"].startswith("State the final answer")
    reward = reg.get(Kind.REWARD_FUNCTION, "reasoning_gym").build(ReasoningGymRewardOptions())
    right = Sample(prompt_ids=[1], metadata={"response_text": f"So: {record['answer']}"})
    wrong = Sample(prompt_ids=[1], metadata={"response_text": "no idea"})
    assert reward(right, record) == 1.0 and reward(wrong, record) == 0.0
    held_out = reg.get(Kind.DATA_SOURCE, "reasoning_gym").build(
        ReasoningGymOptions(task="chain_sum", size=5, seed=8)
    )
    assert [r["prompt"] for r in itertools.islice(iter(held_out), 5)] != [
        src.record(i)["prompt"] for i in range(5)
    ]
    with pytest.raises(MilesUserError, match="no_such_task"):
        reg.get(Kind.DATA_SOURCE, "reasoning_gym").build(ReasoningGymOptions(task="no_such_task"))


def test_tensorboard_sink_writes_event_files(miles_registry, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = check_component(miles_registry().get(Kind.METRIC_SINK, "tensorboard"))
    sink.open(str(tmp_path))
    sink.write(1, {"reward/mean": 0.25})
    sink.write(2, {"reward/mean": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
