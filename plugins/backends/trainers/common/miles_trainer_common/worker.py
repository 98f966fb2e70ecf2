"""One trainer rank, written once: everything a rank does that is not model-specific.

:class:`TrainerRank` holds the step (micro-batch rounds, the algorithm's advantages and loss,
the loss's gradient pushed through the model one micro-batch at a time, the optimizer step, the
LR schedule), the reference and behaviour log-probs, the critic's step, one update per adapter,
routing replay's batch side, the true on-policy check, the checkpoint's common part and resume,
sleep/wake and the streamed export. A backend subclasses it and supplies only what differs: how
the model is built and sharded (:meth:`~TrainerRank.setup`), one micro-batch's forward and
backward (:meth:`~TrainerRank._policy_round`, :meth:`~TrainerRank._value_round`,
:meth:`~TrainerRank._backward_round`), its gradient reduction and optimizer step
(:meth:`~TrainerRank._step`), and how its weights are named and gathered (the ``_*_tensors``
methods).

Every method that runs the model is collective: all ranks call it with the same arguments and
run the same number of rounds (a data-parallel replica with fewer micro-batches runs padding
rounds whose results are discarded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from miles_core.contracts import AlgorithmImpl
from miles_trainer_common.agreement import behaviour_logprobs
from miles_trainer_common.batch import (
    PackedBatch,
    assign_to_ranks,
    pack,
    plan_by_length,
    plan_groups,
    token_batch,
)
from miles_trainer_common.controller import by_adapter, train_by_adapter
from miles_trainer_common.logprobs import by_group, check_on_policy
from miles_trainer_common.rank import check_algorithm
from miles_trainer_common.rank_state import Pairs, RankState, join_group

__all__ = [
    "Pairs",
    "RankState",
    "Round",
    "TrainerRank",
    "finish_step",
    "join_group",
    "loss_gradients",
]


@dataclass
class Round:
    """One micro-batch's forward on this rank: ``out`` the log-probs (or a critic's values)
    ``[rows, width]`` where this rank computes them (``None`` on a pipeline stage that hands
    its activations on), ``ent`` the entropies, ``width`` the columns of the loss's gradient
    its backward takes, ``state`` what the backend's backward needs besides."""

    out: Tensor | None
    ent: Tensor | None
    width: int
    state: Any = None


def finish_step(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, norm: float
) -> tuple[float, float, bool]:
    """After clipping: one optimizer step (skipped on a non-finite gradient norm, which would
    poison AdamW's moments), one schedule step; returns ``(norm, lr used, skipped)``."""
    lr = float(scheduler.get_last_lr()[0])
    skipped = not math.isfinite(norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    scheduler.step()
    return norm, lr, skipped


def loss_gradients(
    algorithm: AlgorithmImpl, batch: Any, lp: Tensor, ent: Tensor, values: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, float]]:
    """The whole batch's loss as a function of its log-probs and entropies (and the critic's
    values), and its gradient with respect to each: ``(g_lp, g_ent, g_values, metrics)``.
    The gradient is then pushed through the model one micro-batch at a time, so any
    aggregation (token mean, sequence mean, constant, sequence ratios) is exactly that of one
    big batch, whatever the split."""
    lp_leaf = lp.clone().requires_grad_(True)
    ent_leaf = ent.clone().requires_grad_(True)
    leaves = [lp_leaf, ent_leaf]
    if values is not None:
        v_leaf = values.clone().requires_grad_(True)
        leaves.append(v_leaf)
        loss, metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf, values=v_leaf)
    else:
        loss, metrics = algorithm.loss(batch, lp_leaf, entropy=ent_leaf)
    grads: list[Tensor | None] = [None] * len(leaves)
    if loss.requires_grad:
        grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    g_values = None
    if values is not None:
        g_values = grads[2] if grads[2] is not None else torch.zeros_like(lp)
    return g_lp, grads[1], g_values, {k: float(v) for k, v in metrics.items()}


