"""The single_turn rollout's own logic, in isolation (the engine e2e tests use a real engine)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from miles_core.builtins.rewards import LastNumber, LastNumberOptions
from miles_core.builtins.rollouts import SingleTurn, SingleTurnOptions
from miles_core.hooks import Hooks
from miles_core.ledger import DropReason
from miles_core.plugins import create_plugin_manager
from miles_core.runtime.judge import Judge

STOP = 0


class CharFamily:
    """One token per character (id = code point), stop token 0."""

    stop_token_ids = (STOP,)

    def render(self, messages, *, tools=None, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def tokenize(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@dataclass
class Result:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str
    routed_experts: None = None


class ScriptedEngine:
    """Answers each request from a script; records what it was sent."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.sent = []

    async def generate(self, input_ids, sampling_params=None, *, return_logprob=True, rid=None):
        self.sent.append((list(input_ids), dict(sampling_params or {})))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        text, reason = answer
        ids = [ord(c) for c in text] + ([STOP] if reason == "stop" else [])
        return Result(ids, [-0.5] * len(ids), reason, "3")


def test_single_turn_renders_generates_decodes_and_scores():
    engine = ScriptedEngine([("it is 42", "stop"), ("41", "length"), (RuntimeError("gone"))])
    fn = SingleTurn(SingleTurnOptions(system_prompt="Be brief.", prompt_suffix=" Number only."))
    group = asyncio.run(
        fn(
            {"prompt": "6*7?", "answer": "42"},
            group_size=3,
            engine=engine,
            reward=LastNumber(LastNumberOptions()),
            family=CharFamily(),
            sampling_params={"temperature": 1.0, "max_new_tokens": 16},
        )
    )
    sent_ids, params = engine.sent[0]
    assert "".join(map(chr, sent_ids)) == "[system]Be brief.[user]6*7? Number only.[assistant]"
    assert params["stop_token_ids"] == [STOP] and params["max_new_tokens"] == 16
    assert len({p["sampling_seed"] for _, p in engine.sent}) == 3
    ok, truncated, failed = group.samples
    assert ok.metadata["response_text"] == "it is 42" and ok.reward == 1.0
    assert ok.versions == [3] * 9 and ok.loss_mask == [1] * 9
    assert truncated.finish_reason == "length" and truncated.reward == 0.0
    assert failed.finish_reason == "error" and "gone" in failed.metadata["error"]
    assert group.failed


def test_a_raising_reward_fails_the_sample_not_the_run():
    def broken(sample, prompt):
        raise KeyError("answer")

    group = asyncio.run(
        SingleTurn(SingleTurnOptions())(
            {"prompt": "q"},
            group_size=1,
            engine=ScriptedEngine([("x", "stop")]),
            reward=broken,
            family=CharFamily(),
        )
    )
    (s,) = group.samples
    assert s.finish_reason == "error" and "KeyError" in s.metadata["reward_error"]


class NanReward:
    """A reward whose arithmetic went wrong: it returns what it is given, NaN included."""

    def __init__(self, value):
        self.value = value

    def __call__(self, sample, prompt):
        return self.value


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (float("nan"), "returned nan, not a finite number"),
        (float("inf"), "returned inf, not a finite number"),
        (float("-inf"), "returned -inf, not a finite number"),
        (None, "returned NoneType, not a number"),
        ("0.5", "returned str, not a number"),
    ],
)
def test_a_nan_or_non_number_reward_fails_the_sample_like_a_raising_one(value, says):
    group = asyncio.run(
        SingleTurn(SingleTurnOptions())(
            {"prompt": "q"},
            group_size=2,
            engine=ScriptedEngine([("x", "stop"), ("y", "stop")]),
            reward=NanReward(value),
            family=CharFamily(),
        )
    )
    for s in group.samples:
        assert s.finish_reason == "error" and s.reward == 0.0
        assert s.metadata["reward_error"] == f"reward NanReward {says}"
    assert group.failed
    # the judge drops the group as reward_failed and counts every sample: never trained on
    pm = create_plugin_manager(autoload=False, trace=False)
    judge = Judge(Hooks(pm), [], [])
    assert judge.verdict(group, 1) is DropReason.REWARD_FAILED
    assert judge.reward_failures == 2


def test_a_finite_number_of_another_type_is_a_reward():
    group = asyncio.run(
        SingleTurn(SingleTurnOptions())(
            {"prompt": "q"},
            group_size=1,
            engine=ScriptedEngine([("x", "stop")]),
            reward=lambda sample, prompt: True,
            family=CharFamily(),
        )
    )
    (s,) = group.samples
    assert s.finish_reason == "stop" and s.reward == 1.0 and "reward_error" not in s.metadata


def test_single_turn_needs_a_family():
    with pytest.raises(ValueError, match=r"model\.family"):
        asyncio.run(
            SingleTurn(SingleTurnOptions())(
                {"prompt": "q"}, group_size=1, engine=ScriptedEngine([]), reward=lambda s, p: 0.0
            )
        )


def test_seeds_depend_on_run_seed_step_and_prompt_only():
    def seeds(**context):
        engine = ScriptedEngine([("1", "stop")] * 3)
        asyncio.run(
            SingleTurn(SingleTurnOptions())(
                {"prompt": "q"},
                group_size=3,
                engine=engine,
                reward=lambda s, p: 0.0,
                family=CharFamily(),
                **context,
            )
        )
        return [p["sampling_seed"] for _, p in engine.sent]

    assert seeds(seed=1, step=2) == seeds(seed=1, step=2)  # a resumed run samples the same
    assert seeds(seed=1, step=2) != seeds(seed=1, step=3)
    assert seeds(seed=1, step=2) != seeds(seed=2, step=2)


def test_a_configured_loss_function_replaces_the_algorithms_loss():
    from miles_core.runtime.parts import WithLoss

    class Algo:
        needs = frozenset({"old_logprobs"})

        def compute_advantages(self, batch):
            batch.append("advantages")

        def loss(self, batch, logprobs, **kw):
            return "algorithm loss"

    wrapped = WithLoss(Algo(), lambda batch, logprobs, **kw: ("user loss", kw))
    batch: list[str] = []
    wrapped.compute_advantages(batch)
    assert batch == ["advantages"] and wrapped.needs == frozenset({"old_logprobs"})
    assert wrapped.loss(batch, None, entropy=1) == ("user loss", {"entropy": 1})
