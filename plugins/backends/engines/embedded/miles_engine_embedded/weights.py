"""The served model, its weight version, and the ways new weights arrive.

Every update is checked in full before any parameter is touched, so a rejected update leaves
the engine on its previous weights and version: it must hold at least one entry, every entry a
tensor of a known name with the served parameter's shape and dtype (no silent cast), and finite
values (unless the engine was started with ``allow_nonfinite_weights``). Every path in (tensor,
broadcast, p2p, disk) ends in :meth:`ModelHolder.load_named` or :meth:`ModelHolder.adopt_named`,
which run these checks; LoRA adapters get the same checks except that a floating-point adapter
is cast to the served dtype (PEFT saves adapters in float32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from miles_transport_common.engine_side import check_version

from miles_engine_embedded.lora import LoraBatch, LoraError, LoraRegistry

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: dtypes checked by their extremes: one pass, no temporary (``isfinite(t).all()`` writes a
#: bool per element first, about 30 times slower; it made most of an update's commit)
_BY_EXTREMES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``t`` holds a NaN or an infinity."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    if t.dtype in _BY_EXTREMES:
        # a NaN anywhere makes both extremes NaN, an infinity is an extreme
        finite = all(bool(torch.isfinite(x)) for x in torch.aminmax(t))
    else:
        finite = bool(torch.isfinite(t).all())
    if not finite:
        raise ValueError(
            f"weight {name!r} holds NaN or infinite values; refused (start the engine with "
            "allow_nonfinite_weights to accept them)"
        )


def _own_pages(model: Any) -> None:
    """Give every tensor of ``model`` memory of its own: loaded on the CPU, they are a private
    mapping of the checkpoint file, so each first write (an update, a copy) costs a page fault
    and a read of the file, and a checkpoint cut short on disk meanwhile would crash the
    server (SIGBUS) when it next reads an unwritten page. Tied tensors stay one."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"torch.bfloat16"`` ... -> torch dtype."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[key]


def moe_gates(model: Any) -> dict[int, Any]:
    """The router module (``mlp.gate``) of every mixture-of-experts decoder layer, by layer
    index (empty for a dense model)."""
    from miles_engine_embedded.fast_forward import is_moe

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return {i: layer.mlp.gate for i, layer in enumerate(layers) if is_moe(layer.mlp)}


