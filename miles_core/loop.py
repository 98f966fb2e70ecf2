"""The synchronous RL loop: rollout of whole groups -> filters -> train step -> weight sync ->
metrics, step after step, with checkpoints that let a killed run resume where it stopped.

The loop only talks to the contracts of :mod:`miles_core.contracts`: it never knows which
backend, engine, transport or algorithm it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import IO, Any, Literal

from miles_core.buffer import arrival_drop_reason
from miles_core.components import Kind
from miles_core.config import RunConfig
from miles_core.data import Group, reserve_group_ids
from miles_core.errors import MilesUserError
from miles_core.ledger import Ledger
from miles_core.plugins import Plugins


@dataclass
class Parts:
    """The built components of a run."""

    data: Any
    reward: Any
    rollout: Any
    algorithm: Any
    trainer: Any
    launcher: Any
    transport: Any
    family: Any = None
    group_filters: list[Any] = field(default_factory=list)
    sample_filters: list[Any] = field(default_factory=list)
    sinks: list[Any] = field(default_factory=list)


class WithLoss:
    """An algorithm whose per-token loss is replaced by a user's loss function (the run
    config's ``loss``); its advantage estimator and ``needs`` stay the algorithm's."""

    def __init__(self, algorithm: Any, loss_fn: Any) -> None:
        self.algorithm = algorithm
        self.loss_fn = loss_fn
        self.needs: frozenset[str] = getattr(algorithm, "needs", frozenset())

    def compute_advantages(self, batch: Any) -> None:
        """The algorithm's own estimator."""
        self.algorithm.compute_advantages(batch)

    def loss(self, batch: Any, logprobs: Any, **kwargs: Any) -> Any:
        """The user's loss."""
        return self.loss_fn(batch, logprobs, **kwargs)


def build_parts(config: RunConfig, plugins: Plugins) -> Parts:
    """Build every selected component from its validated options."""
    reg = plugins.registry

    def build(kind: Kind, sel: Any) -> Any:
        return reg.get(kind, sel.name).build(sel.options)

    rollout_sel = config.rollout_function
    if rollout_sel is None:
        modality = reg.get(Kind.MODALITY, config.modality.name)
        name = getattr(modality, "default_rollout_function", "")
        if not name:
            raise MilesUserError(
                f"modality {config.modality.name!r} has no default rollout function; "
                "set rollout_function in the run config"
            )
        component = reg.get(Kind.ROLLOUT_FUNCTION, name)
        rollout = component.build(None)
    else:
        rollout = build(Kind.ROLLOUT_FUNCTION, rollout_sel)
    algorithm = build(Kind.ALGORITHM, config.algorithm)
    if config.loss is not None:
        algorithm = WithLoss(algorithm, build(Kind.LOSS_FUNCTION, config.loss))
    family = None
    if config.model.family is not None:
        family = build(Kind.MODEL_FAMILY, config.model.family)
    parts = Parts(
        data=build(Kind.DATA_SOURCE, config.data),
        reward=build(Kind.REWARD_FUNCTION, config.reward),
        rollout=rollout,
        algorithm=algorithm,
        trainer=None,
        launcher=build(Kind.ROLLOUT_ENGINE, config.engine),
        transport=None,
        family=family,
        group_filters=[build(Kind.GROUP_FILTER, s) for s in config.filters.group],
        sample_filters=[build(Kind.SAMPLE_FILTER, s) for s in config.filters.sample],
        sinks=[build(Kind.METRIC_SINK, s) for s in config.metrics.sinks],
    )
    # Placed last: once a placement plugin has reserved devices and started the trainer's
    # host, nothing here can fail and leave them held (closing the trainer releases them).
    placed = plugins.hooks.place(config, parts.launcher)
    if placed is not None:
        parts.trainer, parts.transport, parts.launcher = placed
    elif config.run.placement == "disaggregated":
        raise MilesUserError(
            "run.placement 'disaggregated' needs a placement plugin to put the trainer and the "
            "engines on separate devices, and none is installed: install miles-ray "
            "(pip install miles-ray), or set run.placement: colocated"
        )
    else:
        parts.trainer = build(Kind.TRAINER_BACKEND, config.backend)
        parts.transport = build(Kind.TRANSPORT, config.transport)
    return parts


