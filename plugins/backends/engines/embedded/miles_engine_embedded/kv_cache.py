"""A slot KV cache the model's attention writes into through the ``cache.update`` call.

Running requests occupy slots ``0..B-1`` (kept contiguous, so a decode step reads a *view* of
the cache, never a gathered copy). Each slot holds its own sequence from position 0; the decode
mask hides the positions past each slot's own length, so requests of different lengths share
one batched step. A scoring forward (input log-probs only) passes through without a slot.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    """Per-layer key/value tensors ``[slots, kv_heads, length, head_dim]`` grown on demand."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_length: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._initial_length = min(initial_length, max_length)
        # What the next ``update`` calls mean; set by the scheduler before each forward.
        self._mode = "prefill"
        self._slots: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._visible = 0
        self._prefill_slot = 0
        self._starts: torch.Tensor | None = None

    # --- memory -----------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        """Whether the cache tensors exist (they do not after ``release``)."""
        return bool(self.keys)

    def release(self) -> None:
        """Free the cache tensors (the running requests must have been retracted)."""
        self.keys, self.values, self.length = [], [], 0

    def ensure(self, needed: int) -> None:
        """Make every slot hold at least ``needed`` positions (doubling, up to ``max_length``)."""
        if needed > self.max_length:
            raise ValueError(f"sequence of {needed} tokens exceeds the cache ({self.max_length})")
        if self.allocated and needed <= self.length:
            return
        new_length = max(self._initial_length, self.length)
        while new_length < needed:
            new_length *= 2
        new_length = min(new_length, self.max_length)
        shape = (self.num_slots, self.num_kv_heads, new_length, self.head_dim)
        keys = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        values = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        if self.allocated:
            for old, new in zip(self.keys + self.values, keys + values, strict=True):
                new[:, :, : self.length].copy_(old)
        self.keys, self.values, self.length = keys, values, new_length

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for t in (*self.keys, *self.values):
            t[dst, :, :length].copy_(t[src, :, :length])

    # --- modes set by the scheduler ---------------------------------------------------------

    def prepare_prefill(self, first_slot: int, starts: torch.Tensor | None = None) -> None:
        """The next forward is a prefill of sequences into slots ``first_slot, first_slot + 1,
        ...``: from position 0, or from ``starts[i]`` for the i-th, whose earlier positions are
        in its slot already (then attention reads them from the cache with the new ones)."""
        self._mode, self._prefill_slot, self._starts = "prefill", first_slot, starts

    def prepare_score(self) -> None:
        """The next forward scores whole sequences and keeps nothing: ``update`` stores no key
        or value and returns those it was given. No slot is needed and none is touched, so it
        runs beside the running requests, and while the cache is not allocated."""
        self._mode = "score"

    def prepare_decode(self, positions: torch.Tensor, visible: int) -> None:
        """The next forward is one decode token for slots ``0..B-1`` at ``positions``; the
        attention reads positions ``[0, visible)`` of each slot."""
        self._mode = "decode"
        self._slots = torch.arange(positions.shape[0], device=self.device)
        self._positions = positions
        self._visible = visible

    # --- the call transformers' attention makes ---------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of ``layer_idx`` and return what attention should read."""
        if self._mode == "score":
            return key_states, value_states
        k_cache, v_cache = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "prefill":
            b, n = key_states.shape[0], key_states.shape[2]
            s = self._prefill_slot
            if self._starts is None:
                k_cache[s : s + b, :, :n].copy_(key_states)
                v_cache[s : s + b, :, :n].copy_(value_states)
                return key_states, value_states
            slots = torch.arange(s, s + b, device=self.device).view(b, 1)
            positions = self._starts.to(self.device).view(b, 1) + torch.arange(
                n, device=self.device
            ).view(1, n)
            k_cache[slots, :, positions] = key_states.transpose(1, 2)
            v_cache[slots, :, positions] = value_states.transpose(1, 2)
            end = int(self._starts.max()) + n
            return k_cache[s : s + b, :, :end], v_cache[s : s + b, :, :end]
        assert self._slots is not None and self._positions is not None
        k_cache[self._slots, :, self._positions] = key_states[:, :, 0]
        v_cache[self._slots, :, self._positions] = value_states[:, :, 0]
        b = key_states.shape[0]
        return k_cache[:b, :, : self._visible], v_cache[:b, :, : self._visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Unused by the engine (positions are always explicit); present for the cache API."""
        return 0
