"""The engine's model forwards over the slot KV cache: a padded prefill, a packed prefill
with the decode step, and the batched decode step; with each forward's adapter rows and its
record of the experts routed to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles_core.invariant.kernels import TILE
from miles_engine_embedded.kv_cache import PackedRows
from miles_engine_embedded.lora import LoraBatch

if TYPE_CHECKING:
    from miles_engine_embedded.engine import Engine
    from miles_engine_embedded.request import Request


class Forwards:
    """Runs the engine's batched forwards into its slots (the requests of ``engine.running``
    are the slots, in order) and records what each request gets from them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def forward_new(self, reqs: list[Request]) -> None:
        """One right-padded forward of whole sequences into the next slots. Sets each
        request's ``cached`` and ``prefill_logits`` and appends it to the running ones."""
        e = self.engine
        seqs = [list(r.prefill_key[1]) if r.prefill_key else [] for r in reqs]
        lens = torch.tensor([len(s) for s in seqs])
        n, width = len(reqs), int(lens.max())
        first = len(e.running)
        e.cache.ensure(width + 1)
        dev = e.holder.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        pos = torch.arange(width).view(1, width)
        causal = pos.view(1, width, 1) >= pos.view(1, 1, width)
        valid_key = pos.view(1, 1, width) < lens.view(n, 1, 1)
        mask = (causal & valid_key).view(n, 1, width, width)
        e.cache.prepare_prefill(first)
        last = lens - 1
        keep = sorted(set(last.tolist()))
        routing = self._routing(reqs)
        out = e.holder.forward(
            ids.to(dev),
            pos.expand(n, width).to(dev),
            mask.to(dev),
            e.cache,
            torch.tensor(keep, device=dev),
            self.lora(reqs),
            routing,
        )
        routed = self._stack(routing)  # [n, width, moe_layers, k]
        col = torch.tensor([keep.index(x) for x in last.tolist()], device=dev)
        logits = out[torch.arange(n, device=dev), col]
        for i, r in enumerate(reqs):
            r.cached = int(lens[i])
            r.prefill_logits = logits[i]
            if r.return_routed_experts and routed is not None:
                r.routed = [routed[i, : r.cached]]
            e.running.append(r)
        e.prefill_forwarded += int(lens.sum())

    def packed_step(self, group: list[tuple[Request, int, int]]) -> torch.Tensor:
        """One packed forward (:class:`~.kv_cache.PackedRows`): a decode token for every
        running request, then each new sequence of ``group`` (``(request, source slot,
        start)``) from its ``start`` on, into the next slots, the keys and values before it
        copied from the source's slot. Sets each new request's ``cached`` and
        ``prefill_logits`` and appends it to the running ones; returns the running requests'
        logits ``[B, V]`` (their tokens are drawn with the new ones')."""
        e = self.engine
        running = list(e.running)
        b = len(running)
        ids = [r.output_ids[-1] for r in running]
        positions = [r.cached for r in running]
        segments = []
        for k, (r, src, start) in enumerate(group):
            seq = r.prefill_key[1] if r.prefill_key else ()
            if start:
                e.cache.move_slot(src, b + k, start)
            ids.extend(seq[start:])
            segments.append((b + k, start, len(seq) - start))
        ends = [start + length for _, start, length in segments]
        e.cache.ensure(max(positions + ends) + 1)
        dev = e.holder.device
        rows = PackedRows(
            torch.tensor(positions, dtype=torch.long),
            max(positions, default=-1) + 1,
            segments,
            dev,
            e.holder.dtype,
        )
        e.cache.prepare_packed(rows)
        counts = [1] * b + [length for _, _, length in segments]
        last = torch.tensor(counts).cumsum(0) - 1  # each request's last row
        reqs = running + [r for r, _, _ in group]
        routing = self._routing(reqs)
        out = e.holder.forward(
            torch.tensor(ids, device=dev).view(1, -1),
            rows.row_positions.view(1, -1),
            None,
            e.cache,
            last.to(dev),
            self._lora_rows(reqs, counts),
            routing,
        )[0]
        routed = self._stack(routing)  # [1, T, moe_layers, k]
        for i, r in enumerate(running):
            r.cached += 1
            if r.return_routed_experts and routed is not None:
                r.routed.append(routed[0, i : i + 1])
        for k, ((r, src, start), (_, _, length)) in enumerate(zip(group, segments, strict=True)):
            r.cached = start + length
            r.prefill_logits = out[b + k]
            if r.return_routed_experts and routed is not None:
                row = int(last[b + k]) + 1 - length
                head = [torch.cat(running[src].routed)[:start]] if start else []
                r.routed = [torch.cat([*head, routed[0, row : row + length]])]
            e.running.append(r)
        if b:
            e.steps += 1
        e.prefill_forwarded += sum(length for _, _, length in segments)
        e.prefill_shared += sum(start for _, start, _ in segments)
        return out[:b]

    def decode_step(self) -> None:
        e = self.engine
        reqs = e.running
        dev = e.holder.device
        positions = torch.tensor([r.cached for r in reqs], dtype=torch.long, device=dev)
        visible = int(positions.max()) + 1
        if e.invariant:  # whole key tiles: the kernel then reads the cache without a copy
            visible = min(-(-visible // TILE) * TILE, e.cache.max_length)
        e.cache.ensure(visible)
        e.cache.prepare_decode(positions, visible)
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=dev)
        mask = (torch.arange(visible, device=dev).unsqueeze(0) <= positions.unsqueeze(1)).view(
            len(reqs), 1, 1, visible
        )
        routing = self._routing(reqs)
        out = e.holder.forward(
            ids, positions.unsqueeze(1), mask, e.cache, None, self.lora(reqs), routing
        )
        routed = self._stack(routing)  # [B, 1, moe_layers, k]
        for i, r in enumerate(reqs):
            r.cached += 1
            if r.return_routed_experts and routed is not None:
                r.routed.append(routed[i])
        e.steps += 1
        e.accept(list(range(len(reqs))), out[:, -1])

    def _routing(self, reqs: list[Request]) -> list[torch.Tensor] | None:
        """A list for the forward to record the routing into, when a request of the batch
        asks for it (None: nothing is recorded, at no cost)."""
        return [] if any(r.return_routed_experts for r in reqs) else None

    @staticmethod
    def _stack(routing: list[torch.Tensor] | None) -> torch.Tensor | None:
        """The recorded per-layer ``[B, N, k]`` expert ids as one ``[B, N, layers, k]`` int32
        tensor on the CPU."""
        if not routing:
            return None
        return torch.stack(routing, dim=2).to("cpu", torch.int32)

    def lora(self, reqs: list[Request]) -> Any:
        """The adapters' deltas for a forward whose row ``i`` is ``reqs[i]`` (None: no row
        names an adapter, the base forward as it is)."""
        e = self.engine
        if e.holder.lora is None:
            return None
        return e.holder.lora.batch([r.lora for r in reqs])

    def _lora_rows(self, reqs: list[Request], counts: list[int]) -> Any:
        """:meth:`_lora` for a packed forward whose request ``i`` owns the next ``counts[i]``
        rows of one sequence."""
        batch = self.lora(reqs)
        if batch is None:
            return None
        index = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(counts))
        return LoraBatch(
            batch.weights, batch.mask[index.to(batch.mask.device)].view(1, -1, batch.mask.shape[-1])
        )

    def routed_experts(self, req: Request) -> torch.Tensor:
        """SGLang's ``routed_experts`` of a finished request: int32 ``[prompt + output - 1,
        num_hidden_layers, k]``, the top-k expert ids of every position the model forwarded
        (the last generated token never is), ``-1`` in the layers that are not MoE."""
        e = self.engine
        cfg = e.holder.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        top_k = int(text_cfg.num_experts_per_tok)
        rows = max(0, len(req.input_ids) + len(req.output_ids) - 1)
        out = torch.full((rows, text_cfg.num_hidden_layers, top_k), -1, dtype=torch.int32)
        if req.routed:
            got = torch.cat(req.routed)[:rows]
            out[: got.shape[0], e.holder.moe_layers] = got
        return out
