"""The scheduler: continuous batching over a slot KV cache, run on one thread.

Every iteration: apply queued control commands (abort, pause, weight updates...), score the
requests that asked for input log-probs (a forward of their whole sequences that keeps no
keys or values), admit waiting requests into free slots (their prompts forwarded, which also
samples their first token), then run one batched decode step over every running request. On
the lean forward the admitted prompts and the decode step are one packed forward. Requests
join and leave the batch at every step; all model work happens on this thread, so control
commands never race a forward pass.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.invariant.kernels import TILE, invariant_mode
from miles_engine_embedded.kv_cache import PackedRows, SlotKVCache
from miles_engine_embedded.lora import LoraBatch
from miles_engine_embedded.protocol import SamplingParams
from miles_engine_embedded.sampling import UniformStream, sample
from miles_engine_embedded.weights import ModelHolder

log = logging.getLogger("miles_engine_embedded")

#: a new sequence starts from a running request's keys and values when the two share at
#: least this many leading tokens (below it, the copy saves too little)
MIN_SHARED_PREFIX = 8


#: glibc's ``malloc_trim`` once looked up (False where there is none)
_MALLOC_TRIM: Any = None


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): freed cache
    tensors below glibc's mmap threshold otherwise stay in the process's resident memory."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


def _common_prefix(a: Any, b: Any, limit: int) -> int:
    """The number of leading items ``a`` and ``b`` share, at most ``limit``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n


