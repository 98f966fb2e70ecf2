"""Pretraining on the handwritten digits: a class-conditional UNet and a digit classifier.

:func:`pretrain_digits` (the command ``miles-diffusion pretrain-digits``) writes a diffusion
model folder (:mod:`miles_diffusion.model`):

* ``unet/``: a ``UNet2DModel`` trained with the DDPM epsilon-prediction loss on the training
  split, class-conditioned with ``num_class_embeds = 11`` (class 10 is the unconditional id; a
  label is dropped to it with probability ``label_dropout`` so that classifier-free guidance
  works);
* ``classifier/``: a :class:`~miles_diffusion.classifier.DigitClassifier` trained on the same
  split, the model of the ``digit_classifier`` reward;
* ``miles_diffusion.json`` and ``pretrain.json``: the figures of the run (final loss, the
  classifier's held-out accuracy, and the mean reward of images sampled from the UNet by
  :class:`~miles_diffusion.policy.DiffusionPolicy`, the starting point of RL).

Everything is drawn from generators seeded by ``seed``: the same settings give the same weights
(with the same number of threads).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from miles_diffusion.classifier import DigitClassifier, accuracy, save_classifier
from miles_diffusion.digits import NUM_CLASSES, SIZE, Digits, split_digits
from miles_diffusion.model import ModelInfo, write_model_info
from miles_diffusion.options import DiffusionOptions

NUM_TRAIN_TIMESTEPS = 1000
BETA_SCHEDULE = "linear"


@dataclass
class PretrainSettings:
    """The budget and hyperparameters of :func:`pretrain_digits` (the command's flags)."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0
    block_out_channels: tuple[int, ...] = (32, 64)
    label_dropout: float = 0.1
    classifier_steps: int = 1500
    classifier_lr: float = 1e-3
    threads: int = 1
    log_every: int = 250
    #: images sampled per digit to measure the pretrained model's reward
    eval_per_digit: int = 32
    eval_seed: int = 0
    #: the sampler the reward is measured with (the RL run's defaults)
    eval_steps: int = 10
    eval_eta: float = 1.0
    split_seed: int = 0


def diffusion_options(settings: PretrainSettings, **overrides: Any) -> DiffusionOptions:
    """The ``diffusion`` modality's options for a UNet pretrained with ``settings``."""
    base: dict[str, Any] = {
        "sample_size": SIZE,
        "channels": 1,
        "num_classes": NUM_CLASSES,
        "block_out_channels": tuple(settings.block_out_channels),
        "num_train_timesteps": NUM_TRAIN_TIMESTEPS,
        "beta_schedule": BETA_SCHEDULE,
        "num_inference_steps": settings.eval_steps,
        "eta": settings.eval_eta,
        "init_seed": settings.seed,
    }
    base.update(overrides)
    return DiffusionOptions.model_validate(base)


def train_unet(
    train: Digits, settings: PretrainSettings, log: Callable[[str], None] = print
) -> tuple[Any, float]:
    """A class-conditional UNet trained with the DDPM loss; returns it (eval mode) and the
    final loss (mean over the last ``log_every`` steps)."""
    import diffusers

    from miles_diffusion.policy import DiffusionPolicy

    scheduler_cls: Any = diffusers.DDPMScheduler  # resolved lazily: untyped to checkers
    scheduler = scheduler_cls(num_train_timesteps=NUM_TRAIN_TIMESTEPS, beta_schedule=BETA_SCHEDULE)
    alphas = scheduler.alphas_cumprod.to(torch.float32)
    unet = DiffusionPolicy(diffusion_options(settings)).unet.train()
    opt = torch.optim.AdamW(unet.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    window: list[float] = []
    last = float("nan")
    start = time.perf_counter()
    for step in range(1, settings.steps + 1):
        idx = torch.randint(len(train), (settings.batch_size,), generator=gen)
        x0, labels = train.images[idx], train.labels[idx].clone()
        drop = torch.rand(settings.batch_size, generator=gen) < settings.label_dropout
        labels[drop] = NUM_CLASSES  # the unconditional class id
        t = torch.randint(NUM_TRAIN_TIMESTEPS, (settings.batch_size,), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        a = alphas[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(unet(xt, t, class_labels=labels).sample, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window.append(loss.item())
        if step % settings.log_every == 0 or step == settings.steps:
            last = sum(window) / len(window)
            rate = step / (time.perf_counter() - start)
            log(f"unet step {step}/{settings.steps} loss {last:.4f} {rate:.1f} steps/s")
            window = []
    return unet.eval(), last


def train_classifier(
    train: Digits,
    held_out: Digits,
    settings: PretrainSettings,
    log: Callable[[str], None] = print,
) -> tuple[DigitClassifier, float]:
    """A digit classifier trained on ``train`` with Adam; returns it (eval mode) and its
    accuracy on ``held_out``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = DigitClassifier(sample_size=SIZE, channels=1, num_classes=NUM_CLASSES)
    opt = torch.optim.Adam(model.parameters(), lr=settings.classifier_lr)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    model.train()
    for step in range(1, settings.classifier_steps + 1):
        idx = torch.randint(len(train), (settings.batch_size,), generator=gen)
        loss = F.cross_entropy(model(train.images[idx]), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % settings.log_every == 0 or step == settings.classifier_steps:
            log(f"classifier step {step}/{settings.classifier_steps} loss {loss.item():.4f}")
    model.eval()
    acc = accuracy(model, held_out.images, held_out.labels)
    log(f"classifier held-out accuracy {acc:.4f} ({len(held_out)} images)")
    return model, acc


def class_probabilities(classifier: DigitClassifier, images: Tensor) -> Tensor:
    """Softmax over the classes ``[B, num_classes]`` of images ``[B, C, H, W]`` in ``[0, 1]``
    (the policy's image range), mapped back to the classifier's ``[-1, 1]``."""
    with torch.no_grad():
        logits = classifier(images.to(torch.float32) * 2.0 - 1.0)
    return torch.softmax(logits, dim=1)


def sampled_reward(
    unet: Any, classifier: DigitClassifier, settings: PretrainSettings
) -> dict[str, Any]:
    """The mean ``digit_classifier`` reward (probability of the prompted digit) of
    ``eval_per_digit`` images per digit sampled from ``unet``, overall and per digit."""
    from miles_diffusion.policy import DiffusionPolicy

    options = diffusion_options(settings)
    policy = DiffusionPolicy(options, unet=unet)
    labels = torch.arange(NUM_CLASSES).repeat_interleave(settings.eval_per_digit)
    rollout = policy.sample(labels, seed=settings.eval_seed)
    probs = class_probabilities(classifier, rollout.images)
    reward = probs.gather(1, labels[:, None])[:, 0]
    per_digit = reward.view(NUM_CLASSES, settings.eval_per_digit).mean(dim=1)
    correct = (probs.argmax(dim=1) == labels).float().mean()
    return {
        "mean": round(float(reward.mean()), 4),
        "per_digit": [round(float(r), 4) for r in per_digit],
        "accuracy": round(float(correct), 4),
        "images": int(labels.numel()),
        "seed": settings.eval_seed,
        "num_inference_steps": options.num_inference_steps,
        "eta": options.eta,
        "guidance_scale": options.guidance_scale,
    }


def pretrain_digits(
    out: str | Path,
    settings: PretrainSettings | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the UNet and the classifier and write the model folder ``out``; returns the
    contents of its ``pretrain.json``."""
    s = settings or PretrainSettings()
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        start = time.perf_counter()
        train, held_out = split_digits(s.split_seed)
        unet, final_loss = train_unet(train, s, log)
        unet_seconds = time.perf_counter() - start
        classifier, acc = train_classifier(train, held_out, s, log)
        reward = sampled_reward(unet, classifier, s)
        log(
            f"reward of sampled images (K={reward['num_inference_steps']}, eta={reward['eta']}): "
            f"mean {reward['mean']:.4f}, per digit {reward['per_digit']}"
        )
        unet.save_pretrained(str(folder / "unet"))
        write_model_info(
            folder,
            ModelInfo(
                sample_size=SIZE,
                channels=1,
                num_classes=NUM_CLASSES,
                num_train_timesteps=NUM_TRAIN_TIMESTEPS,
                beta_schedule=BETA_SCHEDULE,
            ),
        )
        save_classifier(classifier, folder / "classifier", held_out_accuracy=round(acc, 4))
        settings_json = asdict(s)
        settings_json["block_out_channels"] = list(s.block_out_channels)
        summary = {
            "steps": s.steps,
            "final_loss": round(final_loss, 5),
            "classifier_steps": s.classifier_steps,
            "classifier_held_out_accuracy": round(acc, 4),
            "reward": reward,
            "unet_seconds": round(unet_seconds, 1),
            "seconds": round(time.perf_counter() - start, 1),
            "train_images": len(train),
            "held_out_images": len(held_out),
            "settings": settings_json,
        }
        (folder / "pretrain.json").write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)
    log(f"wrote {folder}")
    return summary
