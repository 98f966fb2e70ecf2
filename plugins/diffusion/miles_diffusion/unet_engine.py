"""The served UNet and the worker that samples with it: :class:`UNetHolder` (the weights and
their version, loaded as the embedded engine loads a model's) and :class:`DiffusionEngine`
(one worker thread running sampling batches and weight loads, in order)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from miles_engine_embedded.weights import ModelHolder

from miles_diffusion.model import ModelInfo, load_unet, read_model_info
from miles_diffusion.options import DiffusionOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout


class UNetHolder(ModelHolder):
    """The served UNet and its weight version, with the embedded engine's weight loading
    (every name and shape checked before anything changes; ``load_named`` copies,
    ``adopt_named`` serves from a transport's tensors; ``load_from_disk`` reads a model folder).

    ``ModelHolder.__init__`` loads a causal LM, so this sets the fields its methods use itself.
    """

    def __init__(self, model_path: str, *, weight_version: str) -> None:
        self.invariant = False
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_path = model_path
        self.weight_version = weight_version
        self.info: ModelInfo = read_model_info(model_path)
        self.lean = None
        self.use_lean = False
        self.lora = None
        self._lora_modules = None
        self.gates: dict[int, Any] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.adopted = False
        #: incremented whenever the weights change (copies made from them are stale)
        self.generation = 0
        self.model = self._load(model_path)
        self.rebuild()

    def _load(self, path: str) -> Any:
        info = read_model_info(path)
        if hasattr(self, "model") and info != self.info:
            raise ValueError(
                f"{path} is a different diffusion model ({info}); this server serves {self.info}"
            )
        return load_unet(path)

    def rebuild(self) -> None:
        """Re-read the parameter table after the weights changed."""
        self.params = dict(self.model.state_dict(keep_vars=True))
        self.generation += 1


class SamplerRefused(ValueError):
    """The sampler settings cannot build a policy (a zero-variance step, say)."""


class DiffusionEngine:
    """What the diffusion server and the embedded server's weight routes
    (:class:`miles_engine_embedded.weight_routes.WeightRoutes`) drive, for a diffusion UNet:
    one worker thread that runs sampling batches and weight loads (``call``), in order."""

    def __init__(self, holder: UNetHolder, *, seed: int) -> None:
        self.holder = holder
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="miles-diffusion-batch")
        self.rng = random.Random(seed)
        self._stopped = False
        self.policies: dict[str, DiffusionPolicy] = {}
        self._copies: dict[str, Any] = {}  # the UNet in another dtype, for one generation
        self._copies_of = holder.generation
        self.batches = 0
        self.images = 0
        self.last_error: str | None = None

    def call(self, fn: Callable[[DiffusionEngine], Any]) -> Future[Any]:
        """Run ``fn(self)`` on the worker thread, after the batch or update running there."""
        return self.executor.submit(fn, self)

    def abort(self, rid: str | None = None, reason: str | None = None) -> int:
        """Nothing to abort: a batch runs to its end (it is one forward pass per step)."""
        return 0

    @property
    def alive(self) -> bool:
        return not self._stopped

    def stop(self) -> None:
        self._stopped = True
        self.executor.shutdown(wait=True)

    def unet(self, dtype: str) -> Any:
        """The served UNet in ``dtype`` (a copy for float64, remade after every update)."""
        if dtype == "float32":
            return self.holder.model
        if self._copies_of != self.holder.generation:
            self._copies, self._copies_of = {}, self.holder.generation
            self.policies = {k: p for k, p in self.policies.items() if p.options.dtype == "float32"}
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.holder.model).double()
        return self._copies[dtype]

    def policy(self, options: DiffusionOptions) -> DiffusionPolicy:
        """The policy of these sampler settings over the served UNet (cached)."""
        unet = self.unet(options.dtype)
        key = options.model_dump_json()
        policy = self.policies.get(key)
        if policy is None or policy.unet is not unet:
            try:
                policy = DiffusionPolicy(options, unet=unet)
            except ValueError as exc:
                raise SamplerRefused(str(exc)) from None
            self.policies[key] = policy
        return policy

    def sample(
        self, options: DiffusionOptions, labels: list[int], seed: int
    ) -> tuple[DiffusionRollout, str]:
        """One batch, and the weight version that sampled it."""
        policy = self.policy(options)
        try:
            rollout = policy.sample(labels, seed)
        except Exception as exc:
            self.last_error = repr(exc)
            raise
        self.batches += 1
        self.images += len(labels)
        return rollout, self.holder.weight_version
