"""The held-out evaluation of a run: greedy accuracy on the serving engines (each adapter's
of a run that trains several), the trainer's loss on held-out samples, their history, and the
summary that ends up in ``eval.json``."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from miles_core.components import Kind
from miles_core.config import RunConfig
from miles_core.data import Group
from miles_core.registry import Registry
from miles_core.runtime.rollouts import Rollouts


class Evaluation:
    """What the held-out evaluation generates from, and what it found so far."""

    def __init__(self, config: RunConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.eval_history: list[tuple[int, float]] = []
        self.loss_history: list[tuple[int, float]] = []
        self._eval_prompts: list[dict[str, Any]] | None = None
        self._loss_records: list[dict[str, Any]] | None = None
        #: each adapter's held-out prompts and (step, accuracy) (a run with ``adapters``)
        self._adapter_prompts: dict[str, list[dict[str, Any]]] = {}
        self.adapter_history: dict[str, list[tuple[int, float]]] = {}

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` within the run: before training and every
        ``eval.every`` steps (the run also evaluates once after its last step)."""
        every = self.config.eval.every
        return step == 0 or bool(every and step % every == 0)

    async def accuracy(self, rollouts: Rollouts, engines: list[Any], step: int) -> dict[str, float]:
        """Greedy held-out accuracy: one sample per prompt at temperature 0, scored by the
        run's reward (a failed sample scores 0). Empty when the config has no eval data. A run
        that trains several adapters evaluates each on its own ``eval_data`` (else the run's)
        with its own reward (``eval/<name>/...``); ``eval/accuracy`` is then their mean."""
        t0 = time.perf_counter()
        if self.config.adapters:
            metrics = await self._adapters(rollouts, engines, step)
        elif self.config.eval.data is None:
            return {}
        else:
            if self._eval_prompts is None:
                self._eval_prompts = self._first_records(self.config.eval.data)
            metrics = _accuracy(await rollouts.greedy(self._eval_prompts, engines, step))
        if metrics:
            metrics["time/eval_s"] = time.perf_counter() - t0
        return metrics

    async def _adapters(
        self, rollouts: Rollouts, engines: list[Any], step: int
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        accs, variances, total = [], [], 0.0
        for entry in self.config.adapters:
            selection = entry.eval_data or self.config.eval.data
            if selection is None:
                continue
            if entry.name not in self._adapter_prompts:
                self._adapter_prompts[entry.name] = self._first_records(selection)
            prompts = self._adapter_prompts[entry.name]
            mine = _accuracy(await rollouts.greedy(prompts, engines, step, adapter=entry.name))
            out.update({k.replace("eval/", f"eval/{entry.name}/"): v for k, v in mine.items()})
            self.adapter_history.setdefault(entry.name, []).append((step, mine["eval/accuracy"]))
            accs.append(mine["eval/accuracy"])
            variances.append(mine["eval/stderr"] ** 2)
            total += mine["eval/n"]
        if accs:
            out["eval/accuracy"] = statistics.fmean(accs)
            out["eval/stderr"] = math.sqrt(sum(variances)) / len(accs)
            out["eval/n"] = total
        return out

    def _first_records(self, selection: Any) -> list[dict[str, Any]]:
        source = self.registry.get(Kind.DATA_SOURCE, selection.name).build(selection.options)
        return list(itertools.islice(iter(source), self.config.eval.limit))

    async def heldout_groups(
        self, rollouts: Rollouts, engines: list[Any], step: int
    ) -> list[Group]:
        """The samples the held-out loss is taken on: the first ``eval.limit`` records of
        ``eval.loss_data`` through the run's rollout function. Empty without loss data."""
        selection = self.config.eval.loss_data
        if selection is None:
            return []
        if self._loss_records is None:
            self._loss_records = self._first_records(selection)
        return await rollouts.heldout(self._loss_records, engines, step)

    def record(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Keep an evaluation made at ``step`` in the history; what it found, in words."""
        said = []
        if "eval/accuracy" in metrics:
            self.eval_history.append((step, metrics["eval/accuracy"]))
            said.append(
                f"accuracy {metrics['eval/accuracy']:.3f} ± {metrics['eval/stderr']:.3f} on "
                f"{int(metrics['eval/n'])} held-out prompts"
            )
        for name in self.adapter_history:
            if f"eval/{name}/accuracy" in metrics:
                said.append(
                    f"{name} {metrics[f'eval/{name}/accuracy']:.3f} ± "
                    f"{metrics[f'eval/{name}/stderr']:.3f}"
                )
        if "eval/loss" in metrics:
            self.loss_history.append((step, metrics["eval/loss"]))
            said.append(
                f"loss {metrics['eval/loss']:.4f} on {int(metrics['eval/loss_n'])} held-out "
                "conversations"
            )
        return said

    def summary(self, previous: Mapping[str, Any]) -> dict[str, Any]:
        """``eval.json``: this run's evaluations after a resumed one's (``previous``)."""
        history = [*previous.get("history", []), *self.eval_history]
        losses = [*previous.get("loss_history", []), *self.loss_history]
        summary: dict[str, Any] = {"history": history}
        if history:
            summary.update(
                accuracy_before=history[0][1],
                accuracy_after=history[-1][1],
                n_heldout=len(self._eval_prompts or []),
            )
        if losses:
            summary.update(
                loss_history=losses,
                loss_before=losses[0][1],
                loss_after=losses[-1][1],
                n_heldout_loss=len(self._loss_records or []),
            )
        adapters = previous.get("adapters", {})
        for name, runs in self.adapter_history.items():
            mine = [*adapters.get(name, {}).get("history", []), *runs]
            adapters[name] = {
                "history": mine,
                "accuracy_before": mine[0][1],
                "accuracy_after": mine[-1][1],
                "n_heldout": len(self._adapter_prompts.get(name, [])),
            }
        if adapters:
            summary["adapters"] = adapters
        return summary


def _accuracy(groups: Sequence[Group]) -> dict[str, float]:
    """The mean reward of greedy held-out samples (1.0 = correct), its standard error and n."""
    scores = [float(g.samples[0].reward or 0.0) for g in groups]
    n = len(scores)
    acc = statistics.fmean(scores) if scores else 0.0
    return {
        "eval/accuracy": acc,
        "eval/stderr": math.sqrt(max(acc * (1 - acc), 0.0) / max(n, 1)),
        "eval/n": float(n),
    }
