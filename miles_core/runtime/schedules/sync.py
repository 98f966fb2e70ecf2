"""The synchronous schedule: generate a step's groups, then train on them, then publish; the
engines idle while the trainer trains (which is what colocated placement needs)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles_core.data import Group
from miles_core.ledger import DropReason
from miles_core.runtime.fleet import Route, RouteEngine
from miles_core.runtime.schedules import ScheduleContext


class SyncSchedule:
    """Each step generates until ``rollout.groups_per_step`` groups are kept (at most 4x as
    many tries), spread over the fleet's routes; dead engines are restarted and re-synced
    before the step and after a failed group, so a retry lands on a live engine."""

    def __init__(self, options: Any = None) -> None:
        self.ctx: ScheduleContext | None = None

    def attach(self, ctx: ScheduleContext) -> None:
        """Take the run's parts; called once before the first step."""
        self.ctx = ctx

    async def next_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups step ``step`` trains on, with the rollout's metrics."""
        assert self.ctx is not None
        ctx = self.ctx
        await ctx.fleet.heal()
        want = ctx.config.rollout.groups_per_step
        kept: list[Group] = []
        tries = tokens = 0
        t0 = time.perf_counter()
        while len(kept) < want and tries < 4 * want:
            prompts: list[dict[str, Any]] = []
            while len(prompts) < want - len(kept) and (p := ctx.rollouts.next_prompt()):
                prompts.append(p)
            if not prompts:
                break
            routes = [self._route(tries + i) for i in range(len(prompts))]
            groups = await asyncio.gather(
                *(
                    ctx.rollouts.group(p, RouteEngine(route), step)
                    for p, route in zip(prompts, routes, strict=True)
                )
            )
            tries += len(prompts)
            for group, route in zip(groups, routes, strict=True):
                tokens += group.num_generated_tokens
                reason = ctx.judge.verdict(group, step)
                if reason is not None and route not in ctx.fleet.routes:
                    reason = DropReason.ENGINE_LEFT  # its engine left the job under it
                if reason is None:
                    kept.append(group)
                else:
                    ctx.ledger.drop(group.group_id, reason)
            if any(g.failed for g in groups):
                await ctx.fleet.heal()  # a dead engine is back, re-synced, before the retry
        seconds = time.perf_counter() - t0
        return kept, {
            "time/rollout_s": seconds,
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
            "rollout/groups_tried": float(tries),
        }

    def _route(self, turn: int) -> Route:
        """The fleet's route for the ``turn``-th group of the step (a retry goes to the next)."""
        assert self.ctx is not None
        route = self.ctx.fleet.choose_route(turn)
        if route is None:
            raise RuntimeError("no engine serves after the fleet restarted the dead ones")
        return route

    async def publish(self, version: int) -> dict[str, float]:
        """Nothing generates between steps: the update needs no pause."""
        assert self.ctx is not None
        return await self.ctx.fleet.publish(version)

    async def metrics(self, version: int) -> dict[str, float]:
        """No per-step state of its own beyond the rollout's."""
        return {}

    async def stop(self) -> None:
        """Nothing runs between steps."""
