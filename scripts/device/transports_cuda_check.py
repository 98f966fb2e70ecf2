"""GPU check of the weight transports (one CUDA GPU, about two minutes).

* colocated over CUDA IPC through SGLang's ``POST /update_weights_from_tensor``: the sender packs
  into CUDA buffers and sends each bucket as a ``flattened_bucket`` item whose tensor travels as
  its CUDA IPC handle (torch's reductions); an engine stand-in process (the embedded engine's
  engine side, ``miles_transport_common.engine_side``) whose model lives on the GPU verifies
  each bucket on the device and adopts views of them. Checked: version, the weights hash,
  log-probs on a fixed input within 1e-5 of the sender's, that the engine serves from the
  shared memory (its parameters are views into larger bucket storages), and that a corrupted
  bucket is rejected with the old weights and version kept. Then a 512 MiB bf16 model: update
  time against an in-process ``copy_``.
* p2p with NIXL on GPU memory (``device="cuda"``, zero copy from the sender's CUDA tensors into
  regions the receiver registered in VRAM): the same correctness checks, then 512 MiB against a
  raw NIXL write of the same regions.
* broadcast over NCCL is not run: NCCL refuses two ranks on one GPU; the transport's NCCL path
  is its gloo path with the backend chosen by the config.

    python3 scripts/device/transports_cuda_check.py           # prints one JSON line at the end

Run from the repository root with the transports' sources importable (see gpu_checks.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
for sub in ("common", "colocated", "p2p"):
    sys.path.insert(0, str(ROOT / "plugins" / "transports" / sub))

from miles_transport_common.checksum import weights_hash  # noqa: E402
from miles_transport_common.staging import module_target  # noqa: E402
from miles_transport_common.testing import (  # noqa: E402
    Worker,
    fixed_input,
    logprobs,
    named_stream,
    tiny_lm,
)

BIG_MB = 512


def big_model(seed: int, device: str) -> dict[str, torch.Tensor]:
    """A Llama-like bf16 model of at least BIG_MB MiB (hidden 2048, MLP 5632)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < BIG_MB << 20:
        for name, shape in [
            ("q_proj", (2048, 2048)),
            ("k_proj", (512, 2048)),
            ("v_proj", (512, 2048)),
            ("o_proj", (2048, 2048)),
            ("gate_proj", (5632, 2048)),
            ("up_proj", (5632, 2048)),
            ("down_proj", (2048, 5632)),
        ]:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            t.uniform_(-0.05, 0.05, generator=g)
            out[f"model.layers.{layer}.{name}.weight"] = t
            total += t.numel() * 2
        layer += 1
    return out


def as_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def engine_role(args: argparse.Namespace) -> None:
    """colocated: an engine stand-in serving SGLang's weight endpoints over a GPU model, with
    ``/check/report`` (hash, log-probs, whether it serves from the shared buckets)."""
    from miles_transport_common.testing import serve_engine_stand_in

    if args.big:
        model = as_module({k: torch.zeros_like(v) for k, v in big_model(0, "cuda").items()})
    else:
        model = tiny_lm(1).cuda()

    def report(body: dict[str, Any], _: Any) -> dict[str, Any]:
        torch.cuda.synchronize()
        if args.big:
            return {"success": True}
        params = list(model.parameters())
        views = sum(p.untyped_storage().nbytes() > p.numel() * p.element_size() for p in params)
        return {
            "success": True,
            "hash": weights_hash([(k, v.cpu()) for k, v in named_stream(model)]),
            "logprobs": logprobs(model, fixed_input()).tolist(),
            "adopted": views / len(params),
        }

    serve_engine_stand_in(model, routes={"/check/report": report})


