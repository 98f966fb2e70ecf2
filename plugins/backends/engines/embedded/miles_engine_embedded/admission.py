"""Admission: which waiting requests join the running batch, and how their sequences are
forwarded (once per distinct sequence, from a running request's keys and values where they
share a prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from miles_engine_embedded.engine import Engine
    from miles_engine_embedded.request import Request

#: a new sequence starts from a running request's keys and values when the two share at
#: least this many leading tokens (below it, the copy saves too little)
MIN_SHARED_PREFIX = 8


def _common_prefix(a: Any, b: Any, limit: int) -> int:
    """The number of leading items ``a`` and ``b`` share, at most ``limit``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n


class Admission:
    """Admits waiting requests into the engine's free slots and prefills them: identical
    sequences are forwarded once, a sequence a running request holds is copied from it, and
    on the lean forward the new rows are packed with the running requests' decode step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def admit(self) -> bool:
        """Admit waiting requests into free slots; True when their forward was packed with
        the running requests' decode step (those have stepped already)."""
        e = self.engine
        reserved = sum(r.reserved for r in e.running)
        batch: list[Request] = []
        budget = e.prefill_tokens
        # SGLang's max_loras_per_batch: distinct adapters (the base model counts as one) in
        # the running batch
        lora = e.holder.lora
        adapters = {r.lora for r in e.running} if lora is not None else set()
        while e.waiting and len(e.running) + len(batch) < e.max_running:
            req = e.waiting[0]
            if (e.running or batch) and reserved + req.reserved > e.max_total_tokens:
                break
            if lora is not None and req.lora not in adapters:
                if len(adapters) >= lora.max_loras_per_batch:
                    break  # joins once a request of another adapter has finished
                adapters.add(req.lora)
            n = len(req.input_ids) + len(req.output_ids)
            if batch and n * (len(batch) + 1) > budget:
                break  # bound the padded prefill size; the rest joins at the next step
            e.waiting.popleft()
            reserved += req.reserved
            batch.append(req)
        if not batch:
            return False
        try:
            return self.prefill(batch)
        except Exception as exc:
            for req in batch:
                if req not in e.running:  # not yet in a slot: finish it here
                    e.finish(req, {"type": "abort", "message": f"engine error: {exc!r}"})
            raise

    def prefill(self, batch: list[Request]) -> bool:
        """Forward the distinct new sequences; they take the next slots and draw their first
        token. True when the running requests' decode step ran in the same forward.

        Identical sequences (the samples of one group, sent with one prompt) are forwarded
        once: the copies take the slots after the distinct ones, with the keys and values of
        their source copied in and its logits, and each draws its own token. The source is
        another request of this prefill, or a running request prefilled from the same
        sequence under the same weights (a sample that arrived a step later).

        On the lean forward (:attr:`packs`) the new sequences' tokens and the running
        requests' decode tokens are the rows of one packed forward, with no padding, and a
        sequence that only begins like one a running request holds (a shared system prompt
        or task template) starts from that request's keys and values and forwards the rest
        (:meth:`_shared_prefixes`); one that begins like another new sequence waits for that
        one's forward (the next step). Otherwise the new sequences run one right-padded
        prefill forward: keys and values written at padded positions lie past each slot's
        length, where the decode mask never shows them and the slot's next decode step
        overwrites them."""
        e = self.engine
        first = len(e.running)
        version = e.holder.weight_version
        running = {
            r.prefill_key: i
            for i, r in enumerate(e.running)
            if r.prefill_key is not None and r.prefill_version == version
        }
        slot_of: dict[Any, Request] = {}  # sequence -> the new request forwarding it
        distinct: list[Request] = []
        copies: list[tuple[Request, Request]] = []
        joins: list[tuple[Request, int]] = []  # (request, slot of the running source)
        gen = e.holder.lora.generation if e.holder.lora is not None else None
        for r in batch:
            # A request recording its routing copies only a source that recorded it too.
            adapter = (r.lora, gen(r.lora) if gen else 0, r.return_routed_experts)
            key = (adapter, tuple(r.input_ids + r.output_ids))
            r.prefill_key, r.prefill_version = key, version
            if key in slot_of:
                copies.append((r, slot_of[key]))
            elif key in running:
                joins.append((r, running[key]))
            else:
                slot_of[key] = r
                distinct.append(r)
        if not distinct:  # every one copies a running request: no forward at all
            e.accept(list(range(first, first + len(joins))), self._join_running(joins))
            return False
        if e.packs:
            now, later = self._shared_prefixes(distinct)
            if later:  # back to the queue's front, with their copies, in their order
                wait = {id(r) for r in later}
                wait |= {id(r) for r, source in copies if id(source) in wait}
                copies = [(r, source) for r, source in copies if id(r) not in wait]
                for r in reversed([r for r in batch if id(r) in wait]):
                    r.prefill_key = None
                    e.waiting.appendleft(r)
            decoded = e.forwards.packed_step(now)  # [first, V]: the running requests' next tokens
        else:
            e.forwards.forward_new(distinct)
            decoded = None
        self._copy_new(copies)
        logits = torch.stack([r.prefill_logits for r in e.running[first:]])
        if joins:
            logits = torch.cat([logits, self._join_running(joins)])
        stepped = decoded is not None and first > 0
        if stepped:
            logits = torch.cat([decoded, logits])
        # One accept for every row: a request that ends at this token frees its slot by
        # moving another, so no slot index may be used after it.
        e.accept(list(range(0 if stepped else first, len(e.running))), logits)
        return stepped

    def _copy_new(self, copies: list[tuple[Request, Request]]) -> None:
        """Put each copy in the next slot with its new source's keys, values and logits."""
        e = self.engine
        slots = {id(r): i for i, r in enumerate(e.running)}
        for r, source in copies:
            n = len(source.prefill_key[1]) if source.prefill_key else 0
            e.cache.move_slot(slots[id(source)], len(e.running), n)
            r.cached = n
            r.prefill_logits = source.prefill_logits
            r.routed = list(source.routed)
            e.running.append(r)
            e.prefill_shared += n

    def _shared_prefixes(
        self, reqs: list[Request]
    ) -> tuple[list[tuple[Request, int, int]], list[Request]]:
        """``(now, later)``: ``now`` holds ``(request, source slot, shared length)`` for the
        requests to forward now (slot -1, length 0: from the start); ``later`` the requests
        that share no prefix with a running request but at least ``MIN_SHARED_PREFIX``
        tokens with one of ``now`` forwarded from the start (they wait for it).

        A source is a running request of the same adapter, routing record and weights; the
        shared length is the common prefix of the two sequences over the source's cached
        positions, less one token (a forward needs one at least)."""
        e = self.engine
        version = e.holder.weight_version
        sources = [
            (i, r.prefill_key[0], r.input_ids + r.output_ids, r.cached)
            for i, r in enumerate(e.running)
            if r.prefill_key is not None and r.prefill_version == version
        ]
        now: list[tuple[Request, int, int]] = []
        later: list[Request] = []
        fresh: list[tuple[Any, list[int]]] = []  # the sequences of ``now`` forwarded whole
        for r in reqs:
            adapter, seq = r.prefill_key if r.prefill_key else (None, ())
            best, slot = 0, -1
            for i, a, other, cached in sources:
                if a == adapter:
                    n = _common_prefix(seq, other, min(cached, len(seq) - 1))
                    if n > best:
                        best, slot = n, i
            if best >= MIN_SHARED_PREFIX:
                now.append((r, slot, best))
            elif any(
                a == adapter and _common_prefix(seq, other, len(seq) - 1) >= MIN_SHARED_PREFIX
                for a, other in fresh
            ):
                later.append(r)
            else:
                now.append((r, -1, 0))
                fresh.append((adapter, list(seq)))
        return now, later

    def _join_running(self, joins: list[tuple[Request, int]]) -> torch.Tensor:
        """Put each request in the next slot, started from a running request prefilled from
        the same sequence: that request's first keys and values, and the logits its prefill
        ended with (returned, one row per request, for the caller to sample from)."""
        e = self.engine
        first = len(e.running)
        for k, (r, src) in enumerate(joins):
            source = e.running[src]
            n = len(source.prefill_key[1]) if source.prefill_key else 0
            e.cache.move_slot(src, first + k, n)
            r.cached = n
            r.prefill_logits = source.prefill_logits
            # the source's prefill chunk (its key says it recorded one when this one must)
            r.routed = [source.routed[0][:n]] if source.routed else []
            e.running.append(r)
            e.prefill_shared += n
        return torch.stack([r.prefill_logits for r, _ in joins])
