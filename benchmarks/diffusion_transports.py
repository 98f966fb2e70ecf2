"""Weight-sync of a diffusion UNet into a diffusion engine: each transport against the plain
update of the same engine.

Launches one diffusion engine server (``miles_diffusion.server``, through the registered
``diffusion`` engine's launcher, one torch thread) on a random UNet of the pretrain size
(``block_out_channels (32, 64)``, 16x16, 10 classes: about 636 k parameters, 2.4 MiB fp32), and
times a full update of its weights (``policy.export_weights()``, what a trainer publishes) with
each transport built from its registry record as a run builds it, from the start of ``send``
until it returns (every engine committed the update). The baseline, measured in the same run
against the same engine, is SGLang's plain path: one ``POST /update_weights_from_tensor`` with
the pickled list of tensors (no buckets, no checksum, loaded at once). ``<transport>_ratio`` is
baseline time / transport time (above 1: the transport is faster than the plain update). A
model this small is dominated by per-update fixed costs (HTTP round trips, the group's
rendezvous, the NIXL handshake), which is what this measures; ``roundtrip_ms`` is the time of an
HTTP call that changes nothing (``/update_weight_version``) on the same engine.

Two warm-up updates come first (unmeasured: the first updates allocate the staging memory kept
from then on and form the groups), then the best of ``--repeats``. After the updates, the
engine's samples are checked bitwise against the sender's policy. The last line is JSON.

    .venv/bin/python benchmarks/diffusion_transports.py                 # all three
    .venv/bin/python benchmarks/diffusion_transports.py --repeats 20 --transports colocated
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import describe

WARMUP = 2


def best_of(fn: Any, repeats: int) -> float:
    """Seconds of the fastest of ``WARMUP + repeats`` calls (the warm-up ones not counted)."""
    best = float("inf")
    for i in range(WARMUP + repeats):
        t0 = time.perf_counter()
        fn(i)
        if i >= WARMUP:
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=10, help="updates per measurement; best kept")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size in MiB (default 1)")
    ap.add_argument(
        "--transports", default="colocated,broadcast,p2p", help="comma-separated subset to run"
    )
    args = ap.parse_args()
    from miles_diffusion.client import DiffusionEngineClient
    from miles_diffusion.policy import DiffusionPolicy
    from miles_diffusion.testing import tiny_options, write_tiny_model

    from miles_core import Kind
    from miles_core.plugins import load_plugins

    torch.set_num_threads(1)
    describe({k: v for k, v in vars(args).items()})
    options = tiny_options(
        block_out_channels=(32, 64), norm_num_groups=8, sample_size=16, num_classes=10
    )
    trainer = DiffusionPolicy(options.model_copy(update={"init_seed": 7}))
    named = [(n, t.clone()) for n, t in trainer.export_weights()]
    total = sum(t.numel() * t.element_size() for _, t in named)
    params = sum(t.numel() for _, t in named)
    print(
        f"model: UNet {options.block_out_channels}, {params / 1e3:.0f} k parameters, "
        f"{len(named)} tensors, {total / (1 << 20):.2f} MiB fp32; buckets of "
        f"{args.bucket_mb:g} MiB; best of {args.repeats}",
        flush=True,
    )
    registry = load_plugins().registry
    engine = registry.get(Kind.ROLLOUT_ENGINE, "diffusion")
    launcher = engine.build(engine.config(startup_timeout_s=300, num_threads=1))
    result: dict[str, Any] = {"parameters": params, "mib": round(total / (1 << 20), 3)}
    with tempfile.TemporaryDirectory() as tmp:
        url = launcher.launch(str(write_tiny_model(Path(tmp) / "model", options)), index=0)

        def call(fn: Any) -> Any:
            async def go() -> Any:
                async with DiffusionEngineClient(url, timeout_s=300) as c:
                    return await fn(c)

            return asyncio.run(go())

        try:
            blob = base64.b64encode(pickle.dumps(named)).decode()
            plain = best_of(
                lambda i: call(
                    lambda c: c.update_weights_from_tensor([blob], weight_version=f"plain{i}")
                ),
                args.repeats,
            )
            roundtrip = best_of(
                lambda i: call(lambda c: c.update_weight_version(f"rt{i}")), args.repeats
            )
            print(
                f"    plain: {plain * 1e3:.1f} ms per update (one pickled "
                f"/update_weights_from_tensor); HTTP round trip {roundtrip * 1e3:.1f} ms",
                flush=True,
            )
            result["plain_ms"] = round(plain * 1e3, 2)
            result["roundtrip_ms"] = round(roundtrip * 1e3, 2)
            versions = itertools.count(1)
            for name in args.transports.split(","):
                record = registry.get(Kind.TRANSPORT, name)
                sender = record.build(record.config(bucket_size_mb=args.bucket_mb, timeout_s=300))
                try:
                    took = best_of(
                        lambda _i, s=sender: s.send(named, version=next(versions), engines=[url]),
                        args.repeats,
                    )
                finally:
                    sender.close()
                got = call(lambda c: c.generate([3], {"n": 2, "seed": 1, "num_inference_steps": 4}))
                want = trainer.sample([3, 3], 1)
                exact = torch.equal(got.latents, want.latents) and torch.equal(
                    got.step_logprobs, want.logprobs
                )
                if not exact:
                    raise SystemExit(f"{name}: the engine does not sample as the sender's policy")
                ratio = plain / took
                print(
                    f"{name:>9}: {took * 1e3:.1f} ms per update, "
                    f"{total / took / 1e9:.3f} GB/s, ratio {ratio:.2f} (engine samples bitwise)",
                    flush=True,
                )
                result[f"{name}_ratio"] = round(ratio, 3)
                result[f"{name}_ms"] = round(took * 1e3, 2)
        finally:
            launcher.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
