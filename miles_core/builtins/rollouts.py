"""The default text rollout: one chat turn per sample, rendered and tokenized by the family."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import random
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import RolloutFunction
from miles_core.contracts import RewardFn
from miles_core.data import Group, Sample


class SingleTurnOptions(BaseModel):
    """Options of the ``single_turn`` rollout function."""

    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = Field(None, description="prepended as a system message")
    prompt_suffix: str = Field("", description="appended to every prompt's text")


def messages_for(prompt: Mapping[str, Any], options: SingleTurnOptions) -> list[dict[str, Any]]:
    """The chat messages of a prompt record (``messages``, or ``prompt`` as one user turn)."""
    if "messages" in prompt:
        messages = [dict(m) for m in prompt["messages"]]
    else:
        messages = [{"role": "user", "content": f"{prompt['prompt']}{options.prompt_suffix}"}]
    if options.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": options.system_prompt})
    return messages


def response_text(family: Any, output_ids: list[int], finish_reason: str) -> str:
    """Decoded response without the stop token that ended it."""
    ids = output_ids
    if finish_reason == "stop" and ids and ids[-1] in tuple(family.stop_token_ids):
        ids = ids[:-1]
    return str(family.decode(ids))


def _reward_name(reward: RewardFn) -> str:
    """A reward's name for error messages: a function's own name, else its class's."""
    if inspect.isfunction(reward) or inspect.ismethod(reward):
        return reward.__qualname__
    return type(reward).__qualname__


def score(sample: Sample, prompt: Mapping[str, Any], reward: RewardFn) -> None:
    """Score a sample; a reward function that raises, or returns NaN, an infinity or no
    number at all, fails the sample, not the run.

    The failed sample keeps a reward of 0.0, ``finish_reason="error"`` and the reason in
    ``metadata["reward_error"]``; the loop counts it in ``reward/failure_rate`` and drops its
    group as ``failed`` in the ledger, so no gradient is taken from a made-up reward (a 0.0
    trained on would punish whatever response made the reward function crash, and a NaN would
    turn the whole group's advantages into NaN)."""
    error: str | None = None
    try:
        value = reward(sample, prompt)
    except Exception as exc:  # a user's reward bug is recorded per sample and counted
        error = f"{type(exc).__name__}: {exc}"
    else:
        number: float | None = None
        if not isinstance(value, (str, bytes)):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
        if number is None:
            error = f"reward {_reward_name(reward)} returned {type(value).__name__}, not a number"
        elif not math.isfinite(number):
            error = f"reward {_reward_name(reward)} returned {number}, not a finite number"
        else:
            sample.reward = number
            error = _check_turn_rewards(sample, _reward_name(reward))
    if error is not None:
        sample.reward = 0.0
        sample.finish_reason = "error"
        sample.metadata["reward_error"] = error


def _check_turn_rewards(sample: Sample, name: str) -> str | None:
    """What is wrong with the turn rewards a reward function set on ``sample``, or ``None``."""
    values = sample.turn_rewards
    if values is None:
        return None
    turns = len(sample.turns())
    if not isinstance(values, list) or len(values) != turns:
        return f"reward {name} set turn_rewards to {values!r}, not a list of {turns} numbers"
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad or not all(math.isfinite(v) for v in values):
        return f"reward {name} set turn_rewards {values!r}: each must be a finite number"
    sample.turn_rewards = [float(v) for v in values]
    return None


class SingleTurn:
    """Renders the prompt with the model family, generates ``group_size`` responses on the
    engine (each with its own seed), decodes and scores them. A failed request becomes a
    sample with ``finish_reason="error"``, so its group is dropped and counted, not lost."""

    def __init__(self, options: SingleTurnOptions) -> None:
        self.options = options

    async def __call__(
        self,
        prompt: Mapping[str, Any],
        *,
        group_size: int,
        engine: Any,
        reward: RewardFn,
        **context: Any,
    ) -> Group:
        family = context.get("family")
        if family is None:
            raise ValueError(
                "rollout function 'single_turn' needs model.family to render and tokenize "
                "prompts; name the model's family in the run config"
            )
        text = family.render(messages_for(prompt, self.options), add_generation_prompt=True)
        prompt_ids = list(family.tokenize(text))
        params = dict(context.get("sampling_params") or {})
        params.setdefault("stop_token_ids", list(family.stop_token_ids))
        # Seeds depend only on the run's seed, the step and the prompt, so a resumed run
        # samples what the uninterrupted run would have.
        key = json.dumps([context.get("seed", 0), context.get("step", 0), text])
        rng = random.Random(hashlib.sha256(key.encode()).hexdigest())
        seeds = [rng.randrange(2**31) for _ in range(group_size)]
        results = await asyncio.gather(
            *(engine.generate(prompt_ids, {**params, "sampling_seed": s}) for s in seeds),
            return_exceptions=True,
        )
        samples = []
        for result in results:
            if isinstance(result, BaseException):
                failed = Sample(prompt_ids=prompt_ids, finish_reason="error")
                failed.metadata["error"] = f"{type(result).__name__}: {result}"
                samples.append(failed)
                continue
            reason = result.finish_reason if result.finish_reason in ("stop", "length") else "abort"
            sample = Sample(prompt_ids=prompt_ids, finish_reason=reason)
            sample.append(
                list(result.output_ids),
                logprobs=list(result.logprobs),
                version=int(result.weight_version or 0),
                # the routing record, when the run asked the engine for it (rollout.routing)
                routed_experts=result.routed_experts,
            )
            # what the engine drew with: the trainer truncates the same way (top_p, top_k)
            sample.sampling_params = {
                k: params[k] for k in ("temperature", "top_p", "top_k") if k in params
            }
            sample.metadata["response_text"] = response_text(family, sample.response_ids, reason)
            if not sample.failed:
                score(sample, prompt, reward)
            samples.append(sample)
        return Group(samples=samples, prompt=dict(prompt))


@hookimpl
def miles_register_rollout_functions(register):  # type: ignore[no-untyped-def]
    register(
        RolloutFunction(
            name="single_turn",
            factory=SingleTurn,
            config=SingleTurnOptions,
            description="one chat turn per sample, rendered by the model family",
            requires={"modality": ["text"]},
        )
    )
