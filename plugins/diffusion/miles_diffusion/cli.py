"""The ``miles-diffusion`` command.

``miles-diffusion pretrain-digits --out DIR`` pretrains a class-conditional UNet and a digit
classifier on the handwritten digits and writes the model folder ``DIR`` (see
:mod:`miles_diffusion.pretrain`). ``miles-diffusion grid MODEL --out PNG`` draws a row of
samples per class of a model folder (a pretrained one, or a run's checkpoint), each row from
the same noise, so the grids of two folders compare image by image.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from miles_diffusion.pretrain import PretrainSettings


def _parser() -> argparse.ArgumentParser:
    d = PretrainSettings()
    parser = argparse.ArgumentParser(
        prog="miles-diffusion", description="Tools of the Miles diffusion plugin."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "pretrain-digits",
        help="pretrain a class-conditional UNet and a digit classifier on the 8x8 digits",
        description="Train a class-conditional UNet2DModel (DDPM loss, linear schedule, 1000 "
        "timesteps) and a digit classifier on the handwritten digits, and write a diffusion "
        "model folder: unet/, classifier/, miles_diffusion.json, pretrain.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--steps", type=int, default=d.steps, help="UNet training steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate of the UNet")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--block-out-channels",
        type=int,
        nargs="+",
        default=list(d.block_out_channels),
        help="UNet channels per level (each divisible by 8)",
    )
    p.add_argument(
        "--classifier-steps", type=int, default=d.classifier_steps, help="classifier steps"
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument(
        "--log-every", type=int, default=d.log_every, help="steps between progress lines"
    )
    p.add_argument(
        "--eval-per-digit",
        type=int,
        default=d.eval_per_digit,
        help="images sampled per digit to measure the reward",
    )
    g = sub.add_parser(
        "grid",
        help="a PNG of samples, a row per class, of a diffusion model folder",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g.add_argument("model", help="a model folder, or a run's checkpoints/step_<N>/trainer")
    g.add_argument("--out", required=True, help="the PNG file to write")
    g.add_argument("--per-class", type=int, default=8, help="images per row")
    g.add_argument("--seed", type=int, default=0, help="seed of the noise of every row")
    g.add_argument("--steps", type=int, default=10, help="denoising steps")
    g.add_argument("--eta", type=float, default=1.0, help="DDIM stochasticity (0 < eta <= 1)")
    return parser


def _grid(args: argparse.Namespace) -> int:
    from pathlib import Path

    from miles_diffusion.grids import model_grid
    from miles_diffusion.model import NotADiffusionModel

    try:
        out = model_grid(
            args.model,
            Path(args.out),
            per_class=args.per_class,
            seed=args.seed,
            num_inference_steps=args.steps,
            eta=args.eta,
        )
    except (NotADiffusionModel, ValueError) as exc:
        print(f"miles-diffusion grid: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``miles-diffusion``; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "grid":
        return _grid(args)
    if args.command == "pretrain-digits":
        from miles_diffusion.options import DiffusionOptions
        from miles_diffusion.pretrain import pretrain_digits

        problems = [
            f"--{name} must be at least 1"
            for name, value in (
                ("steps", args.steps),
                ("batch-size", args.batch_size),
                ("classifier-steps", args.classifier_steps),
                ("threads", args.threads),
                ("log-every", args.log_every),
                ("eval-per-digit", args.eval_per_digit),
            )
            if value < 1
        ]
        try:
            DiffusionOptions(
                sample_size=8, channels=1, block_out_channels=tuple(args.block_out_channels)
            )
        except ValueError as exc:
            problems.append(f"--block-out-channels {args.block_out_channels}: {exc}")
        if problems:
            print("miles-diffusion: error: " + "; ".join(problems), file=sys.stderr)
            return 2
        settings = PretrainSettings(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            block_out_channels=tuple(args.block_out_channels),
            classifier_steps=args.classifier_steps,
            threads=args.threads,
            log_every=args.log_every,
            eval_per_digit=args.eval_per_digit,
        )
        summary = pretrain_digits(
            args.out, settings, log=lambda m: print(f"pretrain-digits: {m}", flush=True)
        )
        print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
