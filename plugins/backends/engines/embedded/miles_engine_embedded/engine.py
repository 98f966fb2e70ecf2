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
from typing import Any

import torch

from miles_engine_embedded.admission import MIN_SHARED_PREFIX, Admission
from miles_engine_embedded.forwards import Forwards
from miles_engine_embedded.kv_cache import SlotKVCache
from miles_engine_embedded.request import EngineError, Request
from miles_engine_embedded.sampling import UniformStream, sample
from miles_engine_embedded.scheduler_thread import SchedulerThread
from miles_engine_embedded.scoring import InputScorer
from miles_engine_embedded.weights import ModelHolder

__all__ = [
    "MIN_SHARED_PREFIX",
    "Engine",
    "EngineError",
    "Request",
    "return_freed_memory",
]

log = logging.getLogger("miles_engine_embedded")

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
        #: guards the draws of :meth:`new_stream` (called from the server's threads)
        self._seed_lock = threading.Lock()
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
        # the parts that do the work, one job each
        self.thread = SchedulerThread(self)
        self.scorer = InputScorer(self)
        self.admission = Admission(self)
        self.forwards = Forwards(self)

    # --- public, thread-safe ----------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler loop on a thread of its own."""
        self.thread.start()

    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """Run the scheduler loop on the calling thread until :meth:`stop` (instead of
        :meth:`start`): the thread that loaded the model can then run every forward too.
        ``on_start`` is called once the engine counts this thread as its own (``alive``)."""
        self.thread.run(on_start)

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs."""
        return self.thread.alive

    def stop(self) -> None:
        """Stop the scheduler thread (after the current step)."""
        self.thread.stop()

    def new_stream(self, seed: int | None) -> UniformStream:
        """A request's own random stream: seeded by the request, else from the server's seed."""
        if seed is None:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return UniformStream(seed)

    def submit(self, req: Request) -> None:
        """Queue a request; ``req.on_done`` is called (on the scheduler thread) when it ends."""
        self.thread.post(("request", req))

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue requests together: the scheduler sees all of them at its next step (the
        samples of one batch are then admitted, and an identical prompt prefilled, together)."""
        self.thread.post(*(("request", req) for req in reqs))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(self)`` on the scheduler thread between two steps; returns its future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.thread.post(("command", (fn, fut)))
        return fut

    # --- control operations (scheduler thread only) -----------------------------------------

    def abort(self, rid: str | None, message: str = "aborted by request") -> int:
        """Abort one request by rid, or every request when ``rid`` is None; returns the count."""
        n = 0
        for queue in (self.scoring, self.waiting):
            for req in list(queue):
                if rid is None or req.rid == rid:
                    queue.remove(req)
                    self.finish(req, {"type": "abort", "message": message})
                    n += 1
        doomed = [i for i, r in enumerate(self.running) if rid is None or r.rid == rid]
        for i in sorted(doomed, reverse=True):
            req = self.running[i]
            self._remove_running(i)
            self.finish(req, {"type": "abort", "message": message})
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

    # --- the steps (scheduler thread only) -------------------------------------------------

    def can_run(self) -> bool:
        """Whether a step has work: a request to run, admit or score, and neither paused
        nor released."""
        # Scoring needs no slot, but waits like any request while paused or released.
        if self.paused or self.kv_released or self.weights_released:
            return False
        return bool(self.running) or bool(self.waiting) or bool(self.scoring)

    def step(self) -> None:
        """One iteration's model work: score, admit (maybe packed with the decode step), else
        decode; a failure fails the requests, never the loop. An idle cache grown past
        :attr:`kv_trim_above` is freed after it."""
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

    def enqueue(self, req: Request) -> None:
        """Take a submitted request: refused, finished at once, or queued to score or run."""
        lora = self.holder.lora
        if req.lora is not None and (lora is None or req.lora not in lora.adapters):
            # unloaded between the server's check and here
            message = lora.not_loaded(req.lora) if lora is not None else "LoRA is not enabled"
            self.finish(req, {"type": "abort", "message": message})
            return
        room = self.context_length - len(req.input_ids)
        req.max_new_tokens = max(0, min(req.params.max_new_tokens, room))
        if req.wants_input_logprobs:
            self.scoring.append(req)  # generates after, if it asked for new tokens too
        elif req.max_new_tokens == 0:
            self.finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)

    #: the name tests step the scheduler by, one part at a time
    _enqueue = enqueue

    def _score(self) -> None:
        """Score the requests queued for input log-probs (:class:`InputScorer`)."""
        self.scorer.score()

    def _admit(self) -> bool:
        """Admit and prefill waiting requests (:class:`Admission`); True when their forward
        was packed with the running requests' decode step."""
        return self.admission.admit()

    def _decode_step(self) -> None:
        """One batched decode step over every running request (:class:`Forwards`)."""
        self.forwards.decode_step()

    def routed_experts(self, req: Request) -> torch.Tensor:
        """SGLang's ``routed_experts`` of a finished request
        (:meth:`~miles_engine_embedded.forwards.Forwards.routed_experts`)."""
        return self.forwards.routed_experts(req)

    def lora_in_use(self, name: str) -> bool:
        """Whether a queued or running request is served with adapter ``name``."""
        return any(r.lora == name for q in (self.scoring, self.waiting, self.running) for r in q)

    @property
    def packs(self) -> bool:
        """Whether new sequences are forwarded packed with the decode step, and may start
        from a running request's keys and values: on the lean forward (it reads a packed
        forward's keys from the cache) and off true on-policy mode (there a prompt is always
        forwarded whole and alone, as the trainer does)."""
        return self.holder.lean is not None and not self.invariant

    def accept(self, idx: list[int], logits: torch.Tensor) -> None:
        """Draw the next token of each running request ``idx[j]`` from ``logits[j]``; the
        requests it ends (a stop token, their length) leave their slots and finish."""
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
            self.finish(req, req.finish_reason or {"type": "length"})

    def _remove_running(self, i: int) -> None:
        last = len(self.running) - 1
        if i != last:
            # Keep slots contiguous: the last request moves into the freed slot.
            moved = self.running[last]
            self.cache.move_slot(last, i, moved.cached)
            self.running[i] = moved
        self.running.pop()

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        """End ``req`` with ``reason`` and deliver it (``on_done``, on this thread)."""
        req.prefill_logits = None  # a vocabulary of floats per request: not kept past its end
        req.finish_reason = reason
        req.weight_version = self.holder.weight_version
        req.finished_at = time.monotonic()
        try:
            req.on_done(req)
        except Exception:  # a vanished client must not stop the loop
            log.exception("delivering the result of %s failed", req.rid)
