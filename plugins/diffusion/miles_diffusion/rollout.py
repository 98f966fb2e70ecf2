"""The ``diffusion_sample`` rollout function: one group of images for one prompt record.

A denoising step plays the part of a generated token in the core's data model: a sample's
``response_ids`` are the timesteps of its steps, ``logprobs`` their log-probabilities,
``versions`` the weight version that sampled them. The image and the latent trajectory travel in
``metadata`` (``image`` ``[C, H, W]``, ``latents`` ``[K + 1, C, H, W]``, ``label``, ``seed``), so
a group can be turned back into a training batch with :func:`rollout_from_groups`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from miles_core.contracts import RewardFn
from miles_core.data import Group, Sample
from miles_diffusion.options import DiffusionSampleOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout


class DiffusionSample:
    """Samples ``group_size`` images of one prompt class with the policy (the ``engine``
    argument: a :class:`~miles_diffusion.policy.DiffusionPolicy`, which samples in-process) and
    scores each with the reward function. A reward that raises marks its sample ``error``."""

    def __init__(self, options: DiffusionSampleOptions | None = None) -> None:
        self.options = options or DiffusionSampleOptions()
        self._seeds = itertools.count(self.options.base_seed)

    def _label(self, prompt: Mapping[str, Any], policy: DiffusionPolicy) -> int:
        if policy.options.num_classes == 0:
            return 0
        key = self.options.label_key
        if key not in prompt:
            raise ValueError(
                f"prompt record has no {key!r} field: a class-conditioned diffusion policy needs "
                f"an integer class in [0, {policy.options.num_classes})"
            )
        return int(prompt[key])

    async def __call__(
        self,
        prompt: Mapping[str, Any],
        *,
        group_size: int,
        engine: Any,
        reward: RewardFn,
        **context: Any,
    ) -> Group:
        """Generate and score one group."""
        if not isinstance(engine, DiffusionPolicy):
            raise TypeError(
                "diffusion_sample needs a DiffusionPolicy as its engine, got "
                f"{type(engine).__name__}"
            )
        label = self._label(prompt, engine)
        seed = prompt.get(self.options.seed_key)
        seed = int(seed) if seed is not None else next(self._seeds)
        # Sampling is CPU/GPU-bound torch work: keep the event loop free for other groups.
        rollout = await asyncio.to_thread(engine.sample, [label] * group_size, seed)
        samples = rollout_to_samples(rollout)
        for s in samples:
            try:
                s.reward = float(reward(s, prompt))
            except Exception as exc:  # a failing reward fails its sample, not the run
                s.finish_reason = "error"
                s.metadata["error"] = f"reward raised {type(exc).__name__}: {exc}"
        return Group(samples=samples, prompt=dict(prompt))


def rollout_to_samples(rollout: DiffusionRollout) -> list[Sample]:
    """One :class:`~miles_core.data.Sample` per image of the rollout."""
    steps = [int(t) for t in rollout.timesteps.tolist()]
    out = []
    for i in range(rollout.images.shape[0]):
        label = int(rollout.labels[i])
        s = Sample(
            prompt_ids=[label],
            metadata={
                "image": rollout.images[i],
                "latents": rollout.latents[i],
                "label": label,
                "seed": rollout.seed,
                "index": i,
            },
        )
        s.append(steps, logprobs=rollout.logprobs[i].tolist(), version=rollout.weight_version)
        out.append(s)
    return out


def rollout_from_groups(groups: Sequence[Group]) -> tuple[DiffusionRollout, Tensor, Tensor]:
    """Stack the samples of whole groups back into a training batch.

    Returns the rollout (log-probs as recorded at sampling time, ``chunks`` one per group), the
    rewards ``[B]`` and the group index of each sample ``[B]``. Failed samples and samples
    without a reward are an error: the loop drops such groups before training.
    """
    samples, index = [], []
    for g, group in enumerate(groups):
        for s in group.samples:
            if s.failed or s.reward is None:
                raise ValueError(
                    f"group {group.group_id} has a failed or unscored sample; drop the group "
                    "before training"
                )
            samples.append(s)
            index.append(g)
    if not samples:
        raise ValueError("no samples to train on")
    steps = samples[0].response_ids
    if any(s.response_ids != steps for s in samples):
        raise ValueError("samples of one batch must share the same denoising timesteps")
    latents = torch.stack([torch.as_tensor(s.metadata["latents"]) for s in samples])
    rollout = DiffusionRollout(
        images=torch.stack([torch.as_tensor(s.metadata["image"]) for s in samples]),
        latents=latents,
        logprobs=torch.tensor([s.logprobs for s in samples], dtype=latents.dtype),
        timesteps=torch.tensor(steps, dtype=torch.long),
        labels=torch.tensor([int(s.metadata["label"]) for s in samples], dtype=torch.long),
        seed=-1,
        weight_version=min(v for s in samples if (v := s.oldest_version) is not None),
        # diffusion_sample draws each group as one batch: recompute it with that shape.
        chunks=[len(g.samples) for g in groups],
    )
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float64)
    return rollout, rewards, torch.tensor(index, dtype=torch.long)