def receiver_role(args: argparse.Namespace) -> None:
    """p2p: the NIXL receiver of a GPU model that takes part in ``args.updates`` updates."""
    if args.transport == "colocated":
        engine_role(args)
        return
    from miles_transport_p2p.config import P2POptions
    from miles_transport_p2p.receiver import P2PReceiver

    receiver = P2PReceiver(P2POptions.model_validate_json(args.options), (args.host, args.port))
    if args.big:
        model = as_module({k: torch.zeros_like(v) for k, v in big_model(0, "cuda").items()})
    else:
        model = tiny_lm(1).cuda()
    target = module_target(model)
    print(json.dumps({"ready": True}), flush=True)
    for _ in range(args.updates):
        ok, error = True, None
        try:
            receiver.receive(target)
        except Exception as exc:  # reported, and the loop goes on: the old weights must stay
            ok, error = False, repr(exc)
        torch.cuda.synchronize()
        out: dict[str, Any] = {"ok": ok, "version": receiver.version, "error": error}
        if not args.big:
            named = [(k, v.cpu()) for k, v in named_stream(model)]
            out["hash"] = weights_hash(named)
            out["logprobs"] = logprobs(model, fixed_input().cuda()).cpu().tolist()
            out["adopted"] = None
        print(json.dumps(out), flush=True)
    end = time.monotonic() + 600
    while time.monotonic() < end and args.transport == "p2p":  # keep regions for the raw limit
        receiver.idle()
        time.sleep(0.0005)
    receiver.close()


def start(name: str, options: Any, sender: Any, updates: int, big: bool) -> Worker:
    host, port = sender.address if name == "p2p" else ("", 0)
    extra = ["--big"] if big else []
    return Worker(
        __file__,
        "--role",
        "receiver",
        "--transport",
        name,
        "--options",
        options.model_dump_json(),
        "--host",
        host,
        "--port",
        str(port),
        "--updates",
        str(updates),
        *extra,
    )


def correctness(name: str) -> dict[str, Any]:
    """Three updates of a tiny GPU model, the second one corrupted."""
    from miles_transport_common.bucketing import Manifest

    if name == "colocated":
        from miles_transport_colocated.config import ColocatedOptions
        from miles_transport_colocated.sender import ColocatedSender

        options: Any = ColocatedOptions(device="cuda", bucket_size_mb=0.5, timeout_s=60)
        sender: Any = ColocatedSender(options)
    else:
        from miles_transport_p2p.config import P2POptions
        from miles_transport_p2p.sender import P2PSender

        options = P2POptions(device="cuda", bucket_size_mb=0.5, timeout_s=60)
        sender = P2PSender(options, num_receivers=1)
    worker = start(name, options, sender, 3, big=False)
    out: dict[str, Any] = {}
    try:
        url = str(worker.report(120).get("url", ""))
        send, report = _driver(name, sender, worker, url)
        m1 = tiny_lm(0).cuda()
        send(named_stream(m1), 1)
        r = report()
        want_lp = logprobs(m1, fixed_input().cuda()).cpu()
        want_hash = weights_hash([(k, v.cpu()) for k, v in named_stream(m1)])
        out["update_ok"] = bool(r["ok"]) and r["version"] == 1 and r["hash"] == want_hash
        out["max_abs_logprob_diff"] = float((torch.tensor(r["logprobs"]) - want_lp).abs().max())
        out["receiver_serves_from_shared_memory"] = r.get("adopted")

        def flip(manifest: Manifest, data: torch.Tensor) -> None:
            if manifest.seq == 1:
                data[7] ^= 0x21

        sender.fault_hook = flip
        try:
            send(named_stream(tiny_lm(2).cuda()), 2)
            out["corrupted_rejected"] = False
        except Exception:
            out["corrupted_rejected"] = True
        r = report()
        out["old_weights_kept"] = (not r["ok"]) and r["version"] == 1 and r["hash"] == want_hash
        sender.fault_hook = None
        m3 = tiny_lm(3).cuda()
        send(named_stream(m3), 3)
        r = report()
        out["second_update_ok"] = bool(r["ok"]) and r["hash"] == weights_hash(
            [(k, v.cpu()) for k, v in named_stream(m3)]
        )
    finally:
        sender.close()
        worker.stop()
    out["passed"] = bool(
        out.get("update_ok")
        and out.get("max_abs_logprob_diff", 1) <= 1e-5
        and out.get("corrupted_rejected")
        and out.get("old_weights_kept")
        and out.get("second_update_ok")
        and (name == "p2p" or out.get("receiver_serves_from_shared_memory", 0) > 0.5)
    )
    return out


