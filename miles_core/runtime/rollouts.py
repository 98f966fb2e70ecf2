"""Starting groups: the next prompt, the group's ledger entry, and the rollout function called
with what the run knows. Both schedules and the evaluation generate through here."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from typing import Any

from miles_core.config import RunConfig
from miles_core.data import Group, Prompt, new_group_id
from miles_core.ledger import DropReason, Ledger
from miles_core.runtime.parts import Parts
from miles_core.runtime.routes import AdapterRequests, RoutedRequests
from miles_core.runtime.teacher import Teacher


class Rollouts:
    """Prompts in, groups out. A group is entered in the ledger (``in_flight``) the moment it
    starts, in both schedules; a rollout function that raises drops it as ``rollout_failed``
    and the error goes on to stop the run."""

    def __init__(self, config: RunConfig, parts: Parts, ledger: Ledger) -> None:
        self.config = config
        self.parts = parts
        self.ledger = ledger
        #: prompts of dropped groups to generate again (``buffer.on_drop: retry``)
        self.retry: deque[dict[str, Any]] = deque()
        #: the distillation teacher that scores every finished group (the config's ``teacher``)
        self.teacher: Teacher | None = None
        self._prompts: Iterator[dict[str, Any]] | None = None
        self.exhausted = False

    def next_prompt(self) -> dict[str, Any] | None:
        """A prompt to retry, else the data source's next one; ``None`` once it is exhausted."""
        if self.retry:
            return self.retry.popleft()
        if self.exhausted:
            return None
        if self._prompts is None:  # after a checkpoint restored the source's position
            self._prompts = iter(self.parts.data)
        try:
            return next(self._prompts)
        except StopIteration:
            self.exhausted = True
            return None

    def sampling_params(self) -> dict[str, Any]:
        """The run config's sampling parameters, as the engine takes them."""
        r = self.config.rollout
        return {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "max_new_tokens": r.max_new_tokens,
        }

    async def group(
        self, prompt: dict[str, Any], engine: Any, step: int, *, teach: bool = True
    ) -> Group:
        """Generate and score one group of ``prompt`` on ``engine``, tracked by the ledger;
        with a teacher, the teacher scores it too unless ``teach`` is False (the caller then
        calls :meth:`teach` once it has let go of the engine)."""
        gid = new_group_id()
        adapter = self.adapter_of(prompt)
        self.ledger.start(gid, adapter)
        try:
            group: Group = await self.parts.rollout(
                prompt,
                group_size=self.config.rollout.group_size,
                engine=self.routed(self.engine_for(engine, adapter)),
                reward=self.reward_for(adapter),
                family=self.parts.family,
                modality=self.parts.modality,
                sampling_params=self.sampling_params(),
                step=step,
                seed=self.config.run.seed,
            )
        except asyncio.CancelledError:
            raise  # the run is ending: the schedule drops what it cancelled as run_ended
        except Exception:
            self.ledger.drop(gid, DropReason.ROLLOUT_FAILED)
            raise
        group.group_id = gid
        group.adapter = adapter
        for sample in group.samples:
            sample.adapter = adapter
        if teach:
            await self.teach(group)
        return group

    def adapter_of(self, prompt: dict[str, Any]) -> str | None:
        """The adapter a prompt is for: the one it names (a run with several), else the run's
        one adapter, else ``None`` (the whole model trains)."""
        if isinstance(prompt, Prompt) and prompt.adapter is not None:
            return prompt.adapter
        return self.parts.adapters[0].name if len(self.parts.adapters) == 1 else None

    def engine_for(self, engine: Any, adapter: str | None) -> Any:
        """``engine`` generating with ``adapter`` (SGLang's ``lora_path``) when the run trains
        several (with one, every client of the fleet already names it)."""
        if adapter is None or len(self.parts.adapters) < 2:
            return engine
        return AdapterRequests(engine, adapter)

    def routed(self, engine: Any) -> Any:
        """``engine`` asking for the routed experts of every generation when the run records
        or replays the routing (``rollout.routing``); as it is otherwise."""
        if self.config.rollout.routing == "none":
            return engine
        return RoutedRequests(engine)

    def reward_for(self, adapter: str | None) -> Any:
        """The adapter's own reward function, else the run's."""
        return self.parts.rewards.get(adapter or "", self.parts.reward)

    async def teach(self, group: Group) -> None:
        """The teacher's log-probs of the group's samples (nothing without a teacher, or for a
        group that failed anyway); a teacher whose engine cannot be started again drops the
        group and stops the run."""
        if self.teacher is None or group.failed:
            return
        try:
            await self.teacher.score(group)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.ledger.drop(group.group_id, DropReason.TEACHER_FAILED)
            raise

    async def greedy(
        self,
        prompts: list[dict[str, Any]],
        engines: list[Any],
        step: int,
        adapter: str | None = None,
    ) -> Any:
        """One greedy sample per prompt (temperature 0), spread over ``engines``, by the
        evaluation's rollout function; not part of the ledger (held-out evaluation). With
        ``adapter``, generated by that adapter and scored by its reward."""
        engines = [self.engine_for(e, adapter) for e in engines]
        ev = self.config.eval
        params = {
            "temperature": 0.0,
            "max_new_tokens": ev.max_new_tokens or self.config.rollout.max_new_tokens,
        }
        return await asyncio.gather(
            *(
                self.parts.eval_rollout(
                    prompt,
                    group_size=1,
                    engine=engines[i % len(engines)],
                    reward=self.reward_for(adapter),
                    family=self.parts.family,
                    modality=self.parts.modality,
                    sampling_params=params,
                    step=step,
                )
                for i, prompt in enumerate(prompts)
            )
        )

    async def heldout(
        self, records: list[dict[str, Any]], engines: list[Any], step: int
    ) -> list[Group]:
        """The groups the run's rollout function makes of held-out ``records`` (a rollout
        function that does not generate: samples from data); not part of the ledger."""
        return list(
            await asyncio.gather(
                *(
                    self.parts.rollout(
                        record,
                        group_size=1,
                        engine=engines[i % len(engines)],
                        reward=self.parts.reward,
                        family=self.parts.family,
                        modality=self.parts.modality,
                        sampling_params=self.sampling_params(),
                        step=step,
                        seed=self.config.run.seed,
                    )
                    for i, record in enumerate(records)
                )
            )
        )
