"""The diffusion policy: a diffusers UNet and DDIM schedule, sampled stochastically.

A rollout of the policy is the whole denoising trajectory ``x_T -> ... -> x_0``; each step is a
Gaussian action (see :mod:`miles_diffusion.ddim`), so the policy assigns every step a
log-probability. :meth:`DiffusionPolicy.sample` records the trajectory and those log-probs;
:meth:`DiffusionPolicy.step_logprobs` recomputes them under the current weights for the
importance ratio of a PPO/GRPO objective.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles_diffusion.ddim import (
    StepCoefficients,
    gaussian_logprob,
    sample_step,
    step_coefficients,
    step_mean,
)
from miles_diffusion.options import DiffusionOptions

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DiffusionRollout:
    """A batch of sampled trajectories.

    Shapes: ``B`` samples, ``K`` denoising steps, images ``C x H x W``.

    Attributes:
        images: final images in ``[0, 1]``, ``[B, C, H, W]``.
        latents: the trajectory ``x_T, ..., x_0``, ``[B, K + 1, C, H, W]``.
        logprobs: log-probability of each step under the sampling weights, ``[B, K]``.
        timesteps: the timestep each step starts from, ``[K]`` (shared by the batch).
        labels: the class each sample was conditioned on, ``[B]`` (zeros when unconditional).
        seed: the seed that drew the initial noise and every step's noise.
        weight_version: the policy's weight version that sampled the batch.
        chunks: sizes of the consecutive sampling batches the rows came from (``None``: one
            batch). Recomputing with the same batch shapes reproduces the sampled log-probs bit
            for bit; a different batch shape may change them by float rounding.
    """

    images: Tensor
    latents: Tensor
    logprobs: Tensor
    timesteps: Tensor
    labels: Tensor
    seed: int
    weight_version: int
    chunks: list[int] | None = None


class DiffusionPolicy:
    """A tiny class-conditioned ``UNet2DModel`` with a ``DDIMScheduler``, built from options with
    random initialisation (no downloaded weights).

    The prompt of a sample is an integer class (``num_classes > 0``); guidance is classifier-free
    with the extra class id ``num_classes`` as the unconditional one.
    """

    def __init__(self, options: DiffusionOptions | None = None, *, unet: Any = None) -> None:
        """``unet``: a loaded ``UNet2DModel`` to sample with (see :meth:`from_pretrained`; its
        image shape and classes must be the options'); ``None`` builds a random one from the
        options."""
        # diffusers resolves its classes lazily, so type checkers see them as untyped.
        import diffusers

        unet_cls: Any = diffusers.UNet2DModel
        scheduler_cls: Any = diffusers.DDIMScheduler

        self.options = opts = options or DiffusionOptions()
        self.dtype = _DTYPES[opts.dtype]
        levels = len(opts.block_out_channels)
        if unet is not None:
            self.unet = unet
            check_unet(unet, opts)
        else:
            # Seeded in a forked RNG so building a policy neither depends on nor disturbs the
            # caller's global random state.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(opts.init_seed)
                self.unet = unet_cls(
                    sample_size=opts.sample_size,
                    in_channels=opts.channels,
                    out_channels=opts.channels,
                    block_out_channels=opts.block_out_channels,
                    layers_per_block=opts.layers_per_block,
                    down_block_types=("DownBlock2D",) * levels,
                    up_block_types=("UpBlock2D",) * levels,
                    norm_num_groups=opts.norm_num_groups,
                    add_attention=False,
                    num_class_embeds=opts.num_classes + 1 if opts.num_classes else None,
                )
        if self.dtype == torch.float64:
            # nn.Module.double, not ModelMixin.to, which warns about keeping fp32 modules
            # (a concern of half precision, not of float64).
            self.unet = self.unet.double()
        self.scheduler: Any = scheduler_cls(
            num_train_timesteps=opts.num_train_timesteps,
            beta_schedule=opts.beta_schedule,
            timestep_spacing=opts.timestep_spacing,
            # alpha_0 < 1 at the end keeps the last step's variance > 0: with alpha = 1 the last
            # step is deterministic and has no log-probability.
            set_alpha_to_one=False,
            clip_sample=opts.clip_sample,
            prediction_type="epsilon",
        )
        self.scheduler.set_timesteps(opts.num_inference_steps)
        self.timesteps: list[int] = [int(t) for t in self.scheduler.timesteps]
        stride = opts.num_train_timesteps // opts.num_inference_steps
        self.coefficients: list[StepCoefficients] = [
            step_coefficients(
                self.scheduler.alphas_cumprod,
                float(self.scheduler.final_alpha_cumprod),
                t,
                t - stride,
                opts.eta,
            )
            for t in self.timesteps
        ]
        zero = [t for t, c in zip(self.timesteps, self.coefficients, strict=True) if c.std <= 0]
        if zero:
            raise ValueError(
                f"the DDIM steps from timesteps {zero} have zero variance, so they have no "
                "log-probability; use timestep_spacing='trailing' or fewer inference steps"
            )
        self.weight_version = 0

    @property
    def num_steps(self) -> int:
        """Number of denoising steps ``K``."""
        return len(self.timesteps)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Image shape ``(C, H, W)``."""
        o = self.options
        return (o.channels, o.sample_size, o.sample_size)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The trainable parameters (the UNet's)."""
        params: Iterator[torch.nn.Parameter] = self.unet.parameters()
        return params

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Named tensors of the current weights, for a weight transport."""
        for name, tensor in self.unet.state_dict().items():
            yield name, tensor.detach()

    def condition(self, labels: Tensor | Sequence[int] | None, batch: int) -> Tensor | None:
        """Checked class labels ``[B]`` for the UNet (``None`` when unconditional)."""
        if self.options.num_classes == 0:
            return None
        if labels is None:
            raise ValueError("this policy is class-conditioned: pass one label per sample")
        out = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
        if out.numel() != batch:
            raise ValueError(f"got {out.numel()} labels for a batch of {batch}")
        if bool((out < 0).any()) or bool((out >= self.options.num_classes).any()):
            raise ValueError(
                f"labels must be in [0, {self.options.num_classes}); got {out.tolist()}"
            )
        return out

    def predict_noise(self, x: Tensor, t: int, labels: Tensor | None) -> Tensor:
        """The network's noise prediction at timestep ``t`` (with classifier-free guidance)."""
        g = self.options.guidance_scale
        ts = torch.full((x.shape[0],), t, dtype=torch.long)
        if labels is None or g == 1.0:
            out: Tensor = self.unet(x, ts, class_labels=labels).sample
            return out
        null = torch.full_like(labels, self.options.num_classes)
        both = self.unet(
            torch.cat([x, x]), torch.cat([ts, ts]), class_labels=torch.cat([labels, null])
        ).sample
        cond, uncond = both.chunk(2)
        guided: Tensor = uncond + g * (cond - uncond)
        return guided

    def step_logprob(
        self,
        k: int,
        x_t: Tensor,
        x_prev: Tensor,
        labels: Tensor | None,
        chunks: Sequence[int] | None = None,
    ) -> Tensor:
        """Log-probability ``[B]`` of the step ``k`` transition ``x_t -> x_prev`` under the
        current weights (differentiable), evaluated in ``chunks`` (row counts) when given."""
        if chunks is not None and len(chunks) > 1:
            if sum(chunks) != x_t.shape[0]:
                raise ValueError(f"chunks {list(chunks)} do not add up to {x_t.shape[0]} rows")
            parts, start = [], 0
            for n in chunks:
                sl = slice(start, start + n)
                cond = labels[sl] if labels is not None else None
                parts.append(self.step_logprob(k, x_t[sl], x_prev[sl], cond))
                start += n
            return torch.cat(parts)
        coef = self.coefficients[k]
        eps = self.predict_noise(x_t, self.timesteps[k], labels)
        mean = step_mean(x_t, eps, coef, clip_sample=self.options.clip_sample)
        return gaussian_logprob(x_prev, mean, coef.std, reduction=self.options.logprob_reduction)

    @torch.no_grad()
    def sample(self, labels: Tensor | Sequence[int] | None, seed: int) -> DiffusionRollout:
        """Sample a batch of images, one per label, recording the trajectory and the
        log-probability of every step. The same labels and seed give the same rollout."""
        batch = len(labels) if labels is not None else 1
        cond = self.condition(labels, batch)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *self.shape), generator=gen, dtype=self.dtype)
        traj, lps = [x], []
        for k, t in enumerate(self.timesteps):
            coef = self.coefficients[k]
            eps = self.predict_noise(x, t, cond)
            mean = step_mean(x, eps, coef, clip_sample=self.options.clip_sample)
            x, _ = sample_step(mean, coef.std, gen)
            lps.append(
                gaussian_logprob(x, mean, coef.std, reduction=self.options.logprob_reduction)
            )
            traj.append(x)
        return DiffusionRollout(
            images=to_images(x),
            latents=torch.stack(traj, dim=1),
            logprobs=torch.stack(lps, dim=1),
            timesteps=torch.tensor(self.timesteps, dtype=torch.long),
            labels=cond if cond is not None else torch.zeros(batch, dtype=torch.long),
            seed=seed,
            weight_version=self.weight_version,
        )

    def step_indices(self, timesteps: Tensor | Sequence[int]) -> list[int]:
        """Indices into this policy's steps of the given timesteps ``[K]`` (or ``[B, K]`` with
        equal rows); an error if a timestep is not one of the policy's."""
        ts = torch.as_tensor(timesteps)
        if ts.ndim == 2:
            if not bool((ts == ts[:1]).all()):
                raise ValueError("every sample of a batch must share the same timesteps")
            ts = ts[0]
        index = {t: k for k, t in enumerate(self.timesteps)}
        missing = [int(t) for t in ts.tolist() if int(t) not in index]
        if missing:
            raise ValueError(
                f"timesteps {missing} are not steps of this policy ({self.timesteps}); "
                "it was sampled with other scheduler options"
            )
        return [index[int(t)] for t in ts.tolist()]

    def step_logprobs(
        self,
        latents: Tensor,
        next_latents: Tensor,
        timesteps: Tensor | Sequence[int],
        labels: Tensor | Sequence[int] | None = None,
        chunks: Sequence[int] | None = None,
    ) -> Tensor:
        """Recompute the log-probabilities ``[B, K]`` of stored steps under the current weights.

        ``latents`` are the states each step starts from, ``[B, K, C, H, W]``, ``next_latents``
        the states it reached, ``timesteps`` the steps' timesteps ``[K]``. Differentiable; wrap in
        ``torch.no_grad()`` when only the values are needed. Each step is evaluated with the
        batch shapes of :meth:`sample` (one batch, or the given ``chunks``), so unchanged weights
        give the sampled values bit for bit.
        """
        if latents.shape != next_latents.shape:
            raise ValueError(f"latents {tuple(latents.shape)} != {tuple(next_latents.shape)}")
        cond = self.condition(labels, latents.shape[0])
        out = [
            self.step_logprob(k, latents[:, j], next_latents[:, j], cond, chunks)
            for j, k in enumerate(self.step_indices(timesteps))
        ]
        return torch.stack(out, dim=1)