def cache_keyword(model: Any) -> str:
    """The keyword a Hugging Face causal LM's forward takes its KV cache by: ``cache`` in
    recent transformers 5 releases, ``past_key_values`` before them. An unknown keyword is
    swallowed by the forward's ``**kwargs``: every step would then run without its cache."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ModelHolder:
    """Owns the model; loads checkpoints and applies named tensors."""

    #: accept updates holding NaN or infinite values (a class default too: a subclass that
    #: sets its fields itself, the diffusion server's holder, gets the safe one)
    allow_nonfinite_weights: bool = False
    #: weight loads committed since start, so a reader of the weights sees whether one ran
    #: (a class default too, for a subclass that sets its fields itself)
    commits: int = 0

    def __init__(
        self,
        model_path: str,
        *,
        device: str,
        dtype: str,
        weight_version: str,
        lean_forward: bool = True,
        matmul: str = "auto",
        attention: str = "auto",
        lora: dict[str, Any] | None = None,
        invariant: bool = False,
        allow_nonfinite_weights: bool = False,
    ) -> None:
        """``allow_nonfinite_weights``: accept updates holding NaN or infinite values (refused
        by default: one such value turns every generation into NaN log-probabilities).
        ``lora``: the LoRA options (``max_lora_rank``, ``max_loras_per_batch``,
        ``max_loaded_loras``, ``target_modules``) when LoRA is enabled, else None.
        ``invariant``: true on-policy mode, the model prepared for the batch-invariant kernels
        (:func:`miles_core.invariant.kernels.prepare`) and run by its own forward, as the
        trainer runs it (never the lean forward, whatever ``lean_forward`` says)."""
        self.invariant = invariant
        self.allow_nonfinite_weights = allow_nonfinite_weights
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.model_path = model_path
        self.weight_version = weight_version
        self.model = self._load(model_path)
        if self.device.type == "cpu":  # served from: a later load only copies out of its model
            _own_pages(self.model)
        self.lean: Any = None
        self.use_lean = lean_forward and not invariant
        #: the lean forward's product layout (``auto``, ``linear``, ``transposed``)
        self.matmul = matmul
        #: the lean forward's decode attention (``auto``, ``native``, ``sdpa``: :mod:`.native`)
        self.attention = attention
        self.params: dict[str, torch.Tensor] = {}
        #: some parameters serve from memory a weight transport handed over (see adopt_named)
        self.adopted = False
        self.rebuild()
        #: the served LoRA adapters (None: LoRA is not enabled)
        self.lora: LoraRegistry | None = None
        if lora is not None:
            self.lora = LoraRegistry(self.model, dtype=self.dtype, device=self.device, **lora)
        #: the fallback forward's view of the adapters: module -> (layer, kind)
        self._lora_modules: dict[Any, tuple[int, str]] | None = None

    def _load(self, path: str) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation="sdpa"
        )
        if self.invariant:
            from miles_core.invariant.kernels import prepare

            prepare(model)
        return model.to(self.device).eval()

    def rebuild(self) -> None:
        """(Re)bind the parameter table and the lean forward to the current tensors."""
        from miles_engine_embedded.fast_forward import LeanForward

        # keep_vars: the live parameters, tied aliases (lm_head = embeddings) included.
        self.params = dict(self.model.state_dict(keep_vars=True))
        ok = self.use_lean and LeanForward.supports(self.model)
        self.lean = LeanForward(self.model, self.matmul, self.attention) if ok else None
        self.gates = moe_gates(self.model)
        self.cache_keyword = cache_keyword(self.model)

    @property
    def moe_layers(self) -> list[int]:
        """The decoder layers whose MLP is a mixture of experts (empty: a dense model)."""
        return list(self.gates)

    def forward(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        keep: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, K, V]`` at the positions ``keep`` (all when None), writing keys and
        values into ``cache``; the lean path when the family allows it. ``lora``: each row's
        adapter deltas (None: the base model for every row). ``routing``: when a list, the
        top-k expert ids ``[B, N, k]`` the router chose in each MoE layer are appended to it,
        in layer order (one entry per layer of :attr:`moe_layers`)."""
        if self.lean is not None:
            return self.lean(ids, position_ids, mask, cache, keep, lora, routing)
        handles = self._hook_lora(lora) if lora is not None else []
        if routing is not None:
            b, n = ids.shape

            def record(_m: Any, _args: Any, out: Any) -> None:
                routing.append(out[2].view(b, n, -1))  # (logits, weights, indices)

            handles += [gate.register_forward_hook(record) for gate in self.gates.values()]
        try:
            out = self.model(
                input_ids=ids,
                position_ids=position_ids,
                attention_mask=mask,
                **{self.cache_keyword: cache},
                use_cache=True,
                logits_to_keep=keep if keep is not None else 0,
            )
        finally:
            for handle in handles:
                handle.remove()
        return out.logits

    def _hook_lora(self, lora: LoraBatch) -> list[Any]:
        """Forward hooks adding the adapters' deltas to the model's own forward, for one call
        (the base-model path keeps no hook)."""
        if self._lora_modules is None:
            import re

            pattern = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")
            self._lora_modules = {}
            for name, mod in self.model.named_modules():
                m = pattern.match(name)
                if m and isinstance(mod, torch.nn.Linear):
                    self._lora_modules[mod] = (int(m.group(1)), m.group(2))
        handles = []
        for mod, (layer, kind) in self._lora_modules.items():
            if (layer, kind) not in lora.weights:
                continue

            def hook(
                _m: Any,
                args: tuple[Any, ...],
                out: torch.Tensor,
                layer: int = layer,
                kind: str = kind,
            ) -> torch.Tensor:
                return lora.add(layer, kind, args[0], out)

            handles.append(mod.register_forward_hook(hook))
        return handles

    def set_adapter(
        self,
        name: str,
        config_dict: dict[str, Any],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        path: str = "__tensor__",
        pinned: bool = False,
    ) -> int:
        """Check an adapter in full, then install it as ``name`` (replacing one of that name):
        all or nothing. Called on the engine's thread like every weight change; returns the
        number of adapted modules. A refusal is a :class:`~.lora.LoraError` naming the field."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled")
        named_tensors = list(named_tensors)
        for tname, t in named_tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise LoraError(f"tensor {tname!r}: {what} refused; allowed: a floating tensor")
            if not self.allow_nonfinite_weights:
                try:
                    check_finite(str(tname), t)
                except ValueError as exc:
                    raise LoraError(str(exc)) from None
        adapter = self.lora.build(name, config_dict, named_tensors, path=path, pinned=pinned)
        self.lora.install(adapter)
        return len(adapter.weights)

    def bump_version(self, version: str | None) -> None:
        """Set the version when given; otherwise increment a numeric version. A version the
        protocol does not allow (:func:`check_version`) is a ``ValueError``; callers check it
        before loading anything, this is the last guard."""
        check_version(version)
        if version is not None:
            self.weight_version = version
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)

    def load_from_disk(self, path: str) -> int:
        """Copy every weight of the checkpoint folder ``path`` into the served model."""
        new = self._load(path)
        state = new.state_dict()
        mine = self.model.state_dict()
        if set(state) != set(mine):
            missing = sorted(set(mine) - set(state))[:5]
            extra = sorted(set(state) - set(mine))[:5]
            raise ValueError(
                f"checkpoint does not match the model: missing {missing}, extra {extra}"
            )
        self.load_named(state.items())
        self.model_path = path
        return len(state)

    def load_named(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors into the model after checking every name and shape."""
        items = list(named)
        self._check(items)
        self._own_memory()
        with torch.no_grad():
            for name, t in items:
                self.params[name].copy_(t)
        self.commits += 1
        self.rebuild()  # the lean forward holds fused copies of some weights
        return len(items)

    def commit_written(self, names: Iterable[str]) -> int:
        """Commit weights written straight into the served tensors (an engine's copy of a
        peer's): judged as any update (``ValueError`` naming the weight), counted, and the
        lean forward rebound to them."""
        items = [(name, self.params[name]) for name in names]
        self._check(items)
        self.commits += 1
        self.rebuild()
        return len(items)

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        # The one place every update is judged, before anything changes (see the module doc).
        if not items:
            raise ValueError("the update holds no weight; an empty update is refused")
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
            if name not in self.params:
                raise ValueError(f"unknown weight {name!r}")
            if tuple(t.shape) != tuple(self.params[name].shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(t.shape)}, "
                    f"expected {tuple(self.params[name].shape)}"
                )
            if t.dtype != self.params[name].dtype:
                raise ValueError(
                    f"weight {name!r} has dtype {t.dtype}, the served weight is "
                    f"{self.params[name].dtype}; refused (no silent cast)"
                )
            if not self.allow_nonfinite_weights:
                check_finite(name, t)

    def _own_memory(self) -> None:
        # Adopted parameters alias a transport's buffers (possibly shared with other engines):
        # give every parameter its own memory again before writing into it.
        if self.adopted:
            with torch.no_grad():
                for p in {id(p): p for p in self.params.values()}.values():
                    p.data = p.data.clone()
            self.adopted = False

    def adopt_named(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Serve from the given tensors without copying them (a weight transport keeps their
        memory untouched until the update after next). A tensor whose device or layout differs
        from the parameter's is copied instead. Everything is checked first."""
        items = list(named)
        self._check(items)
        with torch.no_grad():
            for name, t in items:
                p = self.params[name]
                if t.dtype == p.dtype and t.device == p.device and t.is_contiguous():
                    p.data = t
                    self.adopted = True
                else:
                    if self.adopted:
                        p.data = p.data.clone()  # never write into a transport's buffer
                    p.copy_(t)
        self.commits += 1
        self.rebuild()
        return len(items)