def _driver(name: str, sender: Any, worker: Worker, url: str) -> tuple[Any, Any]:
    """(send(weights, version), report()) for either transport: colocated publishes to the
    engine's URL and asks it for its report; p2p reads the receiver's line after each update."""
    from miles_transport_common.http import call

    if name == "p2p":
        return (lambda w, v: sender.send(w, version=v)), (lambda: worker.report(120))

    state = {"ok": True}

    def send(weights: Any, version: int) -> None:
        state["ok"] = False
        sender.send(weights, version=version, engines=[url])
        state["ok"] = True

    def report() -> dict[str, Any]:
        r = call(url, "/check/report", {}, timeout_s=120)
        v = call(url, "/get_weight_version", None, timeout_s=60, method="GET")["weight_version"]
        return {**r, "ok": state["ok"], "version": int(v)}

    return send, report


def throughput(name: str) -> dict[str, Any]:
    """512 MiB over the transport (best of 3 after 2 warm-ups) against its raw limit."""
    model = big_model(0, "cuda")
    total = sum(t.numel() * 2 for t in model.values())
    if name == "colocated":
        from miles_transport_colocated.config import ColocatedOptions
        from miles_transport_colocated.sender import ColocatedSender

        options: Any = ColocatedOptions(device="cuda", bucket_size_mb=64, timeout_s=120)
        sender: Any = ColocatedSender(options)
    else:
        from miles_transport_p2p.config import P2POptions
        from miles_transport_p2p.sender import P2PSender

        options = P2POptions(device="cuda", bucket_size_mb=64, timeout_s=120)
        sender = P2PSender(options, num_receivers=1)
    worker = start(name, options, sender, 5, big=True)
    try:
        url = str(worker.report(120).get("url", ""))
        best = float("inf")
        for v in range(1, 6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "p2p":
                sender.send(model.items(), version=v)
            else:
                sender.send(model.items(), version=v, engines=[url])
            dt = time.perf_counter() - t0
            if name == "p2p":
                r = worker.report(120)
                assert r["ok"], r
            if v > 2:
                best = min(best, dt)
        if name == "colocated":
            dst = {k: torch.empty_like(t) for k, t in model.items()}
            lim = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for k, t in model.items():
                    dst[k].copy_(t)
                torch.cuda.synchronize()
                lim = min(lim, time.perf_counter() - t0)
            limit_gbps = total / lim / 1e9
        else:
            from miles_transport_p2p.agent import mem_type, region

            regions = [r for key, r in sorted(sender.regions[0].items()) if key[0] == 0]
            buf = torch.empty(max(n for _, n, _ in regions), dtype=torch.uint8, device="cuda")
            reg = sender.agent.register_memory(buf)
            lim = float("inf")
            moved = sum(n for _, n, _ in regions)
            for _ in range(3):
                t0 = time.perf_counter()
                for addr, n, dev in regions:
                    local = sender.agent.get_xfer_descs([region(buf, n)], mem_type(buf))
                    remote = sender.agent.get_xfer_descs([(addr, n, dev)], sender.remote_mem[0])
                    h = sender.agent.initialize_xfer(
                        "WRITE", local, remote, sender.remotes[0], b"raw"
                    )
                    state = sender.agent.transfer(h)
                    while state == "PROC":
                        state = sender.agent.check_xfer_state(h)
                    assert state == "DONE", state
                    sender.agent.release_xfer_handle(h)
                lim = min(lim, time.perf_counter() - t0)
            sender.agent.deregister_memory(reg)
            limit_gbps = moved / lim / 1e9
    finally:
        sender.close()
        worker.stop()
    gbps = total / best / 1e9
    return {
        "gbps": round(gbps, 2),
        "limit_gbps": round(limit_gbps, 2),
        "ratio": round(gbps / limit_gbps, 3),
        "mib": round(total / (1 << 20)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--role", default="check")
    ap.add_argument("--transport")
    ap.add_argument("--options")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--transports", default="colocated,p2p", help="which to check, comma-separated")
    args = ap.parse_args()
    if args.role == "receiver":
        receiver_role(args)
        return
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    names = [n for n in args.transports.split(",") if n]
    for name in names:
        for what, fn in (("", correctness), ("_throughput", throughput)):
            t0 = time.perf_counter()
            try:
                result[name + what] = fn(name)
            except Exception as exc:
                traceback.print_exc()
                result[name + what] = {"passed": False, "error": repr(exc)[:400]}
            print(
                f"{name}{what}: {result[name + what]} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    result["passed"] = all(result[n].get("passed") for n in names)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