def check_unet(unet: Any, options: DiffusionOptions) -> None:
    """A loaded UNet must take the options' images and classes: a clear error naming the
    option otherwise."""
    cfg = unet.config
    size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
    classes = (cfg.num_class_embeds or 1) - 1
    problems = [
        f"{name} {mine} (the model's is {theirs})"
        for name, mine, theirs in (
            ("sample_size", options.sample_size, size),
            ("channels", options.channels, cfg.in_channels),
            ("num_classes", options.num_classes, classes),
        )
        if mine != theirs
    ]
    if problems:
        raise ValueError("the model cannot take these options: " + "; ".join(problems))


def from_pretrained(path: str, options: DiffusionOptions | None = None) -> DiffusionPolicy:
    """The policy over the UNet of the diffusion model folder ``path``
    (:mod:`miles_diffusion.model`); the options' image shape and classes must be the model's."""
    from miles_diffusion.model import load_unet

    opts = options or DiffusionOptions()
    return DiffusionPolicy(opts, unet=load_unet(path, opts.dtype))


def to_images(x: Tensor) -> Tensor:
    """Map latents in ``[-1, 1]`` to images in ``[0, 1]``."""
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def build_policy(options: DiffusionOptions | None) -> DiffusionPolicy:
    """Factory of the ``diffusion`` modality: the policy built from its options."""
    return DiffusionPolicy(options)