def run_metadata(config: RunConfig, plugins: Plugins) -> dict[str, Any]:
    """What ran: Python, the core and every plugin distribution with its version."""
    dists = {i.distribution: i.version for i in plugins.pm.infos.values()}
    for extra in ("torch", "transformers"):
        try:
            dists.setdefault(extra, dist_version(extra))
        except Exception:  # not installed: nothing to record
            continue
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "distributions": dict(sorted(dists.items())),
        "config": config.to_plain(),
    }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and length statistics of the groups a step trained on."""
    rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
    lengths = [float(sum(s.loss_mask)) for g in groups for s in g.samples]
    return {
        "reward/mean": _mean(rewards),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length/mean": _mean(lengths),
        "response_length/max": max(lengths, default=0.0),
        "truncated/fraction": _mean(
            [float(s.finish_reason == "length") for g in groups for s in g.samples]
        ),
    }


class SyncLoop:
    """Runs a synchronous RL job described by a validated config."""

    def __init__(
        self,
        config: RunConfig,
        plugins: Plugins,
        *,
        resume: bool = False,
        progress: Literal["auto", "on", "off"] = "auto",
    ) -> None:
        self.config = config
        self.progress_mode = progress
        self.plugins = plugins
        self.hooks = plugins.hooks
        self.resume = resume
        self.run_dir = Path(config.run.output_dir).expanduser() / config.run.name
        self.model_path = str(Path(config.model.path).expanduser())
        self.ledger = Ledger()
        self.step = 0
        self.version = 0
        self.parts: Parts | None = None
        self.clients: list[Any] = []
        self._prompts: Iterator[dict[str, Any]] | None = None
        self.reward_failures = 0
        self.samples_seen = 0
        self.engine_restarts = 0
        self._trainer_asleep = False
        self._eval_prompts: list[dict[str, Any]] | None = None
        self.eval_history: list[tuple[int, float]] = []
        self.progress = Progress(config.run.steps, 0, bar=False)
        # One event loop for the whole run: engine clients keep HTTP sessions bound to it.
        self._aio = asyncio.new_event_loop()
        # The loop knows how many engines join an update; a transport that counts its
        # receivers is told so (a user's differing value is refused in preflight).
        self._user_receivers = self._receivers_set_by_user()
        if config.transport is not None:
            config.transport.options = self.transport_options(self.num_engines)

    @property
    def num_engines(self) -> int:
        """Engine servers the run launches (the engine's ``num_engines`` option, else 1)."""
        return int(getattr(self.config.engine.options, "num_engines", 1) or 1)

    def _receivers_set_by_user(self) -> int | None:
        opts = self.config.transport.options if self.config.transport is not None else None
        if opts is None or "num_receivers" not in getattr(opts, "model_fields_set", ()):
            return None
        return int(opts.num_receivers)

    def transport_options(self, receivers: int) -> Any:
        """The transport's options for an update that ``receivers`` engines join: the run's,
        with ``num_receivers`` set when the transport's options have that field."""
        opts = self.config.transport.options
        if opts is None or "num_receivers" not in type(opts).model_fields:
            return opts
        if opts.num_receivers == receivers:
            return opts
        return opts.model_copy(update={"num_receivers": receivers})

    def _run(self, coro: Any) -> Any:
        return self._aio.run_until_complete(coro)

    # --- set-up -----------------------------------------------------------------------------

    def _checkpoints(self) -> list[Path]:
        root = self.run_dir / "checkpoints"
        done = [p for p in root.glob("step_*") if (p / "loop.json").is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def preflight(self) -> None:
        """Checks of the user's input that need no component: refuse before any work."""
        if not Path(self.model_path).exists():
            raise MilesUserError(f"model.path {self.config.model.path!r} does not exist")
        if self.resume and not self._checkpoints():
            raise MilesUserError(f"--resume: no checkpoint under {self.run_dir}/checkpoints")
        if self._user_receivers is not None and self._user_receivers != self.num_engines:
            raise MilesUserError(
                f"transport.num_receivers is {self._user_receivers}, but the run launches "
                f"{self.num_engines} engine(s) (engine.num_engines); leave num_receivers out: "
                "the loop sets it to the number of engines each update reaches"
            )

    def setup(self) -> None:
        """Build components, start engines, restore a checkpoint when resuming."""
        if not self.resume:
            moved = set_aside_earlier_run(self.run_dir)
            if moved is not None:
                self.progress.log(f"an earlier run in {self.run_dir} was moved to {moved}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "run.json").write_text(
            json.dumps(run_metadata(self.config, self.plugins), indent=2)
        )
        self.parts = parts = build_parts(self.config, self.plugins)
        for sink in parts.sinks:
            sink.open(str(self.run_dir))
        parts.trainer.setup(self.model_path)
        if self.resume:
            self._restore(self._checkpoints()[-1])
        self._prompts = iter(parts.data)
        for i in range(self.num_engines):
            url = parts.launcher.launch(self.model_path, index=i)
            self.clients.append(parts.launcher.client(url))
        if self.version:
            self.sync_weights()  # a resumed run's engines start from the checkpoint's weights
        self.hooks.run_start(self.config, str(self.run_dir))

    def _restore(self, path: Path) -> None:
        assert self.parts is not None
        state = json.loads((path / "loop.json").read_text())
        self.parts.trainer.load(str(path / "trainer"))
        self.parts.data.load_state_dict(state["data"])
        self.ledger = Ledger.from_state_dict(state["ledger"])
        reserve_group_ids(self.ledger.next_id)
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.reward_failures = int(state.get("reward_failures", 0))
        self.samples_seen = int(state.get("samples_seen", 0))
        self.engine_restarts = int(state.get("engine_restarts", 0))

    def save_checkpoint(self) -> Path:
        """Trainer state plus the loop's own (step, version, data position, ledger)."""
        assert self.parts is not None
        path = self.run_dir / "checkpoints" / f"step_{self.step}"
        path.mkdir(parents=True, exist_ok=True)
        asleep = self._trainer_asleep  # an offloaded trainer wakes to save, then sleeps again
        self._set_trainer_awake(True)
        try:
            self.parts.trainer.save(str(path / "trainer"))
        finally:
            self._set_trainer_awake(not asleep)
        state = {
            "step": self.step,
            "version": self.version,
            "data": self.parts.data.state_dict(),
            "ledger": self.ledger.state_dict(),
            "reward_failures": self.reward_failures,
            "samples_seen": self.samples_seen,
            "engine_restarts": self.engine_restarts,
        }
        tmp = path / "loop.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(path / "loop.json")  # written last: a checkpoint without it is incomplete
        return path

    # --- one step ---------------------------------------------------------------------------

    def _sampling_params(self) -> dict[str, Any]:
        r = self.config.rollout
        return {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "max_new_tokens": r.max_new_tokens,
        }

    async def _one_group(self, prompt: dict[str, Any], engine: Any) -> Group:
        assert self.parts is not None
        return await self.parts.rollout(  # type: ignore[no-any-return]
            prompt,
            group_size=self.config.rollout.group_size,
            engine=engine,
            reward=self.parts.reward,
            family=self.parts.family,
            sampling_params=self._sampling_params(),
            step=self.step,
            seed=self.config.run.seed,
        )

    def _arrival_reason(self, group: Group) -> str | None:
        """Count a finished group, announce it, apply the sample filters; the reason it is
        dropped at arrival, or ``None`` to keep it. Both loops judge their groups here."""
        assert self.parts is not None
        self.samples_seen += len(group.samples)
        self.reward_failures += sum("reward_error" in s.metadata for s in group.samples)
        self.hooks.group_finished(group, self.step)
        if not group.failed:
            for keep in self.parts.sample_filters:
                group.samples = [s for s in group.samples if keep(s)]
        filters = self.parts.group_filters
        return arrival_drop_reason(group, lambda g: bool(g.samples) and all(f(g) for f in filters))

    def _judge(self, group: Group) -> bool:
        """Record a finished group in the ledger: keep it, or drop it with a reason."""
        reason = self._arrival_reason(group)
        if reason is not None:
            self.ledger.drop(group.group_id, reason)
            return False
        return True

    async def rollout(self) -> tuple[list[Group], dict[str, float]]:
        """Generate until ``groups_per_step`` groups are kept (at most 4x as many tries)."""
        assert self._prompts is not None
        want = self.config.rollout.groups_per_step
        kept: list[Group] = []
        tries = 0
        t0 = time.perf_counter()
        tokens = 0
        while len(kept) < want and tries < 4 * want:
            batch = []
            for i in range(want - len(kept)):
                try:
                    prompt = next(self._prompts)
                except StopIteration:
                    break
                batch.append((prompt, self.clients[(tries + i) % len(self.clients)]))
            if not batch:
                break
            tries += len(batch)
            results = await asyncio.gather(*(self._one_group(p, e) for p, e in batch))
            for group in results:
                self.ledger.start(group.group_id)
                tokens += group.num_generated_tokens
                if self._judge(group):
                    kept.append(group)
            if any(g.failed for g in results):
                await self._heal_engines()  # a dead engine is back, re-synced, before the retry
        seconds = time.perf_counter() - t0
        return kept, {
            "time/rollout_s": seconds,
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
            "rollout/groups_tried": float(tries),
        }

    def _set_trainer_awake(self, awake: bool) -> None:
        assert self.parts is not None
        if awake and self._trainer_asleep:
            self.parts.trainer.wake()
        elif not awake and not self._trainer_asleep:
            self.parts.trainer.sleep()
        self._trainer_asleep = not awake

    async def _engines_memory(self, what: str) -> None:
        """Every engine releases (``release``) or takes back (``resume``) its memory."""
        await asyncio.gather(*(getattr(c, f"{what}_memory_occupation")() for c in self.clients))

    # --- engine failures ----------------------------------------------------------------------

    #: how long an engine may take to answer /health before it counts as dead
    HEALTH_TIMEOUT_S = 20.0

    async def _alive(self, client: Any) -> bool:
        """Whether the engine answers ``/health`` within :attr:`HEALTH_TIMEOUT_S`."""
        try:
            return bool(await asyncio.wait_for(client.health(), self.HEALTH_TIMEOUT_S))
        except Exception:
            return False

    async def _dead_engines(self) -> list[int]:
        states = await asyncio.gather(*(self._alive(c) for c in self.clients))
        return [i for i, ok in enumerate(states) if not ok]

    def _renew_transport(self, receivers: int | None = None) -> Any:
        """A new weight sender for a new set of ``receivers`` engines (default: all of them):
        the old one's connections and groups included a dead engine. A placed sender renews
        itself where it lives."""
        assert self.parts is not None
        old = self.parts.transport
        options = self.transport_options(len(self.clients) if receivers is None else receivers)
        renew = getattr(old, "renew", None)
        if callable(renew):
            return renew(options)
        with contextlib.suppress(Exception):
            old.close()
        sel = self.config.transport
        return self.plugins.registry.get(Kind.TRANSPORT, sel.name).build(options)

    def heal_engines(self) -> int:
        """Restart every engine that stopped answering, then send the current weights to every
        engine through a new sender before any of them serves again. Returns how many engines
        were restarted (their in-flight groups were already dropped as failed)."""
        restarted: int = self._run(self._heal_engines())
        return restarted

    async def _heal_engines(self) -> int:
        """:meth:`heal_engines` on the run's event loop (a rollout heals in the middle)."""
        assert self.parts is not None
        dead = await self._dead_engines()
        if not dead:
            return 0
        parts = self.parts
        for i in dead:
            self.progress.log(f"engine {i} stopped answering: restarting it")
            close = getattr(self.clients[i], "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
            stop = getattr(parts.launcher, "stop", None)
            if stop is not None:
                await asyncio.to_thread(stop, i)  # whatever is left of it: a hung server, a port
            url = await asyncio.to_thread(parts.launcher.launch, self.model_path, index=i)
            self.clients[i] = parts.launcher.client(url)
        self.engine_restarts += len(dead)
        parts.transport = await asyncio.to_thread(self._renew_transport)
        await self._sync_weights()
        return len(dead)

    def sync_weights(self) -> dict[str, float]:
        """Stream the trainer's weights to every engine through the transport."""
        metrics: dict[str, float] = self._run(self._sync_weights())
        return metrics

    async def _sync_weights(self, clients: Sequence[Any] | None = None) -> dict[str, float]:
        """:meth:`sync_weights` on the run's event loop (the asynchronous loop awaits it);
        ``clients``: the engines this update reaches (default: all), which the sender was
        built for."""
        assert self.parts is not None
        parts = self.parts
        targets = list(self.clients if clients is None else clients)
        opts = self.transport_options(len(targets))
        options = opts.model_dump(mode="json") if opts is not None else {}
        t0 = time.perf_counter()
        sender = parts.transport
        result: dict[str, Any] = {}
        asleep = self._trainer_asleep  # an offloaded trainer wakes to export (engine restarts)
        if asleep:
            await asyncio.to_thread(self._set_trainer_awake, True)

        def send() -> None:
            try:
                result["metrics"] = sender.send(
                    parts.trainer.export_weights(), version=self.version
                )
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=send, name="miles-weight-sync", daemon=True)
        thread.start()

        async def receive() -> None:
            answers = await asyncio.gather(
                *(
                    client.receive_weights(
                        transport=self.config.transport.name,
                        options=options,
                        address=list(sender.address),
                        rank=rank,
                        version=self.version,
                    )
                    for rank, client in enumerate(targets, start=1)
                ),
                return_exceptions=True,
            )
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                result.setdefault("error", failed[0])
                if not hasattr(sender, "renew"):  # in this process: unblock the sender now
                    with contextlib.suppress(Exception):
                        sender.close()

        await receive()
        await asyncio.to_thread(thread.join)
        if asleep:
            await asyncio.to_thread(self._set_trainer_awake, False)
        if "error" in result:
            raise RuntimeError(
                f"weight sync to version {self.version} failed: {result['error']}; the engines "
                "stay on their previous weights"
            ) from result["error"]
        metrics = {
            k if k.startswith("sync/") else f"sync/{k}": float(v)
            for k, v in (result.get("metrics") or {}).items()
            if isinstance(v, (int, float))
        }
        metrics["time/sync_s"] = time.perf_counter() - t0
        return metrics

    def train_step(self) -> dict[str, float]:
        """One step: rollout, train, sync; returns the step's metrics."""
        assert self.parts is not None
        self.step += 1
        self.heal_engines()
        groups, rollout_metrics = self._run(self.rollout())
        metrics: dict[str, float] = dict(rollout_metrics)
        if not groups:
            raise MilesUserError(
                f"step {self.step}: no group survived the filters "
                f"({self.ledger.counts()}); the data source may be exhausted"
            )
        self.hooks.before_train_step(self.step, groups)
        t0 = time.perf_counter()
        if self.config.run.offload:  # the engines make room, then the trainer takes it back
            self._run(self._engines_memory("release"))
            self._set_trainer_awake(True)
        train_metrics = self.parts.trainer.train_step(groups, self.parts.algorithm)
        if self.config.run.offload:  # the engines take their memory back to receive the weights
            self._run(self._engines_memory("resume"))
        metrics["time/train_s"] = time.perf_counter() - t0
        for g in groups:
            self.ledger.train(g.group_id)
        self.version = int(self.parts.trainer.weight_version)
        self.hooks.after_train_step(self.step, groups, train_metrics)
        try:
            sync = self.sync_weights()
        except RuntimeError:
            if not self.heal_engines():  # an engine died during the sync: heal, which re-syncs
                raise
            sync = {"time/sync_s": 0.0}
        if self.config.run.offload:
            self._set_trainer_awake(False)  # asleep while the engines generate
        self.hooks.after_weight_sync(self.step, self.version, sync)
        self.ledger.check()
        metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        metrics.update(group_metrics(groups))
        metrics.update(sync)
        metrics.update({f"ledger/{k}": float(v) for k, v in self.ledger.counts().items()})
        metrics["reward/failure_rate"] = self.reward_failures / max(self.samples_seen, 1)
        metrics["data/skipped_rows"] = float(self.skipped_rows())
        metrics["engine/restarts"] = float(self.engine_restarts)
        metrics["weight_version"] = float(self.version)
        return metrics

    def skipped_rows(self) -> int:
        """Malformed rows the training data source skipped (0 for a source that counts none)."""
        data = self.parts.data if self.parts is not None else None
        return int(getattr(data, "skipped", 0) or 0)

    async def _evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy: one sample per prompt at temperature 0, scored by the run's
        reward (a failed sample scores 0)."""
        assert self.parts is not None
        ev = self.config.eval
        if ev.data is None:
            return {}
        if self._eval_prompts is None:
            source = self.plugins.registry.get(Kind.DATA_SOURCE, ev.data.name).build(
                ev.data.options
            )
            self._eval_prompts = list(itertools.islice(iter(source), ev.limit))
        params = {
            "temperature": 0.0,
            "max_new_tokens": ev.max_new_tokens or self.config.rollout.max_new_tokens,
        }
        t0 = time.perf_counter()
        groups = await asyncio.gather(
            *(
                self.parts.rollout(
                    prompt,
                    group_size=1,
                    engine=self.clients[i % len(self.clients)],
                    reward=self.parts.reward,
                    family=self.parts.family,
                    sampling_params=params,
                    step=self.step,
                )
                for i, prompt in enumerate(self._eval_prompts)
            )
        )
        scores = [float(g.samples[0].reward or 0.0) for g in groups]
        n = len(scores)
        acc = _mean(scores)
        self.eval_history.append((self.step, acc))
        return {
            "eval/accuracy": acc,
            "eval/stderr": math.sqrt(max(acc * (1 - acc), 0.0) / max(n, 1)),
            "eval/n": float(n),
            "time/eval_s": time.perf_counter() - t0,
        }

    def evaluate(self) -> dict[str, float]:
        """Run the held-out evaluation now and emit its metrics at the current step."""
        metrics: dict[str, float] = self._run(self._evaluate())
        if metrics:
            self.emit(metrics)
            self.progress.log(
                f"eval at step {self.step}: accuracy {metrics['eval/accuracy']:.3f} "
                f"± {metrics['eval/stderr']:.3f} on {int(metrics['eval/n'])} held-out prompts"
            )
        return metrics

    def emit(self, metrics: Mapping[str, float]) -> None:
        """Write a step's metrics to every sink, then announce them."""
        assert self.parts is not None
        for sink in self.parts.sinks:
            sink.write(self.step, metrics)
        self.hooks.metrics_emitted(self.step, metrics)

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        """Run every step; whatever happens, save the state and end the run cleanly."""
        self.preflight()
        status = "failed"
        # Engines run in sessions of their own; the guard stops them if this process is killed
        # before close() can.
        guard = OrphanGuard.start()
        try:
            self.setup()
            every = self.config.run.checkpoint_every
            eval_every = self.config.eval.every
            self.progress = Progress(
                self.config.run.steps, self.step, bar=progress_bar_wanted(self.progress_mode)
            )
            if self.step == 0:
                self.evaluate()
            while self.step < self.config.run.steps:
                t0 = time.perf_counter()
                metrics = self.train_step()
                metrics["time/step_s"] = time.perf_counter() - t0
                metrics["samples_per_s"] = (
                    self.config.rollout.groups_per_step
                    * self.config.rollout.group_size
                    / metrics["time/step_s"]
                )
                self.emit(metrics)
                self.progress.step_done(self.step, metrics)
                if eval_every and self.step % eval_every == 0:
                    self.evaluate()
                if every and self.step % every == 0:
                    self.save_checkpoint()
            if not (eval_every and self.step % eval_every == 0):
                self.evaluate()
            self.progress.close()  # before the final JSON line, which must stay stdout's last
            self.report()
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.progress.close()
            try:
                self.close(status)
            finally:
                if guard is not None:
                    guard.stop()

    def report(self) -> None:
        """Write eval.json and the plot; print the run's final JSON line."""
        path = self.run_dir / "eval.json"
        previous = json.loads(path.read_text()) if path.is_file() else {}
        history = [*previous.get("history", []), *self.eval_history]
        summary: dict[str, Any] = {"history": history}
        if history:
            summary.update(
                accuracy_before=history[0][1],
                accuracy_after=history[-1][1],
                n_heldout=len(self._eval_prompts or []),
            )
        path.write_text(json.dumps(summary, indent=2))
        plot_path = write_plot(self.run_dir)
        final = {k: v for k, v in summary.items() if k != "history"}
        final["steps"] = self.step
        final["skipped_rows"] = self.skipped_rows()
        final["reward_failure_rate"] = self.reward_failures / max(self.samples_seen, 1)
        final["run_dir"] = str(self.run_dir)
        if plot_path is not None:
            final["plot"] = str(plot_path)
        print(json.dumps(final), flush=True)

    def close(self, status: str) -> None:
        """Save the ledger, close sinks and engines, announce the end."""
        (self.run_dir / "ledger.json").write_text(json.dumps(self.ledger.counts(), indent=2))
        if self.parts is not None:
            parts = self.parts
            # Whatever fails while saving, the engines, the sender and the trainer (and what a
            # placement reserved for them) are released.
            try:
                if status == "completed" and self.step and not self._checkpoints_at(self.step):
                    self.save_checkpoint()
                for sink in parts.sinks:
                    sink.close()
                for client in self.clients:
                    close = getattr(client, "close", None)
                    if close is not None:
                        self._run(close())
            finally:
                try:
                    parts.transport.close()
                finally:
                    try:
                        parts.launcher.shutdown()
                    finally:
                        parts.trainer.close()
        self._aio.close()
        self.hooks.run_end(self.config, str(self.run_dir), status)

    def _checkpoints_at(self, step: int) -> bool:
        return (self.run_dir / "checkpoints" / f"step_{step}" / "loop.json").is_file()


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """A new run (not ``--resume``) starts in an empty folder: what an earlier run of the same
    name left there (metrics, checkpoints, ledger) is renamed to ``<name>.<UTC time>`` beside
    it, not overwritten or mixed in. Returns the new name, or ``None`` when there was nothing."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.{stamp}.{n}")
    run_dir.rename(target)
    return target


def write_plot(run_dir: Path) -> Path | None:
    """Plot reward and held-out accuracy per step from metrics.jsonl into plot.png (needs
    matplotlib; without it the run says so and writes no plot)."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    # A resumed run logs again the steps after its checkpoint: the last row of a step wins.
    trained = {r["step"]: r for r in rows if "reward/mean" in r}
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    reward = [(k, r["reward/mean"]) for k, r in sorted(trained.items())]
    acc = [(k, r["eval/accuracy"], r.get("eval/stderr", 0.0)) for k, r in sorted(evals.items())]
    fig, ax = plt.subplots(figsize=(7, 4))
    if reward:
        ax.plot(*zip(*reward, strict=True), marker=".", label="train reward (mean)")
    if acc:
        steps, values, errors = zip(*acc, strict=True)
        ax.errorbar(
            steps, values, yerr=errors, marker="o", capsize=3, label="held-out accuracy (greedy)"
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def progress_bar_wanted(mode: str) -> bool:
    """``auto`` draws the live bar only when stdout and stderr are both terminals (a piped or
    logged run gets the per-step lines alone); ``on`` and ``off`` force it."""
    if mode != "auto":
        return mode == "on"
    return sys.stdout.isatty() and sys.stderr.isatty()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Step progress on stderr: one line per step with its rates and ETA, always, and a live
    bar (tqdm when installed, else a carriage-return line) when ``bar`` is true. Lines go out
    through the bar, so it never splits them; stdout is left to the final JSON line."""

    def __init__(self, total: int, start: int, *, bar: bool, stream: IO[str] | None = None) -> None:
        self.total = total
        self.start = start
        self.done = start
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()
        self._bar = bar
        self._line = ""  # the carriage-return bar's current text
        self._tqdm: Any = None
        if bar:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
            except ImportError:  # the plain bar below does the job
                pass
            else:
                self._tqdm = tqdm(
                    total=total,
                    initial=start,
                    file=self.stream,
                    unit="step",
                    desc="train",
                    dynamic_ncols=True,
                )

    def eta_s(self) -> float | None:
        """Seconds left at the mean step time of this process's steps (``None`` before one)."""
        steps = self.done - self.start
        if steps <= 0:
            return None
        return (time.monotonic() - self._t0) / steps * (self.total - self.done)

    def log(self, line: str) -> None:
        """Write one line without breaking the bar."""
        if self._tqdm is not None:
            self._tqdm.write(line, file=self.stream)
        elif self._line:
            self.stream.write(f"\r\x1b[K{line}\n{self._line}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step_done(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log a finished step's line and move the bar."""
        self.done = step
        reward = metrics.get("reward/mean", 0.0)
        rates = (
            f"{metrics.get('samples_per_s', 0.0):.2f} samples/s | "
            f"{metrics.get('rollout/tokens_per_s', 0.0):.1f} tokens/s"
        )
        eta = _clock(self.eta_s())
        # The bar moves first, so the line below is written with the bar already at this step.
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(f"reward {reward:.3f} | {rates}", refresh=False)
            self._tqdm.update(step - self._tqdm.n)
        elif self._bar:
            width = 24
            filled = width * step // max(self.total, 1)
            self._line = (
                f"train [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} | "
                f"reward {reward:.3f} | {rates} | eta {eta}"
            )
        self.log(
            f"step {step}/{self.total} | reward {reward:.3f} | {rates} | "
            f"rollout {metrics.get('time/rollout_s', 0.0):.1f}s "
            f"train {metrics.get('time/train_s', 0.0):.1f}s "
            f"sync {metrics.get('time/sync_s', 0.0):.1f}s | eta {eta}"
        )

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = ""
        self._bar = False


# Run by the guard process with ``python -c``: no import of miles, so it starts fast and small.
_GUARD_SOURCE = r"""
import os, select, signal, sys, time

parent, me = int(sys.argv[1]), os.getpid()


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()  # state, ppid, ...; [19] = start time


def tree():
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat(name)
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append((int(name), fields[19]))
    found, todo = {}, [parent]
    while todo:
        for pid, start in kids.get(todo.pop(), ()):
            if pid != me and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def alive(pid, start):
    fields = stat(pid)
    return fields is not None and fields[19] == start and fields[0] not in (b"Z", b"X")


signal.signal(signal.SIGINT, signal.SIG_IGN)
known, said = {}, b""
while True:
    if select.select([0], [], [], 0.5)[0]:
        chunk = os.read(0, 64)
        said += chunk
        if b"done" in said:
            sys.exit(0)
        if chunk:
            continue
        break  # the pipe closed without "done": the parent is gone
    if os.getppid() != parent:
        break
    found = tree()
    if os.getppid() == parent:  # the parent lived through the scan: the tree is complete
        known = found
for sig in (signal.SIGTERM, signal.SIGKILL):
    left = [pid for pid, start in known.items() if alive(pid, start)]
    for pid in left:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p, known[p]) for p in left):
        time.sleep(0.1)
"""


class OrphanGuard:
    """A small watchdog process that stops this process's descendants if it dies without
    ending the run (SIGKILL, the OOM killer). Engine servers run in sessions of their own, so
    nothing else would reach them: they would keep their memory and ports forever.

    Every half second the guard records the process tree under its parent (from ``/proc``);
    when the parent goes away without :meth:`stop`, it sends SIGTERM, then SIGKILL, to every
    recorded process that still runs (matched by start time, so a reused pid is spared).
    Linux only; elsewhere :meth:`start` returns ``None``."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls) -> OrphanGuard | None:
        """Start the guard of this process (``None`` where there is no ``/proc``)."""
        if not sys.platform.startswith("linux") or not Path("/proc/self/stat").is_file():
            return None
        process = subprocess.Popen(
            [sys.executable, "-c", _GUARD_SOURCE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal's process group spares it
        )
        return cls(process)

    def stop(self) -> None:
        """The run ended in this process: the guard exits and touches nothing."""
        stdin = self.process.stdin
        try:
            if stdin is not None:
                stdin.write(b"done\n")
                stdin.close()
        except OSError:  # the guard is already gone
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
