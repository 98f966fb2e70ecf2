"""A slot KV cache the model's attention writes into through the ``cache.update`` call.

Running requests occupy slots ``0..B-1`` (kept contiguous, so a decode step reads a *view* of
the cache, never a gathered copy). Each slot holds its own sequence from position 0; the decode
mask hides the positions past each slot's own length, so requests of different lengths share
one batched step. A scoring forward (input log-probs only) passes through without a slot.

A packed forward (:class:`PackedRows`) runs the decode tokens of the running requests and the
new tokens of admitted sequences as the rows of one sequence: the products see one batch with
no padding, and the attention reads each part's own keys (:mod:`.fast_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: seen) as the additive one ``scaled_dot_product_attention``
    turns it into (0 where seen, -inf elsewhere): the same values, made once per forward
    rather than by every layer's call."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
        ~seen, float("-inf")
    )


@dataclass
class PackedRows:
    """The rows of a packed forward: first one decode token for each of slots ``0..batch-1``
    (at ``positions``, attending over positions ``[0, visible)`` under ``mask``), then each
    segment ``(slot, start, length)``: a sequence's tokens at positions ``start..start +
    length - 1`` of ``slot``, whose positions before ``start`` are in the slot already."""

    positions: torch.Tensor
    visible: int
    segments: list[tuple[int, int, int]]
    device: torch.device
    dtype: torch.dtype
    #: ``[batch, 1, 1, visible]``: the keys each decode row sees (additive: 0 or -inf)
    mask: torch.Tensor = field(init=False)
    #: per segment starting past 0: ``[length, start + length]``, the keys each of its rows
    #: sees, additive (None for a segment from position 0: plain causal attention)
    segment_masks: list[torch.Tensor | None] = field(init=False)
    #: ``[batch]`` int64: the positions each decode row reads (its position + 1)
    lengths: torch.Tensor = field(init=False)
    #: the slot and position of every row, in row order
    row_slots: torch.Tensor = field(init=False)
    row_positions: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        b, dev = self.batch, self.device
        pos = self.positions.to(dev)
        seen = torch.arange(self.visible, device=dev).unsqueeze(0) <= pos.unsqueeze(1)
        self.mask = additive(seen.view(b, 1, 1, self.visible), self.dtype)
        self.lengths = (pos + 1).to(torch.int64).contiguous()
        slots, positions = [torch.arange(b, device=dev)], [pos]
        self.segment_masks = []
        for slot, start, length in self.segments:
            rows = torch.arange(start, start + length, device=dev)
            slots.append(torch.full((length,), slot, device=dev))
            positions.append(rows)
            seen = torch.arange(start + length, device=dev).view(1, -1) <= rows.view(-1, 1)
            self.segment_masks.append(additive(seen, self.dtype) if start else None)
        self.row_slots, self.row_positions = torch.cat(slots), torch.cat(positions)

    @property
    def batch(self) -> int:
        """The number of decode rows."""
        return int(self.positions.shape[0])


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
        #: the flat cache rows the next decode or packed forward writes (``_flat_rows``)
        self._rows: torch.Tensor | None = None
        self._visible = 0
        self._prefill_slot = 0
        #: ``[B]`` int64, in decode mode: the positions each decode row reads (None otherwise)
        self.lengths: torch.Tensor | None = None
        #: the rows of the next forward when it is packed (None otherwise)
        self.packed: PackedRows | None = None

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

    def prepare_prefill(self, first_slot: int) -> None:
        """The next forward is a prefill of sequences from position 0 into slots
        ``first_slot, first_slot + 1, ...``."""
        self._mode, self._prefill_slot, self.packed = "prefill", first_slot, None
        self.lengths = None

    def prepare_packed(self, rows: PackedRows) -> None:
        """The next forward is packed: ``update`` stores each row's keys and values at its slot
        and position and returns the whole cache tensors of the layer (the attention reads
        each part from them, :attr:`packed` says where)."""
        self._mode, self.packed = "packed", rows
        self.lengths = None
        self._rows = self._flat_rows(rows.row_slots, rows.row_positions)

    def prepare_score(self) -> None:
        """The next forward scores whole sequences and keeps nothing: ``update`` stores no key
        or value and returns those it was given. No slot is needed and none is touched, so it
        runs beside the running requests, and while the cache is not allocated."""
        self._mode, self.packed = "score", None
        self.lengths = None

    def prepare_decode(self, positions: torch.Tensor, visible: int) -> None:
        """The next forward is one decode token for slots ``0..B-1`` at ``positions``; the
        attention reads positions ``[0, visible)`` of each slot."""
        self._mode, self.packed = "decode", None
        self.lengths = (positions + 1).to(torch.int64).contiguous()
        self._rows = self._flat_rows(
            torch.arange(positions.shape[0], device=self.device), positions
        )
        self._visible = visible

    @property
    def rows(self) -> torch.Tensor | None:
        """``[N, kv_heads]`` in a decode or packed forward: the cache rows (of a layer's tensor
        viewed as ``[-1, head_dim]``) its rows' keys and values go to, for a caller that
        stores them itself and then reads :meth:`attended` (None in the other modes)."""
        return self._rows if self._mode in ("decode", "packed") else None

    def attended(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns in a decode or packed forward, without storing anything:
        the decode rows' slots up to the visible length, or the whole tensors when packed."""
        k_cache, v_cache = self.keys[layer_idx], self.values[layer_idx]
        if self.packed is not None:
            return k_cache, v_cache
        assert self._rows is not None
        b = self._rows.shape[0]
        return k_cache[:b, :, : self._visible], v_cache[:b, :, : self._visible]

    def _flat_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N, kv_heads]``: the rows of a layer's cache viewed as ``[-1, head_dim]`` that hold
        each head's entry at ``(slots[i], positions[i])`` (one index for every layer's write)."""
        heads = torch.arange(self.num_kv_heads, device=self.device).view(1, -1)
        return (slots.view(-1, 1) * self.num_kv_heads + heads) * self.length + positions.view(-1, 1)

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
            k_cache[s : s + b, :, :n].copy_(key_states)
            v_cache[s : s + b, :, :n].copy_(value_states)
            return key_states, value_states
        assert self._rows is not None
        d = self.head_dim
        if self.packed is not None:  # rows [1, kv_heads, T, d] -> their (slot, position)
            k_cache.view(-1, d).index_put_((self._rows,), key_states[0].transpose(0, 1))
            v_cache.view(-1, d).index_put_((self._rows,), value_states[0].transpose(0, 1))
            return k_cache, v_cache
        k_cache.view(-1, d).index_put_((self._rows,), key_states[:, :, 0])
        v_cache.view(-1, d).index_put_((self._rows,), value_states[:, :, 0])
        b = key_states.shape[0]
        return k_cache[:b, :, : self._visible], v_cache[:b, :, : self._visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Unused by the engine (positions are always explicit); present for the cache API."""
        return 0