def backward_outputs(
    round_: Round, g_out: Tensor, g_ent: Tensor | None, device: torch.device
) -> None:
    """Backpropagate a round from the loss's gradient with respect to its outputs (and its
    entropies, when both are there)."""
    assert round_.out is not None
    outputs, grads = [round_.out], [g_out.to(device)]
    if g_ent is not None and round_.ent is not None:
        outputs.append(round_.ent)
        grads.append(g_ent.to(device))
    torch.autograd.backward(outputs, grads)


def replica_plan(
    packed: PackedBatch, budget: int, shares_prompts: bool, replicas: int, replica: int
) -> tuple[list[list[int]], int, int]:
    """Replica ``replica``'s micro-batches (rows of ``packed``) of at most ``budget`` tokens
    (a group's samples together when they share their prompt), the rounds every replica
    runs, and the micro-batches of the whole batch."""
    lens = packed.seq_lens.tolist()
    plan = plan_groups(packed, budget) if shares_prompts else plan_by_length(lens, budget)
    per_replica = assign_to_ranks(plan, lens, replicas)
    return per_replica[replica], max(len(m) for m in per_replica), len(plan)


def step_metrics(
    packed: PackedBatch, n_micro: int, start: float, grad_norm: float, lr: float, skipped: bool
) -> dict[str, float]:
    """An update's own metrics (beside the algorithm's): its gradient norm, LR, time and
    throughput."""
    elapsed = time.perf_counter() - start
    tokens = int(packed.seq_lens.sum())
    return {
        "grad_norm": grad_norm,
        "lr": lr,
        "step_time_s": elapsed,
        "tokens": float(tokens),
        "response_tokens": float(packed.response_mask.sum()),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "micro_batches": float(n_micro),
        "skipped_nonfinite": float(skipped),
    }


