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
from miles_diffusion.modality import SAMPLER_FIELDS, DiffusionModality
from miles_diffusion.options import DiffusionSampleOptions
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout, to_images


class DiffusionSample:
    """Samples ``group_size`` images of one prompt class and scores each with the reward
    function.

    ``engine`` is what generates: in a run, the fleet's engine client of a ``diffusion``
    engine (one ``generate`` request per group, drawn as one batch); in the Python API, a
    :class:`~miles_diffusion.policy.DiffusionPolicy`, which samples in-process. The sampler's
    settings are the run's ``modality`` options (the ``modality`` of the context), else the
    policy's. A reward that raises, or returns NaN or an infinity, fails its sample (the run
    drops the group as ``reward_failed`` and counts it)."""

    def __init__(self, options: DiffusionSampleOptions | None = None) -> None:
        self.options = options or DiffusionSampleOptions()
        self._seeds = itertools.count(self.options.base_seed)

    def _label(self, prompt: Mapping[str, Any], num_classes: int) -> int:
        if num_classes == 0:
            return 0
        key = self.options.label_key
        if key not in prompt:
            raise ValueError(
                f"prompt record has no {key!r} field: a class-conditioned diffusion model needs "
                f"an integer class in [0, {num_classes})"
            )
        label = int(prompt[key])
        if not 0 <= label < num_classes:
            raise ValueError(f"prompt {key!r} is {label}; allowed: 0 to {num_classes - 1}")
        return label

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
        from miles_core.builtins.rollouts import score

        seed = prompt.get(self.options.seed_key)
        seed = int(seed) if seed is not None else next(self._seeds)
        modality = context.get("modality")
        if isinstance(engine, DiffusionPolicy):
            label = self._label(prompt, engine.options.num_classes)
            # Sampling is CPU/GPU-bound torch work: keep the event loop free for other groups.
            rollout = await asyncio.to_thread(engine.sample, [label] * group_size, seed)
            sampler = {k: getattr(engine.options, k) for k in SAMPLER_FIELDS}
        elif hasattr(engine, "generate"):
            if not isinstance(modality, DiffusionModality):
                raise TypeError(
                    "diffusion_sample generates on an engine only in a run with modality "
                    f"'diffusion' (got modality {getattr(modality, 'name', modality)!r})"
                )
            sampler = modality.sampler()
            label = self._label(prompt, modality.options.num_classes)
            result = await engine.generate(
                [label], {"n": group_size, "seed": seed, **sampler}, return_logprob=True
            )
            rollout = DiffusionRollout(
                images=to_images(result.latents[:, -1]),
                latents=result.latents,
                logprobs=result.step_logprobs,
                timesteps=torch.tensor(result.timesteps, dtype=torch.long),
                labels=torch.full((group_size,), label, dtype=torch.long),
                seed=seed,
                weight_version=int(result.weight_version or 0),
            )
        else:
            raise TypeError(
                "diffusion_sample needs a diffusion engine's client or a DiffusionPolicy as "
                f"its engine, got {type(engine).__name__}"
            )
        samples = rollout_to_samples(rollout)
        for s in samples:
            s.metadata["sampler"] = dict(sampler)
            score(s, prompt, reward)
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