@dataclass
class Request:
    """One generation request and its progress."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    on_done: Callable[[Request], None]
    uniforms: UniformStream
    max_new_tokens: int = 0
    #: with ``return_logprob``: first input position whose log-prob is returned (-1: none)
    logprob_start_len: int = -1
    #: log-prob of each input token from ``logprob_start_len`` on (None at position 0)
    input_logprobs: list[float | None] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0  # tokens whose keys/values are in the cache
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    #: the LoRA adapter it is served with (None: the base model)
    lora: str | None = None
    #: record the experts its tokens are routed to (SGLang's ``return_routed_experts``)
    return_routed_experts: bool = False
    #: with ``return_routed_experts``: the top-k expert ids ``[positions, moe_layers, k]`` of
    #: every forwarded position, in chunks (the prefill's, then one per decode step)
    routed: list[torch.Tensor] = field(default_factory=list)
    #: while running: (the adapter and its installation, whether it records its routing, the
    #: sequence) its prefill forwarded,
    #: the logits that ended it and the weights' version then (a request with the same key
    #: copies them instead: never across adapters)
    prefill_key: tuple[tuple[str | None, int, bool], tuple[int, ...]] | None = None
    prefill_logits: Any = None
    prefill_version: str = ""
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether the request asked for log-probs of its input tokens."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def reserved(self) -> int:
        """Tokens this request may occupy in the cache at most."""
        return len(self.input_ids) + self.max_new_tokens


class EngineError(Exception):
    """A control command was refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Engine:
    """Continuous-batching generation engine over a Hugging Face causal LM."""

    def __init__(
        self,
        holder: ModelHolder,
        *,
        max_running_requests: int,
        max_total_tokens: int,
        context_length: int,
        seed: int,
        invariant: bool = False,
    ) -> None:
        self.holder = holder
        #: true on-policy: every forward and log-softmax of the scheduler runs the
        #: batch-invariant kernels (:mod:`miles_core.invariant`)
        self.invariant = invariant
        self.max_running = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.context_length = context_length
        #: at most this many (padded) tokens in one batched prefill forward
        self.prefill_tokens = max(2048, context_length)
        cfg = holder.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = text_cfg.num_attention_heads
        self.cache = SlotKVCache(
            num_layers=text_cfg.num_hidden_layers,
            num_slots=max_running_requests,
            num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
            max_length=context_length,
            dtype=holder.dtype,
            device=holder.device,
        )
        eos = getattr(holder.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(text_cfg, "eos_token_id", None)
        self.eos_ids: frozenset[int] = frozenset(
            [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        )
        self.vocab_size = int(holder.model.get_input_embeddings().weight.shape[0])
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.waiting: collections.deque[Request] = collections.deque()
        #: requests whose input log-probs are still to be computed (they need no slot)
        self.scoring: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused = False
        self.kv_released = False
        self.weights_released = False
        self._inbox: list[tuple[str, Any, Any]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.steps = 0
        self.generated_tokens = 0
        #: prompt tokens forwarded by prefills, and those a copy of a running or new request's
        #: keys and values saved (an identical sequence, or a shared prefix)
        self.prefill_forwarded = 0
        self.prefill_shared = 0
        #: input tokens forwarded to score them (padding not counted)
        self.score_forwarded = 0
        self.last_error: str | None = None
        #: the high-water mark: a cache grown past this many positions per slot (half the
        #: context) is freed as soon as the engine is idle, so one long request does not keep
        #: every slot at its length; below it the cache is kept for the next requests
        self.kv_trim_above = max(context_length // 2, 1)

    # --- public, thread-safe ----------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler loop on a thread of its own."""
        self._thread.start()

    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """Run the scheduler loop on the calling thread until :meth:`stop` (instead of
        :meth:`start`): the thread that loaded the model can then run every forward too.
        ``on_start`` is called once the engine counts this thread as its own (``alive``)."""
        self._thread = threading.current_thread()
        if on_start is not None:
            on_start()
        self._loop()

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the scheduler thread (after the current step)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def new_stream(self, seed: int | None) -> UniformStream:
        """A request's own random stream: seeded by the request, else from the server's seed."""
        if seed is None:
            with self._cv:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return UniformStream(seed)

    def submit(self, req: Request) -> None:
        """Queue a request; ``req.on_done`` is called (on the scheduler thread) when it ends."""
        self._post(("request", req))

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue requests together: the scheduler sees all of them at its next step (the
        samples of one batch are then admitted, and an identical prompt prefilled, together)."""
        self._post(*(("request", req) for req in reqs))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(self)`` on the scheduler thread between two steps; returns its future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("command", (fn, fut)))
        return fut

    def _post(self, *items: tuple[str, Any]) -> None:
        """Put ``(kind, item)`` pairs in the inbox at once."""
        with self._cv:
            if self._stop:
                raise EngineError("engine is shutting down", 503)
            self._inbox.extend((kind, item, None) for kind, item in items)
            self._cv.notify()

    # --- control operations (scheduler thread only) -----------------------------------------

    def abort(self, rid: str | None, message: str = "aborted by request") -> int:
        """Abort one request by rid, or every request when ``rid`` is None; returns the count."""
        n = 0
        for queue in (self.scoring, self.waiting):
            for req in list(queue):
                if rid is None or req.rid == rid:
                    queue.remove(req)
                    self._finish(req, {"type": "abort", "message": message})
                    n += 1
        doomed = [i for i, r in enumerate(self.running) if rid is None or r.rid == rid]
        for i in sorted(doomed, reverse=True):
            req = self.running[i]
            self._remove_running(i)
            self._finish(req, {"type": "abort", "message": message})
            n += 1
        return n

    def retract_all(self) -> int:
        """Move every running request back to the front of the queue; its cache is dropped and
        it is prefilled again (prompt plus the tokens it already has) when it resumes."""
        n = len(self.running)
        for req in reversed(self.running):
            req.cached = 0
            self.waiting.appendleft(req)
        self.running = []
        return n

    @property
    def idle(self) -> bool:
        """No request running, waiting or waiting to be scored."""
        return not self.running and not self.waiting and not self.scoring

    def release_kv(self) -> None:
        """Free the KV cache; running requests are retracted and wait for resume."""
        self.retract_all()
        self.cache.release()
        self.kv_released = True
        return_freed_memory()

    def flush(self) -> bool:
        """SGLang's ``flush_cache``: when idle, free the KV cache, which the next prefill
        allocates again at the length it needs (a long request otherwise leaves every slot
        at its length for good); returns whether the engine was idle."""
        if not self.idle:
            return False
        if self.cache.allocated:
            self.cache.release()
            return_freed_memory()
        return True

    def resume_kv(self) -> None:
        """Allow the KV cache to be allocated again (lazily, at the next prefill)."""
        self.kv_released = False

    # --- the loop ---------------------------------------------------------------------------

    def _can_run(self) -> bool:
        # Scoring needs no slot, but waits like any request while paused or released.
        if self.paused or self.kv_released or self.weights_released:
            return False
        return bool(self.running) or bool(self.waiting) or bool(self.scoring)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        with invariant_mode(self.invariant):
            self._run()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stop and not self._can_run():
                    self._cv.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
            for kind, item, _ in inbox:
                if kind == "request":
                    self._enqueue(item)
                else:
                    fn, fut = item
                    if not fut.set_running_or_notify_cancel():
                        continue
                    try:
                        fut.set_result(fn(self))
                    except BaseException as exc:
                        fut.set_exception(exc)
            if not self._can_run():
                continue
            try:
                self._score()
                if not self._admit() and self.running:
                    self._decode_step()
            except Exception as exc:  # a model failure must fail the requests, not the server
                log.exception("engine step failed")
                self.last_error = repr(exc)
                self.abort(None, message=f"engine error: {exc!r}")
            if self.idle and self.cache.allocated and self.cache.length > self.kv_trim_above:
                self.flush()
        self.abort(None, message="engine shut down")

    def _enqueue(self, req: Request) -> None:
        lora = self.holder.lora
        if req.lora is not None and (lora is None or req.lora not in lora.adapters):
            # unloaded between the server's check and here
            message = lora.not_loaded(req.lora) if lora is not None else "LoRA is not enabled"
            self._finish(req, {"type": "abort", "message": message})
            return
        room = self.context_length - len(req.input_ids)
        req.max_new_tokens = max(0, min(req.params.max_new_tokens, room))
        if req.wants_input_logprobs:
            self.scoring.append(req)  # generates after, if it asked for new tokens too
        elif req.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)

    def _score(self) -> None:
        """Compute the input log-probs of every request queued for them, in padded forwards of
        at most ``prefill_tokens`` tokens (more when one sequence alone is longer). Sequences
        are taken longest first, so those batched together pad little. Then a request that
        asked for no new tokens finishes; the others join the generation queue. They are
        prefilled again there (a second forward): scoring keeps no keys or values, so it
        neither needs a slot nor waits for one, and never touches the running requests'."""
        if not self.scoring:
            return
        todo = sorted(self.scoring, key=lambda r: len(r.input_ids), reverse=True)
        self.scoring.clear()
        while todo:
            width = len(todo[0].input_ids)
            n = max(1, min(len(todo), self.prefill_tokens // width))
            batch, todo = todo[:n], todo[n:]
            try:
                self._score_batch(batch)
            except Exception as exc:
                for req in batch + todo:
                    self._finish(req, {"type": "abort", "message": f"engine error: {exc!r}"})
                raise
            for req in batch:
                if req.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                else:
                    self.waiting.append(req)

    def _lora(self, reqs: list[Request]) -> Any:
        """The adapters' deltas for a forward whose row ``i`` is ``reqs[i]`` (None: no row
        names an adapter, the base forward as it is)."""
        if self.holder.lora is None:
            return None
        return self.holder.lora.batch([r.lora for r in reqs])

    def _lora_rows(self, reqs: list[Request], counts: list[int]) -> Any:
        """:meth:`_lora` for a packed forward whose request ``i`` owns the next ``counts[i]``
        rows of one sequence."""
        batch = self._lora(reqs)
        if batch is None:
            return None
        index = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(counts))
        return LoraBatch(
            batch.weights, batch.mask[index.to(batch.mask.device)].view(1, -1, batch.mask.shape[-1])
        )

    def lora_in_use(self, name: str) -> bool:
        """Whether a queued or running request is served with adapter ``name``."""
        return any(r.lora == name for q in (self.scoring, self.waiting, self.running) for r in q)

    def _score_batch(self, batch: list[Request]) -> None:
        """One right-padded forward over the requests' inputs; the log-prob of the token at
        position ``p`` is ``log_softmax`` (float32, the raw distribution, as for sampled
        tokens) of the logits at ``p - 1``. Only the positions some request needs are kept,
        and the softmax is taken one request at a time."""
        seqs = [r.input_ids for r in batch]
        lens = [len(x) for x in seqs]
        n, width = len(batch), max(lens)
        # the logits positions each request reads: p - 1 for p in [max(start, 1), len)
        reads = [range(max(r.logprob_start_len, 1) - 1, len(r.input_ids) - 1) for r in batch]
        for r in batch:  # the token at position 0 has no context: no log-prob
            r.input_logprobs = [None] if r.logprob_start_len == 0 else []
        keep = sorted(set().union(*reads))
        if not keep:  # single-token inputs only
            return
        dev = self.holder.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        pos = torch.arange(width)
        causal = pos.view(1, width, 1) >= pos.view(1, 1, width)
        valid_key = pos.view(1, 1, width) < torch.tensor(lens).view(n, 1, 1)
        mask = (causal & valid_key).view(n, 1, width, width)
        self.cache.prepare_score()
        out = self.holder.forward(
            ids.to(dev),
            pos.expand(n, width).to(dev),
            mask.to(dev),
            self.cache,
            torch.tensor(keep, device=dev),
            self._lora(batch),
        )
        self.score_forwarded += sum(lens)
        col = {p: j for j, p in enumerate(keep)}
        for i, (r, positions) in enumerate(zip(batch, reads, strict=True)):
            if not positions:
                continue
            # a request's positions are consecutive integers, all kept: a slice of ``out``
            first = col[positions.start]
            rows = out[i, first : first + len(positions)].float()
            targets = torch.tensor(r.input_ids[positions.start + 1 :], device=dev)
            lp = torch.log_softmax(rows, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
            r.input_logprobs.extend(lp.tolist())

    def _admit(self) -> bool:
        """Admit waiting requests into free slots; True when their forward was packed with
        the running requests' decode step (those have stepped already)."""
        reserved = sum(r.reserved for r in self.running)
        batch: list[Request] = []
        budget = self.prefill_tokens
        # SGLang's max_loras_per_batch: distinct adapters (the base model counts as one) in
        # the running batch
        lora = self.holder.lora
        adapters = {r.lora for r in self.running} if lora is not None else set()
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req = self.waiting[0]
            if (self.running or batch) and reserved + req.reserved > self.max_total_tokens:
                break
            if lora is not None and req.lora not in adapters:
                if len(adapters) >= lora.max_loras_per_batch:
                    break  # joins once a request of another adapter has finished
                adapters.add(req.lora)
            n = len(req.input_ids) + len(req.output_ids)
            if batch and n * (len(batch) + 1) > budget:
                break  # bound the padded prefill size; the rest joins at the next step
            self.waiting.popleft()
            reserved += req.reserved
            batch.append(req)
        if not batch:
            return False
        try:
            return self._prefill(batch)
        except Exception as exc:
            for req in batch:
                if req not in self.running:  # not yet in a slot: finish it here
                    self._finish(req, {"type": "abort", "message": f"engine error: {exc!r}"})
            raise

    def _prefill(self, batch: list[Request]) -> bool:
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
        first = len(self.running)
        version = self.holder.weight_version
        running = {
            r.prefill_key: i
            for i, r in enumerate(self.running)
            if r.prefill_key is not None and r.prefill_version == version
        }
        slot_of: dict[Any, Request] = {}  # sequence -> the new request forwarding it
        distinct: list[Request] = []
        copies: list[tuple[Request, Request]] = []
        joins: list[tuple[Request, int]] = []  # (request, slot of the running source)
        gen = self.holder.lora.generation if self.holder.lora is not None else None
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
            self._accept(list(range(first, first + len(joins))), self._join_running(joins))
            return False
        if self.packs:
            now, later = self._shared_prefixes(distinct)
            if later:  # back to the queue's front, with their copies, in their order
                wait = {id(r) for r in later}
                wait |= {id(r) for r, source in copies if id(source) in wait}
                copies = [(r, source) for r, source in copies if id(r) not in wait]
                for r in reversed([r for r in batch if id(r) in wait]):
                    r.prefill_key = None
                    self.waiting.appendleft(r)
            decoded = self._packed_step(now)  # [first, V]: the running requests' next tokens
        else:
            self._forward_new(distinct)
            decoded = None
        self._copy_new(copies)
        logits = torch.stack([r.prefill_logits for r in self.running[first:]])
        if joins:
            logits = torch.cat([logits, self._join_running(joins)])
        stepped = decoded is not None and first > 0
        if stepped:
            logits = torch.cat([decoded, logits])
        # One accept for every row: a request that ends at this token frees its slot by
        # moving another, so no slot index may be used after it.
        self._accept(list(range(0 if stepped else first, len(self.running))), logits)
        return stepped

    def _copy_new(self, copies: list[tuple[Request, Request]]) -> None:
        """Put each copy in the next slot with its new source's keys, values and logits."""
        slots = {id(r): i for i, r in enumerate(self.running)}
        for r, source in copies:
            n = len(source.prefill_key[1]) if source.prefill_key else 0
            self.cache.move_slot(slots[id(source)], len(self.running), n)
            r.cached = n
            r.prefill_logits = source.prefill_logits
            r.routed = list(source.routed)
            self.running.append(r)
            self.prefill_shared += n

    @property
    def packs(self) -> bool:
        """Whether new sequences are forwarded packed with the decode step, and may start
        from a running request's keys and values: on the lean forward (it reads a packed
        forward's keys from the cache) and off true on-policy mode (there a prompt is always
        forwarded whole and alone, as the trainer does)."""
        return self.holder.lean is not None and not self.invariant

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
        version = self.holder.weight_version
        sources = [
            (i, r.prefill_key[0], r.input_ids + r.output_ids, r.cached)
            for i, r in enumerate(self.running)
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

    def _forward_new(self, reqs: list[Request]) -> None:
        """One right-padded forward of whole sequences into the next slots. Sets each
        request's ``cached`` and ``prefill_logits`` and appends it to the running ones."""
        seqs = [list(r.prefill_key[1]) if r.prefill_key else [] for r in reqs]
        lens = torch.tensor([len(s) for s in seqs])
        n, width = len(reqs), int(lens.max())
        first = len(self.running)
        self.cache.ensure(width + 1)
        dev = self.holder.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        pos = torch.arange(width).view(1, width)
        causal = pos.view(1, width, 1) >= pos.view(1, 1, width)
        valid_key = pos.view(1, 1, width) < lens.view(n, 1, 1)
        mask = (causal & valid_key).view(n, 1, width, width)
        self.cache.prepare_prefill(first)
        last = lens - 1
        keep = sorted(set(last.tolist()))
        routing = self._routing(reqs)
        out = self.holder.forward(
            ids.to(dev),
            pos.expand(n, width).to(dev),
            mask.to(dev),
            self.cache,
            torch.tensor(keep, device=dev),
            self._lora(reqs),
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
            self.running.append(r)
        self.prefill_forwarded += int(lens.sum())

    def _packed_step(self, group: list[tuple[Request, int, int]]) -> torch.Tensor:
        """One packed forward (:class:`~.kv_cache.PackedRows`): a decode token for every
        running request, then each new sequence of ``group`` (``(request, source slot,
        start)``) from its ``start`` on, into the next slots, the keys and values before it
        copied from the source's slot. Sets each new request's ``cached`` and
        ``prefill_logits`` and appends it to the running ones; returns the running requests'
        logits ``[B, V]`` (their tokens are drawn with the new ones')."""
        running = list(self.running)
        b = len(running)
        ids = [r.output_ids[-1] for r in running]
        positions = [r.cached for r in running]
        segments = []
        for k, (r, src, start) in enumerate(group):
            seq = r.prefill_key[1] if r.prefill_key else ()
            if start:
                self.cache.move_slot(src, b + k, start)
            ids.extend(seq[start:])
            segments.append((b + k, start, len(seq) - start))
        ends = [start + length for _, start, length in segments]
        self.cache.ensure(max(positions + ends) + 1)
        dev = self.holder.device
        rows = PackedRows(
            torch.tensor(positions, dtype=torch.long),
            max(positions, default=-1) + 1,
            segments,
            dev,
            self.holder.dtype,
        )
        self.cache.prepare_packed(rows)
        counts = [1] * b + [length for _, _, length in segments]
        last = torch.tensor(counts).cumsum(0) - 1  # each request's last row
        reqs = running + [r for r, _, _ in group]
        routing = self._routing(reqs)
        out = self.holder.forward(
            torch.tensor(ids, device=dev).view(1, -1),
            rows.row_positions.view(1, -1),
            None,
            self.cache,
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
            self.running.append(r)
        if b:
            self.steps += 1
        self.prefill_forwarded += sum(length for _, _, length in segments)
        self.prefill_shared += sum(start for _, start, _ in segments)
        return out[:b]

    def _join_running(self, joins: list[tuple[Request, int]]) -> torch.Tensor:
        """Put each request in the next slot, started from a running request prefilled from
        the same sequence: that request's first keys and values, and the logits its prefill
        ended with (returned, one row per request, for the caller to sample from)."""
        first = len(self.running)
        for k, (r, src) in enumerate(joins):
            source = self.running[src]
            n = len(source.prefill_key[1]) if source.prefill_key else 0
            self.cache.move_slot(src, first + k, n)
            r.cached = n
            r.prefill_logits = source.prefill_logits
            # the source's prefill chunk (its key says it recorded one when this one must)
            r.routed = [source.routed[0][:n]] if source.routed else []
            self.running.append(r)
            self.prefill_shared += n
        return torch.stack([r.prefill_logits for r, _ in joins])

    def _decode_step(self) -> None:
        reqs = self.running
        dev = self.holder.device
        positions = torch.tensor([r.cached for r in reqs], dtype=torch.long, device=dev)
        visible = int(positions.max()) + 1
        if self.invariant:  # whole key tiles: the kernel then reads the cache without a copy
            visible = min(-(-visible // TILE) * TILE, self.cache.max_length)
        self.cache.ensure(visible)
        self.cache.prepare_decode(positions, visible)
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long, device=dev)
        mask = (torch.arange(visible, device=dev).unsqueeze(0) <= positions.unsqueeze(1)).view(
            len(reqs), 1, 1, visible
        )
        routing = self._routing(reqs)
        out = self.holder.forward(
            ids, positions.unsqueeze(1), mask, self.cache, None, self._lora(reqs), routing
        )
        routed = self._stack(routing)  # [B, 1, moe_layers, k]
        for i, r in enumerate(reqs):
            r.cached += 1
            if r.return_routed_experts and routed is not None:
                r.routed.append(routed[i])
        self.steps += 1
        self._accept(list(range(len(reqs))), out[:, -1])

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

    def routed_experts(self, req: Request) -> torch.Tensor:
        """SGLang's ``routed_experts`` of a finished request: int32 ``[prompt + output - 1,
        num_hidden_layers, k]``, the top-k expert ids of every position the model forwarded
        (the last generated token never is), ``-1`` in the layers that are not MoE."""
        cfg = self.holder.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        top_k = int(text_cfg.num_experts_per_tok)
        rows = max(0, len(req.input_ids) + len(req.output_ids) - 1)
        out = torch.full((rows, text_cfg.num_hidden_layers, top_k), -1, dtype=torch.int32)
        if req.routed:
            got = torch.cat(req.routed)[:rows]
            out[: got.shape[0], self.holder.moe_layers] = got
        return out

    def _accept(self, idx: list[int], logits: torch.Tensor) -> None:
        reqs = [self.running[i] for i in idx]
        tokens, logprobs = sample(
            logits,
            temperatures=[r.params.temperature for r in reqs],
            top_ps=[r.params.top_p for r in reqs],
            top_ks=[r.params.top_k for r in reqs],
            uniforms=[r.uniforms.next() for r in reqs],
            native_kernel=self.packs and self.holder.lean.native,
        )
        done: list[int] = []
        for i, req, tok, lp in zip(idx, reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            self.generated_tokens += 1
            stops = req.params.stop_token_ids or ()
            if (not req.params.ignore_eos and tok in self.eos_ids) or tok in stops:
                req.finish_reason = {"type": "stop", "matched": tok}
            elif len(req.output_ids) >= req.max_new_tokens:
                req.finish_reason = {"type": "length", "length": req.max_new_tokens}
            if req.finish_reason is not None:
                done.append(i)
        for i in sorted(done, reverse=True):
            req = self.running[i]
            self._remove_running(i)
            self._finish(req, req.finish_reason or {"type": "length"})

    def _remove_running(self, i: int) -> None:
        last = len(self.running) - 1
        if i != last:
            # Keep slots contiguous: the last request moves into the freed slot.
            moved = self.running[last]
            self.cache.move_slot(last, i, moved.cached)
            self.running[i] = moved
        self.running.pop()

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.prefill_logits = None  # a vocabulary of floats per request: not kept past its end
        req.finish_reason = reason
        req.weight_version = self.holder.weight_version
        req.finished_at = time.monotonic()
        try:
            req.on_done(req)
        except Exception:  # a vanished client must not stop the loop
            log.exception("delivering the result of %s failed", req.rid)