class TrainerRank(RankState):
    """The state and operations of one rank that every backend shares (module docstring).

    A subclass sets :attr:`backend` and :attr:`supported_needs`, builds the model and calls
    :meth:`_build_optimizers` in :meth:`setup`, and implements the ``NotImplementedError``
    methods. It may change :attr:`replicas`/:attr:`replica` (the data-parallel split of the
    micro-batches) and :attr:`shares_prompts` in its ``__init__``."""

    #: the key tile of the policy forward's shared-prompt layout in true on-policy mode (the
    #: backend's attention kernel's); ``None``: a group's prompt shared whole
    _tile: int | None = None
    #: the export may write into the tensors the last one yielded: set by
    #: :func:`~.ranks.collective_export` for a consumer done with each before the next export
    #: (a rank's sender, Ray's object store); one in the same memory may keep what it got
    export_into_kept: bool = False

    def _build_reference(self) -> nn.Module:
        """A frozen copy of the initial policy (full fine-tuning's reference)."""
        raise NotImplementedError

    def _adapters_off(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Within it, the policy runs with every adapter off (the reference)."""
        raise NotImplementedError

    def _policy_round(
        self, model: nn.Module, packed: PackedBatch, rows: list[int], *, entropy: bool
    ) -> Round:
        """The log-probs (and entropies) of ``rows``, with grad as the caller's context says."""
        raise NotImplementedError

    def _value_round(self, critic: nn.Module, packed: PackedBatch, rows: list[int]) -> Round:
        """The critic's values of ``rows``, with grad as the caller's context says."""
        raise NotImplementedError

    def _backward_round(self, round_: Round, g_out: Tensor, g_ent: Tensor | None) -> None:
        """Backpropagate one round from the loss's gradient with respect to its outputs."""
        backward_outputs(round_, g_out, g_ent, self.device)

    def _gather(self, lp: Tensor, ent: Tensor, entropy: bool) -> None:
        """Complete the whole batch's ``[B, T]`` outputs on every rank, in place: each rank
        filled its own rows (adding zeros is exact)."""
        raise NotImplementedError

    def _step(self, key: str) -> tuple[float, float, bool]:
        """Reduce, clip and apply the gradients of optimizer ``key``: ``(norm, lr, skipped)``."""
        raise NotImplementedError

    def _step_critic(self, critic: nn.Module) -> tuple[float, float, bool]:
        """The same for the critic."""
        raise NotImplementedError

    def _zero_grad(self, key: str) -> None:
        self.optimizers[key].zero_grad(set_to_none=True)

    def _grad_sync(self, module: nn.Module, last: bool) -> None:
        """Before round ``last``-or-not of a backward over ``module``: whether its gradient
        reduction runs after this round (by default the backend reduces in :meth:`_step`)."""

    @contextlib.contextmanager
    def _padding(self, padding: bool) -> Iterator[None]:
        """Within it, with ``padding`` (a replica's padding round, which forwards a row that
        another round forwards too), the router hooks measure nothing: every row counts once
        per pass in the routing statistics."""
        with contextlib.ExitStack() as stack:
            for router in self._routers.values():
                stack.enter_context(router.unmeasured(padding))
            yield

    def _plan(self, packed: PackedBatch) -> tuple[list[list[int]], int, int]:
        budget = self.options.micro_batch_tokens
        return replica_plan(packed, budget, self.shares_prompts, self.replicas, self.replica)

    def _rounds(
        self,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        forward: Callable[[list[int]], Round],
        *,
        grad: bool,
        entropy: bool,
        after: Callable[[list[int] | None], None] | None = None,
    ) -> tuple[Tensor, Tensor, list[Round]]:
        """The outputs (and entropies) ``[B, T]`` of the whole batch, on CPU, on every rank:
        each replica runs its micro-batches (a padding round where it has none left), then
        :meth:`_gather` fills the rest. With ``grad``, each round is kept (returned) with its
        graph for the backward. ``after``: called after each round with its rows (``None``
        for a padding round)."""
        out_full = torch.zeros(packed.size, packed.width, device=self.device)
        ent_full = torch.zeros(packed.size, packed.width, device=self.device)
        kept: list[Round] = []
        with torch.set_grad_enabled(grad):
            for i in range(rounds):
                rows = mine[i] if i < len(mine) else None
                with self._padding(rows is None):
                    round_ = forward(rows or [0])
                if after is not None:
                    after(rows or None)
                if grad:
                    kept.append(round_)
                if rows and round_.out is not None:
                    index = torch.tensor(rows, device=self.device)
                    out_full[index, : round_.out.shape[1]] = round_.out.detach()
                    if round_.ent is not None:
                        ent_full[index, : round_.ent.shape[1]] = round_.ent.detach()
        self._gather(out_full, ent_full, entropy)
        return out_full.cpu(), ent_full.cpu(), kept

    def _logprobs(
        self,
        model: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        *,
        entropy: bool,
        grad: bool = False,
        after: Callable[[list[int] | None], None] | None = None,
    ) -> tuple[Tensor, Tensor, list[Round]]:
        def forward(rows: list[int]) -> Round:
            return self._policy_round(model, packed, rows, entropy=entropy)

        return self._rounds(packed, mine, rounds, forward, grad=grad, entropy=entropy, after=after)

    def _values(
        self,
        critic: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        *,
        grad: bool = False,
    ) -> tuple[Tensor, list[Round]]:
        def forward(rows: list[int]) -> Round:
            return self._value_round(critic, packed, rows)

        values, _, kept = self._rounds(packed, mine, rounds, forward, grad=grad, entropy=False)
        return values, kept

    def compute_logprobs(self, groups: list[Any]) -> tuple[Tensor, Tensor]:
        """Log-probs and entropies ``[B, T]`` of the response tokens, without grad; with
        several adapters each group's rows under the adapter it names."""
        model = self._ready()
        packed = pack(groups)
        split = by_adapter(groups, self.adapters, self.backend)
        if len(self.adapters) <= 1:
            mine, rounds, _ = self._plan(packed)
            lp, ent, _ = self._logprobs(model, packed, mine, rounds, entropy=True)
            return lp, ent
        lp_full = torch.zeros(packed.size, packed.width)
        ent_full = torch.zeros(packed.size, packed.width)
        starts = [0]
        for group in groups:
            starts.append(starts[-1] + len(group.samples))
        for name, indices in split.items():
            self._activate(name)
            part = pack([groups[i] for i in indices])
            mine, rounds, _ = self._plan(part)
            lp, ent, _ = self._logprobs(model, part, mine, rounds, entropy=True)
            rows = torch.tensor([r for i in indices for r in range(starts[i], starts[i + 1])])
            lp_full[rows, : part.width] = lp
            ent_full[rows, : part.width] = ent
        return lp_full, ent_full

    def compute_values(self, groups: list[Any]) -> Tensor:
        """The critic's values ``[B, T]`` at the response tokens, without grad (the critic is
        built first if no step has needed it)."""
        critic = self._critic_ready()
        packed = pack(groups)
        mine, rounds, _ = self._plan(packed)
        return self._values(critic, packed, mine, rounds)[0]

    def _ref_logprobs(
        self, model: nn.Module, packed: PackedBatch, mine: list[list[int]], rounds: int
    ) -> Tensor:
        """The reference policy's log-probs: the initial checkpoint's, which with adapters is
        the policy with its adapters off (no second model), else a frozen copy. The whole
        vocabulary's, also where the samples were drawn with top-p or top-k: the truncation
        is the behaviour policy's, not the reference's."""
        packed = dataclasses.replace(packed, truncation=None)
        if self.adapters:
            with self._adapters_off(model):
                return self._logprobs(model, packed, mine, rounds, entropy=False)[0]
        if self.ref_model is None:
            self.ref_model = self._build_reference()
            self._watch_routing(self.ref_model, measure=False)
        return self._logprobs(self.ref_model, packed, mine, rounds, entropy=False)[0]

    def train_step(self, groups: list[Any], algorithm: AlgorithmImpl) -> dict[str, float]:
        """One update on ``groups``: the whole batch's log-probs (and, for an algorithm that
        needs values, the critic's), the algorithm's loss of them, its gradients pushed through
        the model (and the critic) one micro-batch at a time, reduced, clipped by the global
        norm, one optimizer step each. With several adapters, one update per adapter the
        groups name, in order of first appearance, on its groups alone (that adapter active,
        its optimizer and schedule); an adapter no group names is left untouched. Its metrics
        are then each adapter's as ``<name>/<key>``, and the totals
        (:data:`~miles_trainer_common.controller.TOTALS`) unprefixed."""
        model = self._ready()
        needs = check_algorithm(algorithm, self.supported_needs, self.backend, len(self.adapters))
        metrics = train_by_adapter(
            groups,
            self.adapters,
            self.backend,
            lambda part, key, start: self._train_on(model, part, algorithm, needs, key, start),
            self._activate,
        )
        self.step += 1
        metrics["step"] = float(self.step)
        return metrics

    def _train_on(
        self,
        model: nn.Module,
        groups: list[Any],
        algorithm: AlgorithmImpl,
        needs: frozenset[str],
        key: str,
        start: float,
    ) -> dict[str, float]:
        """One update of optimizer ``key`` (an adapter's name; "" for the whole model) on
        ``groups``, the adapter already active; its metrics, but ``step``."""
        critic = self._critic_ready() if "values" in needs else None
        packed = pack(groups)
        router = self._routers.get(id(model))
        if router is not None:
            if packed.routed_experts is None:
                raise ValueError(
                    f"rollout.routing {self.routing!r}: the samples carry no routing record "
                    "of the engine (routed_experts); never trained without it"
                )
            router.reset()
        batch = token_batch(packed)
        mine, rounds, n_micro = self._plan(packed)

        # The current policy's log-probs: the behaviour policy when it is recomputed, and the
        # point at which the whole batch's loss gradient is taken. With keep_activations they
        # come from the forward whose graph the backward runs through (an update taken right
        # after its own forward: the same values a no-grad pass would give).
        self._zero_grad(key)
        keep = self.options.keep_activations
        lp, ent, kept = behaviour_logprobs(self, model, groups, packed, mine, rounds, keep)
        if self.true_on_policy:
            check_on_policy(lp, packed.rollout_logprobs, packed.response_mask, packed.group_index)
        if "old_logprobs" in needs:
            batch.old_logprobs = lp.clone()
        self.step_logprobs.update(by_group(groups, lp))
        if "ref_logprobs" in needs:
            batch.ref_logprobs = self._ref_logprobs(model, packed, mine, rounds)
        # The critic's values before its update: the baseline of GAE and the centre of the
        # value clipping; with keep_activations their graphs serve the critic's backward.
        values: Tensor | None = None
        kept_values: list[Round] = []
        if critic is not None:
            assert self.critic_optimizer is not None
            self.critic_optimizer.zero_grad(set_to_none=True)
            values, kept_values = self._values(critic, packed, mine, rounds, grad=keep)
            batch.values = values.clone()
        algorithm.compute_advantages(batch)
        g_lp, g_ent, g_v, metrics = loss_gradients(algorithm, batch, lp, ent, values)

        def policy(rows: list[int]) -> Round:
            return self._policy_round(model, packed, rows, entropy=g_ent is not None)

        backward_rounds(self, model, mine, rounds, kept, policy, g_lp, g_ent)
        grad_norm, lr, skipped = self._step(key)
        if critic is not None:
            assert g_v is not None
            metrics.update(self._critic_update(critic, packed, mine, rounds, kept_values, g_v))
        metrics.update(step_metrics(packed, n_micro, start, grad_norm, lr, skipped))
        if router is not None:
            reduce = dist.all_reduce if self.world_size > 1 else None
            metrics.update(router.metrics(reduce))
            # what the routing record adds to the batch, per token forwarded
            tokens = int(packed.seq_lens.sum())
            metrics["routing/bytes_per_token"] = packed.routing_bytes / max(1, tokens)
        return metrics

    def _critic_update(
        self,
        critic: nn.Module,
        packed: PackedBatch,
        mine: list[list[int]],
        rounds: int,
        kept: list[Round],
        g_v: Tensor,
    ) -> dict[str, float]:
        """Push the loss's gradient with respect to the values through the critic, one
        micro-batch at a time as the policy's, and step its optimizer; its metrics."""

        def forward(rows: list[int]) -> Round:
            return self._value_round(critic, packed, rows)

        backward_rounds(self, critic, mine, rounds, kept, forward, g_v, None)
        norm, lr, skipped = self._step_critic(critic)
        return {
            "critic/grad_norm": norm,
            "critic/lr": lr,
            "critic/skipped_nonfinite": float(skipped),
        }


def backward_rounds(
    rank: TrainerRank,
    module: nn.Module,
    mine: list[list[int]],
    rounds: int,
    kept: list[Round],
    forward: Callable[[list[int]], Round],
    g_out: Tensor,
    g_ent: Tensor | None,
) -> None:
    """Push ``g_out`` (and ``g_ent``) through ``rank``'s ``module`` one round at a time: each
    round's kept forward (``keep_activations``), else a forward with grad first."""
    for i in range(rounds):
        rows = mine[i] if i < len(mine) else None
        run = rows or [0]
        rank._grad_sync(module, i == rounds - 1)
        # This round's kept forward; popped so its activations go with its backward.
        with rank._padding(rows is None):
            round_ = kept.pop(0) if kept else forward(run)
        index = torch.tensor(run)
        width = round_.width
        scale = 1.0 if rows else 0.0
        g_ent_mb = None if g_ent is None else g_ent[index, :width] * scale
        rank._backward_round(round_, g_out[index, :width] * scale, g_ent_mb)
    rank._grad_sync(module, True)
