"""The ``diffusion`` trainer backend: the UNet of ``model.path`` trained in the run's process
with any algorithm over denoising steps (``diffusion_grpo``), on the groups of the
``diffusion_sample`` rollout function.

It implements :class:`miles_core.contracts.Trainer`. Every sample carries the sampler's
settings it was drawn with (``metadata["sampler"]``); the trainer recomputes each step's
log-probability under its weights with those settings and the batch shape the engine sampled
with (one batch per group), so unchanged weights reproduce the engine's values. A checkpoint
is itself a diffusion model folder (``miles_diffusion.json`` + ``unet/``) plus the optimizer's
state, the RNG and the version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_core.contracts import TokenBatch
from miles_core.data import Group
from miles_diffusion.grpo import accumulate_step_losses
from miles_diffusion.modality import policy_options
from miles_diffusion.model import load_unet, read_model_info, write_model_info
from miles_diffusion.options import DiffusionTrainerOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout
from miles_diffusion.rollout import rollout_from_groups


def sampler_of(groups: Sequence[Group]) -> dict[str, Any]:
    """The sampler settings every sample of ``groups`` was drawn with; an error when they
    differ (one batch is trained with one schedule) or are missing."""
    seen: dict[str, Any] | None = None
    for group in groups:
        for s in group.samples:
            sampler = s.metadata.get("sampler")
            if sampler is None:
                raise ValueError(
                    f"group {group.group_id}: a sample has no metadata['sampler'] (the sampler "
                    "settings it was drawn with); it was not made by diffusion_sample on a "
                    "diffusion engine"
                )
            if seen is None:
                seen = dict(sampler)
            elif dict(sampler) != seen:
                raise ValueError(
                    f"group {group.group_id} was sampled with {dict(sampler)}, another group "
                    f"with {seen}: one step trains samples of one sampler"
                )
    if seen is None:
        raise ValueError("no samples to train on")
    return seen


class DiffusionTrainer:
    """A :class:`~miles_core.contracts.Trainer` of a diffusion model folder's UNet (AdamW)."""

    def __init__(self, options: DiffusionTrainerOptions | None = None) -> None:
        self.options = options or DiffusionTrainerOptions()
        self.weight_version = 0
        self.extra: dict[str, Any] = {}
        self.unet: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._policies: dict[str, DiffusionPolicy] = {}
        self._ref_policies: dict[str, DiffusionPolicy] = {}

    # --- set-up -------------------------------------------------------------------------

    def setup(self, model_path: str) -> None:
        """Load the folder's UNet to train and build the optimizer."""
        o = self.options
        if o.num_threads is not None:
            torch.set_num_threads(o.num_threads)
        torch.manual_seed(o.seed)
        self.model_path = model_path
        self.info = read_model_info(model_path)
        self.unet = load_unet(model_path).train()
        if o.lora_rank is not None:
            self.unet = with_lora(self.unet, o)
        params = [p for p in self.unet.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas
        )

    def _policy(self, sampler: dict[str, Any], *, reference: bool = False) -> DiffusionPolicy:
        """The policy over the trained UNet (or the frozen reference) with ``sampler``."""
        key = json.dumps(sampler, sort_keys=True)
        cache = self._ref_policies if reference else self._policies
        if key not in cache:
            unet = self._reference() if reference else self.unet
            cache[key] = DiffusionPolicy(policy_options(self.info, sampler), unet=unet)
        return cache[key]

    def _reference(self) -> Any:
        """A frozen copy of the starting weights (made on first use: a KL term needs it)."""
        if self.reference is None:
            self.reference = load_unet(self.model_path).eval().requires_grad_(False)
        return self.reference

    def _batch(self, groups: list[Group]) -> tuple[DiffusionPolicy, DiffusionRollout, TokenBatch]:
        if self.unet is None:
            raise RuntimeError("call setup(model_path) first")
        sampler = sampler_of(groups)
        rollout, rewards, group_index = rollout_from_groups(groups)
        lp = rollout.logprobs.detach().to(torch.float32)
        rollout.logprobs = lp
        batch = TokenBatch(
            response_mask=torch.ones_like(lp),
            rollout_logprobs=lp,
            rewards=rewards.to(lp.dtype),
            group_index=group_index,
        )
        return self._policy(sampler), rollout, batch

    # --- the contract -------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, groups: list[Group]) -> tuple[Tensor, Tensor | None]:
        """Every step's log-probability ``[B, K]`` under the current weights (no entropy)."""
        policy, rollout, _ = self._batch(groups)
        lp = policy.step_logprobs(
            rollout.latents[:, :-1],
            rollout.latents[:, 1:],
            rollout.timesteps,
            rollout.labels,
            rollout.chunks,
        )
        return lp, None

    def train_step(self, groups: list[Group], algorithm: Any) -> dict[str, float]:
        """One optimiser step per inner epoch on ``groups`` with ``algorithm``'s loss per
        denoising step; bumps the weight version."""
        policy, rollout, batch = self._batch(groups)
        assert self.optimizer is not None
        if "ref_logprobs" in algorithm.needs:
            ref = self._policy(sampler_of(groups), reference=True)
            with torch.no_grad():
                batch.ref_logprobs = ref.step_logprobs(
                    rollout.latents[:, :-1],
                    rollout.latents[:, 1:],
                    rollout.timesteps,
                    rollout.labels,
                    rollout.chunks,
                )
        algorithm.compute_advantages(batch)
        # The mismatch is measured where it means something: on the samples drawn with the
        # weights being trained (in an asynchronous run older ones are off-policy by design).
        current = torch.tensor(
            [s.oldest_version == self.weight_version for g in groups for s in g.samples]
        )
        metrics: dict[str, float] = {}
        mismatch = 0.0
        for epoch in range(self.options.num_inner_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            sums, gap = accumulate_step_losses(policy, algorithm, batch, rollout, current)
            if epoch == 0:  # before any update: the trainer's log-probs against the engine's
                mismatch = gap
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.unet.parameters(), self.options.max_grad_norm
            )
            self.optimizer.step()
            metrics = {**sums, "grad_norm": float(grad_norm)}
        self.weight_version += 1
        if bool(current.any()):
            metrics["mismatch/abs_max"] = mismatch
        metrics["mismatch/on_policy_images"] = float(current.sum())
        metrics["images"] = float(rollout.latents.shape[0])
        return metrics

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The UNet's tensors by their ``state_dict`` names (what the diffusion engine loads);
        with LoRA, every adapted weight merged (``W + scale * B A``) under its plain name."""
        if self.options.lora_rank is None:
            for name, tensor in self.unet.state_dict().items():
                yield name, tensor.detach()
            return
        from peft.tuners.lora import LoraLayer

        deltas = {
            f"{name}.weight": module.get_delta_weight("default")
            for name, module in self.unet.named_modules()
            if isinstance(module, LoraLayer)
        }
        for name, tensor in self.unet.state_dict().items():
            if ".lora_" in name:
                continue
            plain = name.replace(".base_layer.", ".")
            delta = deltas.get(plain)
            yield plain, (tensor if delta is None else tensor + delta).detach()

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """A diffusion model folder at ``path`` (``unet/`` + ``miles_diffusion.json``) plus the
        optimizer, the RNG, the weight version and ``extra``."""
        assert self.optimizer is not None
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if self.options.lora_rank is None:
            self.unet.save_pretrained(str(out / "unet"))
        else:  # the merged model as a plain folder, the adapters beside it for a resume
            plain = load_unet(self.model_path)
            plain.load_state_dict(dict(self.export_weights()))
            plain.save_pretrained(str(out / "unet"))
            torch.save(
                {k: v for k, v in self.unet.state_dict().items() if ".lora_" in k},
                out / "lora.pt",
            )
        write_model_info(out, self.info)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "weight_version": self.weight_version,
                "extra": dict(extra or {}),
            },
            out / "trainer_state.pt",
        )

    def load(self, path: str) -> None:
        """Restore :meth:`save`: the weights, the optimizer, the RNG, the version, ``extra``."""
        assert self.optimizer is not None
        state_file = os.path.join(path, "trainer_state.pt")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"{path} is not a diffusion trainer checkpoint")
        if self.options.lora_rank is None:
            self.unet.load_state_dict(load_unet(path).state_dict())
        else:  # the base stays model.path's; the adapters are the checkpoint's
            lora_file = os.path.join(path, "lora.pt")
            if not os.path.isfile(lora_file):
                raise FileNotFoundError(f"{path} has no lora.pt: it was saved without LoRA")
            missing = self.unet.load_state_dict(_load_plain(lora_file), strict=False)
            if missing.unexpected_keys:
                raise ValueError(f"{lora_file}: unknown adapter weights {missing.unexpected_keys}")
        state = _load_plain(state_file)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.weight_version = int(state["weight_version"])
        self.extra = dict(state["extra"])

    def sleep(self) -> None:
        """Nothing to give back: the trainer runs on the CPU in the run's process."""

    def wake(self) -> None:
        """See :meth:`sleep`."""

    def close(self) -> None:
        """Drop the model and the optimizer."""
        self.unet = self.reference = self.optimizer = None
        self._policies.clear()
        self._ref_policies.clear()


def with_lora(unet: Any, options: DiffusionTrainerOptions) -> Any:
    """``unet`` with peft LoRA adapters (``lora_B`` zero: the same function at first) on the
    target modules, its own weights frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    unet.requires_grad_(False)
    config = LoraConfig(
        r=options.lora_rank,
        lora_alpha=options.lora_alpha,
        target_modules=list(options.lora_target_modules),
    )
    try:
        return inject_adapter_in_model(config, unet)
    except ValueError as exc:  # no module matched
        raise ValueError(
            f"backend.lora_target_modules {options.lora_target_modules}: {exc}"
        ) from None


def build(options: DiffusionTrainerOptions | None) -> DiffusionTrainer:
    """Factory of the ``diffusion`` trainer backend (no adapters, routing or true on-policy
    mode: its record declares none, so the run's checks refuse them at start)."""
    return DiffusionTrainer(options)


def _load_plain(path: str) -> Any:
    """``torch.load`` with ``weights_only=True``: a checkpoint someone else wrote cannot run
    code on load; a file holding more than tensors and plain values is refused by name."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"checkpoint file {path} holds objects other than tensors and plain values and is "
            f"refused (written by an older version of miles, or changed): {exc}"
        ) from None
