"""Rollout routing replay (R3) and routing statistics for Hugging Face MoE models.

The engine and the trainer compute the router's logits with different kernels and precision,
so near-ties between experts can go either way: the trainer would then update experts that
never produced the token and skip those that did. With replay, every MoE layer's top-k choice
is the engine's (the sample's :class:`miles_core.data.RoutedExperts`), and the gate weights
are recomputed from the trainer's own router logits at those experts, as the model computes
them (softmax, gather, renormalised when the model renormalises), so the router still gets a
gradient.

It works by a forward hook on each MoE block's router (``mlp.gate``) that replaces the
router's output ``(logits, weights, indices)``; the model's code is untouched. The routers of
transformers 5's ``qwen3_moe`` and ``mixtral`` are supported; a model with another router is
refused when the hooks are installed, naming the router's class.

Beside replay, the hooks measure, per forward: the expert agreement between the engine's
record and the experts the trainer routed by, and its own top-k (the fraction of (token,
layer) whose top-k sets are equal), and the experts' load per layer (tokens routed to each
expert, by the routing used). Within :meth:`RoutingReplay.per_position`, they also keep each
forward's own agreement per position (the MoE layers where the trainer's own top-k is the
engine's, of those with a record), which :mod:`miles_trainer_common.agreement` maps to the
samples' response tokens.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

#: router classes whose output this module replaces: name -> whether the top-k weights are
#: renormalised always (``None``: when the router's ``norm_topk_prob`` says so), and whether
#: they are cast back to the logits' dtype (Qwen3-MoE does, Mixtral keeps float32)
ROUTERS: dict[str, tuple[bool | None, bool]] = {
    "Qwen3MoeTopKRouter": (None, True),
    "MixtralTopKRouter": (True, False),
}

#: MODES of ``rollout.routing`` a trainer is built with
MODES = ("record", "replay")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RoutingReplay:
    """The router hooks of one model. ``mode``: ``"replay"`` routes by the record given to
    :meth:`use`; ``"record"`` only measures against it. ``measure``: accumulate the agreement
    and load statistics (the policy's forwards; not a frozen reference's)."""

    def __init__(self, model: nn.Module, mode: str, *, measure: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode = mode
        self.measure = measure
        self._record: Tensor | None = None
        self._prepared: tuple[Tensor, Tensor, Tensor] | None = None
        self._handles: list[Any] = []
        #: within :meth:`per_position`: each forward's ``[rows, L, 2]`` counts per position
        #: (layers whose own top-k agreed, layers with a record), in order; else ``None``
        self._forwards: list[Tensor] | None = None
        self._positions: Tensor | None = None
        self.layers: dict[int, nn.Module] = {}
        for name, module in model.named_modules():
            found = _LAYER.search(name)
            if found is None or not hasattr(module, "top_k"):
                continue
            kind = type(module).__name__
            if kind not in ROUTERS:
                raise ValueError(
                    f"routing replay: the router {name} is a {kind}, which is not supported; "
                    f"supported routers: {', '.join(ROUTERS)} (qwen3_moe, mixtral)"
                )
            layer = int(found.group(1))
            self.layers[layer] = module
            self._handles.append(module.register_forward_hook(self._hook(layer, kind)))
        if not self.layers:
            raise ValueError(
                "rollout.routing: the trained model has no mixture-of-experts router "
                "(layers.<i>.mlp.gate), so there is no routing to record or replay"
            )
        self.reset()

    def reset(self) -> None:
        """Zero the statistics."""
        #: per layer: [agreed, agreed by the trainer's own top-k, compared], summed over the
        #: forwards; and the tokens routed to each expert. Kept as tensors on the model's
        #: device, so that a forward never waits for the device to report a count.
        self.counts: dict[int, Tensor] = {}
        self.load: dict[int, Tensor] = {}

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def use(self, record: Tensor | None) -> Iterator[None]:
        """Forwards inside route by (or are compared with) ``record`` ``[rows, L, width]``,
        the engine's record laid out as the forward's input ``[rows, L]``. With ``None`` (a
        forward of a batch without records), replay refuses to run."""
        self._record = record
        self._prepared = None
        self._positions = None
        try:
            yield
            if self._forwards is not None and record is not None and self._positions is not None:
                self._forwards.append(self._positions.view(*record.shape[:2], 2))
        finally:
            self._record = None
            self._prepared = None
            self._positions = None

    @contextlib.contextmanager
    def unmeasured(self, on: bool = True) -> Iterator[None]:
        """Within it (with ``on``), forwards add nothing to the statistics: a data-parallel
        replica's padding round, which forwards a row that another round forwards too."""
        measure = self.measure
        self.measure = measure and not on
        try:
            yield
        finally:
            self.measure = measure

    @contextlib.contextmanager
    def per_position(self) -> Iterator[list[Tensor]]:
        """Within it, each measured forward also keeps, per position of its input ``[rows,
        L]``, the MoE layers whose engine top-k set is the trainer's own and the layers with a
        record: a ``[rows, L, 2]`` float tensor on the model's device, appended to the list
        yielded (the caller takes them as they come). The counts are summed as the batch's
        are, with no wait on the device."""
        self._forwards = []
        try:
            yield self._forwards
        finally:
            self._forwards = None

    def _prepare(self, k: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The record as the hooks of one forward use it, built once for all its layers: the
        ids ``[positions, layers, k]`` (int64 on ``device``), whether each (position, layer)
        has a record, and the ids sorted within each top-k set (for the agreement)."""
        if self._prepared is None:
            record = self._record
            assert record is not None
            ids = record.to(device, non_blocking=True).reshape(-1, record.shape[-1] // k, k)
            ids = ids.long()
            self._prepared = (ids, (ids >= 0).all(-1), ids.sort(-1).values)
        return self._prepared

    def _hook(self, layer: int, kind: str) -> Any:
        renorm_always, cast = ROUTERS[kind]

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._record is None:
                if self.mode == "replay":
                    raise RuntimeError(
                        "routing replay: a forward of the policy ran without the engine's "
                        "routing record (never trained unreplayed)"
                    )
                return None
            logits, _weights, own = output
            k = int(module.top_k)
            if self._record.shape[-1] % k:
                raise ValueError(
                    f"routing replay: the record holds {self._record.shape[-1]} ids per "
                    f"position, not a whole number of top-{k} sets"
                )
            ids, known_all, sorted_all = self._prepare(k, own.device)
            if layer >= ids.shape[1]:
                raise ValueError(
                    f"routing replay: the record holds {ids.shape[1]} layers of top-{k} ids, "
                    f"and the model routes in layer {layer}"
                )
            if ids.shape[0] != own.shape[0]:
                raise ValueError(
                    f"routing replay: the record has {ids.shape[0]} positions for a forward "
                    f"of {own.shape[0]}"
                )
            engine, known = ids[:, layer], known_all[:, layer]
            if self.mode == "replay":
                chosen = torch.where(known[:, None], engine, own)
                probs = torch.softmax(logits.float(), dim=-1)
                top = probs.gather(-1, chosen)
                norm = renorm_always if renorm_always is not None else module.norm_topk_prob
                if norm:
                    top = top / top.sum(dim=-1, keepdim=True)
                if cast:
                    top = top.to(logits.dtype)
                output = (logits, top, chosen)
            else:
                chosen = own
            if self.measure:
                with torch.no_grad():
                    self._count(
                        layer, int(module.num_experts), sorted_all[:, layer], known, chosen, own
                    )
            return output

        return hook

    def _count(
        self,
        layer: int,
        n_experts: int,
        engine: Tensor,
        known: Tensor,
        chosen: Tensor,
        own: Tensor,
    ) -> None:
        """Add one forward of ``layer`` to the statistics: the agreement of ``chosen`` (the
        experts routed by) and ``own`` (the trainer's top-k) with the sorted ``engine`` ids,
        over the positions ``known`` to the record, and the experts' load by ``chosen``."""
        own_sorted = own.sort(-1).values
        # with own routing the chosen experts are the trainer's own: one comparison serves both
        same_own = (own_sorted == engine).all(-1) & known
        same = same_own if chosen is own else (chosen.sort(-1).values == engine).all(-1) & known
        counts = torch.stack([same.sum(), same_own.sum(), known.sum()]).double()
        load = torch.zeros(n_experts, dtype=torch.float64, device=chosen.device)
        # unknown positions add nothing: their weight is zero
        load.index_add_(0, chosen.flatten(), known[:, None].expand_as(chosen).flatten().double())
        if self._forwards is not None:
            per_position = torch.stack([same_own, known], -1).float()
            if self._positions is None:
                self._positions = per_position
            else:
                self._positions += per_position
        if layer in self.counts:
            self.counts[layer] += counts
            self.load[layer] += load
        else:
            self.counts[layer], self.load[layer] = counts, load

    def metrics(self, reduce: Any = None) -> dict[str, float]:
        """The statistics since :meth:`reset`: ``routing/expert_agreement``, the fraction of
        (token, layer) whose experts the trainer routed by are the engine's top-k set (1.0
        with replay: a check that it happened), ``routing/own_agreement``, the same for the
        trainer's own top-k (what the agreement would be without replay), and per layer the
        load imbalance ``routing/load_max_over_mean/layer<i>`` (the busiest expert's tokens
        over the mean; 1 = balanced) with its mean and max over layers. ``reduce``: sums a
        tensor over the ranks in place (``torch.distributed.all_reduce``) when there are
        several."""
        layers = sorted(self.layers)
        n_experts = max(int(m.num_experts) for m in self.layers.values())
        stats = torch.zeros(3 + len(layers) * n_experts, dtype=torch.float64)
        for i, layer in enumerate(layers):
            if layer in self.counts:
                stats[:3] += self.counts[layer].cpu()
                start = 3 + i * n_experts
                load = self.load[layer].cpu()
                stats[start : start + load.numel()] = load
        if reduce is not None:
            reduce(stats)
        out: dict[str, float] = {}
        if stats[2] > 0:
            out["routing/expert_agreement"] = float(stats[0] / stats[2])
            out["routing/own_agreement"] = float(stats[1] / stats[2])
        imbalance = []
        for i, layer in enumerate(layers):
            load = stats[3 + i * n_experts : 3 + (i + 1) * n_experts]
            if n_experts and load.sum() > 0:
                ratio = float(load.max() / load.mean())
                out[f"routing/load_max_over_mean/layer{layer}"] = ratio
                imbalance.append(ratio)
        if imbalance:
            out["routing/load_max_over_mean"] = sum(imbalance) / len(imbalance)
            out["routing/load_max_over_mean_max"] = max(imbalance)
        return out
