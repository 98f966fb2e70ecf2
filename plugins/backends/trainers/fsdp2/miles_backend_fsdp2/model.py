"""Loading a Hugging Face causal LM (or its value model), sharding it with FSDP2, and its
token log-probs (or values)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from miles_trainer_common.batch import PackedBatch
from miles_trainer_common.layout import SharedLayout, shared_layout
from miles_trainer_common.logprobs import logprobs_at
from miles_trainer_common.routing import RoutingReplay
from miles_trainer_common.truncation import Truncation
from torch import Tensor, nn

from miles_backend_fsdp2.options import FSDP2Options


def load_sharded(
    model_path: str,
    options: FSDP2Options,
    mesh: Any,
    device: torch.device,
    *,
    trainable: bool,
    value: bool = False,
    adapters: Sequence[Any] = (),
) -> nn.Module:
    """Build ``model_path``'s model and shard it: one FSDP2 unit per decoder layer (the
    model's ``_no_split_modules``) and the root (embeddings, final norm, head).

    ``value``: the critic, ``AutoModelForTokenClassification`` with one label on the same
    checkpoint: the same body (and sharding), a ``score`` Linear(hidden, 1) head in place of
    the vocabulary head, newly initialised (from the seeded RNG, on rank 0) unless the
    checkpoint has one.

    ``adapters``: the policy is wrapped in them (the first's ``apply``, then each other's
    ``add_to``), before it is sharded; the first is the active one.

    Every rank builds the model on the meta device and shards it, so no rank holds a full
    copy on its device; rank 0 alone reads the checkpoint (on CPU, float32) and broadcasts
    it, each rank keeping its shards. Non-persistent buffers (rotary frequencies), which the
    state dict does not carry, are broadcast from rank 0's copy too.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    auto: Any = AutoModelForTokenClassification if value else AutoModelForCausalLM
    labels: dict[str, Any] = {"num_labels": 1} if value else {}
    rank = dist.get_rank()
    full = _read_full(auto, model_path, options, labels, adapters) if rank == 0 else None
    config = AutoConfig.from_pretrained(model_path, **labels)
    config.use_cache = False
    with torch.device("meta"):
        model: nn.Module = auto.from_config(
            config, dtype=torch.float32, attn_implementation=options.attn_implementation
        )
    if adapters:
        model = _wrap(model, adapters)
    # Dropout off: the log-probs the gradient is taken at must equal the recomputed ones.
    model.eval()
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": options.reshard_after_forward,
    }
    if options.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=device)
    state = full.state_dict() if full is not None else {}
    set_model_state_dict(
        model,
        state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    _broadcast_buffers(model, full, device, rank)
    del full, state
    if not trainable:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def _read_full(
    auto: Any,
    model_path: str,
    options: FSDP2Options,
    labels: dict[str, Any],
    adapters: Sequence[Any],
) -> nn.Module:
    """Rank 0's full copy of the checkpoint (on CPU, float32), wrapped in the adapters."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if labels:
        # "Some weights were newly initialized" (the value head) is expected here.
        hf_logging.set_verbosity_error()
    try:
        full: nn.Module = auto.from_pretrained(
            model_path,
            dtype=torch.float32,
            attn_implementation=options.attn_implementation,
            **labels,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return _wrap(full, adapters) if adapters else full


def _broadcast_buffers(
    model: nn.Module, full: nn.Module | None, device: torch.device, rank: int
) -> None:
    """Non-persistent buffers (rotary frequencies), which the state dict does not carry, from
    rank 0's full copy to every rank's sharded model."""
    import torch.distributed as dist

    persistent = set(model.state_dict())
    source = dict(full.named_buffers()) if full is not None else {}
    for name, buffer in model.named_buffers():
        if name in persistent:
            continue
        if rank == 0:
            buffer.copy_(source[name].to(device))
        dist.broadcast(buffer, src=0)


def _wrap(model: nn.Module, adapters: Sequence[Any]) -> nn.Module:
    """``model`` wrapped in every adapter: the first's ``apply``, then the others'
    ``add_to``."""
    wrapped: nn.Module = adapters[0].apply(model)
    for adapter in adapters[1:]:
        adapter.add_to(wrapped)
    return wrapped


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward computes the head on the last ``logits_to_keep`` positions
    only (every Hugging Face causal LM of transformers >= 4.50 does)."""
    import inspect

    # A peft wrapper's forward passes its keyword arguments on to the model it wraps.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def _head_from(model: nn.Module, length: int, first: int) -> tuple[int, dict[str, Any]]:
    """Forward kwargs that compute the head only on positions ``first`` to ``length - 1``,
    and the position the returned logits start at (0 when the model computes them all)."""
    if _takes_logits_to_keep(model):
        return first, {"logits_to_keep": length - first}
    return 0, {}


def _shared_forward(
    model: nn.Module, layout: SharedLayout, device: torch.device, kwargs: dict[str, Any]
) -> Tensor:
    """The model's output (``logits``) over a shared-prompt layout, under its block mask."""
    sees = layout.sees
    if getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager":
        mask = torch.zeros(sees.shape[0], 1, layout.length, layout.length)
        mask.masked_fill_(~sees[:, None], torch.finfo(torch.float32).min)
    else:
        mask = sees[:, None]
    logits: Tensor = model(
        input_ids=layout.ids.to(device),
        attention_mask=mask.to(device),
        position_ids=layout.position.to(device),
        use_cache=False,
        **kwargs,
    ).logits
    return logits


@contextlib.contextmanager
def _quiet_view_warning() -> Iterator[None]:
    """The value head's output is a view (a Linear over ``[b, L, H]``), so FSDP2 warns that an
    in-place op on it would skip its backward hook; the values are read from it by indexing
    (a copy), never in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        yield


def token_values_shared(model: nn.Module, packed: PackedBatch, rows: list[int]) -> Tensor:
    """:func:`token_values` over the shared-prompt layout of :func:`token_logprobs_shared`
    (the value at the same positions the log-probs are read from)."""
    device = next(model.parameters()).device
    layout = shared_layout(packed, rows)
    with _quiet_view_warning():
        out = _shared_forward(model, layout, device, {})
    return _values_at(out, layout.unit.to(device), layout.pos.to(device), layout.valid.to(device))


def token_values(model: nn.Module, packed: PackedBatch, rows: list[int]) -> Tensor:
    """The critic's values ``[b, t]`` of samples ``rows``: for response token ``j``, the value
    of the state before it, read at the position whose logits predict it (the last prompt
    token for ``j = 0``); 0 on padding. Runs with or without grad as the caller's context
    says."""
    device = next(model.parameters()).device
    ids, attention, pos, valid = _unshared_inputs(packed, rows)
    with _quiet_view_warning():
        out = model(
            input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False
        ).logits
    unit = torch.arange(len(rows), device=device)
    return _values_at(out, unit, pos.to(device), valid.to(device))


def _values_at(out: Tensor, unit: Tensor, pos: Tensor, valid: Tensor) -> Tensor:
    values = out[unit[:, None], pos, 0].float()
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _unshared_inputs(packed: PackedBatch, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One right-padded sequence per sample of ``rows``: ids and attention mask ``[b, L]``;
    per response token ``j``, the position ``pos`` whose output predicts it and ``valid``
    ``[b, t]``."""
    index = torch.tensor(rows, dtype=torch.long)
    prompt = packed.prompt_lens[index]
    response = packed.response_lens[index]
    length = int((prompt + response).max())
    width = max(1, int(response.max()))
    ids = packed.input_ids[index, :length]
    attention = (torch.arange(length)[None, :] < (prompt + response)[:, None]).long()
    steps = torch.arange(width)[None, :]
    valid = steps < response[:, None]
    pos = (prompt[:, None] - 1 + steps).clamp(max=length - 1)
    return ids, attention, pos, valid


def _routed(routing: RoutingReplay | None, record: Tensor | None) -> Any:
    """The forward routed by (or measured against) ``record`` when the model has router
    hooks; nothing otherwise."""
    return routing.use(record) if routing is not None else contextlib.nullcontext()


def token_logprobs_shared(
    model: nn.Module,
    packed: PackedBatch,
    rows: list[int],
    *,
    entropy: bool,
    routing: RoutingReplay | None = None,
    tile: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs`, computing each distinct prompt once: the samples of ``rows``
    that share a prompt (a GRPO group) go in one sequence, ``prompt, response_1, response_2,
    ...``, with a block attention mask (each response sees the prompt and its own earlier
    tokens) and position ids that restart after the prompt for every response
    (:func:`miles_trainer_common.layout.shared_layout`). The same attention inputs as one
    sequence per sample, so the same log-probs up to float error, for a fraction of the
    tokens. ``routing``: the model's router hooks, given the layout's routing record.

    ``tile`` (true on-policy mode): the layout keeps every key where a tiled attention reads
    it in the sample's own sequence (only the prompt's whole tiles are shared), so the
    log-probs are bitwise those of :func:`token_logprobs`; when that layout would forward no
    fewer tokens than one sequence per sample (prompts shorter than a tile), it is that."""
    device = next(model.parameters()).device
    layout = shared_layout(packed, rows, tile)
    if tile is not None:
        index = torch.tensor(rows, dtype=torch.long)
        if layout.ids.numel() >= len(rows) * int(packed.seq_lens[index].max()):
            return token_logprobs(model, packed, rows, entropy=entropy, routing=routing)
    first, kwargs = _head_from(model, layout.length, layout.first)
    with _routed(routing, layout.routed):
        logits = _shared_forward(model, layout, device, kwargs)
    return logprobs_at(
        logits,
        layout.unit.to(device),
        (layout.pos - first).to(device),
        layout.target.to(device),
        layout.valid.to(device),
        entropy=entropy,
        truncation=_truncation(packed, rows),
    )


def token_logprobs(
    model: nn.Module,
    packed: PackedBatch,
    rows: list[int],
    *,
    entropy: bool,
    routing: RoutingReplay | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[b, t]`` of the response tokens of samples ``rows`` under ``model``
    (teacher forcing), and their entropies when asked; ``t`` is the longest response among
    ``rows``, padding is 0. Runs with or without grad as the caller's context says.
    ``routing``: the model's router hooks, given the samples' routing record."""
    device = next(model.parameters()).device
    ids, attention, pos, valid = _unshared_inputs(packed, rows)
    length = ids.shape[1]
    # The logit at position p predicts the token at p + 1: response token j of a sample with
    # prompt length P is predicted at P - 1 + j. Positions before the shortest prompt's last
    # token predict no response token: the head (a vocabulary-wide matmul) skips them.
    first, kwargs = _head_from(model, length, int(pos[:, 0].min()))
    record = packed.routed_experts
    if record is not None:
        record = record[torch.tensor(rows, dtype=torch.long), :length]
    with _routed(routing, record):
        logits = model(
            input_ids=ids.to(device),
            attention_mask=attention.to(device),
            use_cache=False,
            **kwargs,
        ).logits
    valid = valid.to(device)
    target = ids.gather(1, (pos + 1).clamp(max=length - 1)).to(device)
    pos = (pos - first).to(device)
    unit = torch.arange(len(rows), device=device)
    return logprobs_at(
        logits, unit, pos, target, valid, entropy=entropy, truncation=_truncation(packed, rows)
    )


def _truncation(packed: PackedBatch, rows: list[int]) -> Truncation | None:
    """The sampling parameters of samples ``rows`` when the batch was drawn with top-p or
    top-k (their log-probs are then the truncated distribution's), else ``None``."""
    return None if packed.truncation is None else packed.truncation.rows(rows)
