"""Input log-probs: the forwards that score the tokens of the requests asking for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles_engine_embedded.engine import Engine
    from miles_engine_embedded.request import Request


class InputScorer:
    """Scores the requests queued for input log-probs (``engine.scoring``): their own padded
    forwards, which keep no keys or values, on the engine's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def score(self) -> None:
        """Compute the input log-probs of every request queued for them, in padded forwards of
        at most ``prefill_tokens`` tokens (more when one sequence alone is longer). Sequences
        are taken longest first, so those batched together pad little. Then a request that
        asked for no new tokens finishes; the others join the generation queue. They are
        prefilled again there (a second forward): scoring keeps no keys or values, so it
        neither needs a slot nor waits for one, and never touches the running requests'."""
        e = self.engine
        if not e.scoring:
            return
        todo = sorted(e.scoring, key=lambda r: len(r.input_ids), reverse=True)
        e.scoring.clear()
        while todo:
            width = len(todo[0].input_ids)
            n = max(1, min(len(todo), e.prefill_tokens // width))
            batch, todo = todo[:n], todo[n:]
            try:
                self._score_batch(batch)
            except Exception as exc:
                for req in batch + todo:
                    e.finish(req, {"type": "abort", "message": f"engine error: {exc!r}"})
                raise
            for req in batch:
                if req.max_new_tokens == 0:
                    e.finish(req, {"type": "length", "length": 0})
                else:
                    e.waiting.append(req)

    def _score_batch(self, batch: list[Request]) -> None:
        """One right-padded forward over the requests' inputs; the log-prob of the token at
        position ``p`` is ``log_softmax`` (float32, the raw distribution, as for sampled
        tokens) of the logits at ``p - 1``. Only the positions some request needs are kept,
        and the softmax is taken one request at a time."""
        e = self.engine
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
        dev = e.holder.device
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        pos = torch.arange(width)
        causal = pos.view(1, width, 1) >= pos.view(1, 1, width)
        valid_key = pos.view(1, 1, width) < torch.tensor(lens).view(n, 1, 1)
        mask = (causal & valid_key).view(n, 1, width, width)
        e.cache.prepare_score()
        out = e.holder.forward(
            ids.to(dev),
            pos.expand(n, width).to(dev),
            mask.to(dev),
            e.cache,
            torch.tensor(keep, device=dev),
            e.forwards.lora(batch),
        )
        e.score_forwarded += sum(lens)
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
