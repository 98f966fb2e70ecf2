"""Weight-sync transports: throughput of a full update against the raw limit of the same link.

Moves a model of ``--size-mb`` (default 512 MiB; random bf16 tensors of transformer shapes)
from this process to an engine process with each transport, timed from the start of the update
until the engine has committed the new weights into its model (``send`` returns only after every
engine committed), and measures in the same run the limit it is compared with. Colocated and
broadcast go through SGLang's weight-update endpoints (``/update_weights_from_tensor``;
``/init_weights_update_group`` + ``/update_weights_from_distributed``) of an engine stand-in
that runs the embedded engine's engine side (:mod:`miles_transport_common.engine_side`) over the
model; p2p runs its sender and NIXL receiver directly (what ``/miles/p2p_weights`` runs inside
the embedded engine). Limits:

* colocated vs an in-process ``tensor.copy_`` of the same bytes;
* broadcast vs a raw gloo broadcast of the same bytes (same group, same bucket-sized chunks);
* p2p vs a raw NIXL write of the same bytes (same agents, same bucket-sized chunks).

Two warm-up updates come first (unmeasured): the first updates allocate the staging memory
both sides keep from then on (two sets of it when the receiver adopts the weights it gets), and
an RL run does hundreds of updates. Then the best of ``--repeats`` runs is kept on both sides.
The last line is JSON with ``<transport>_ratio`` (transport GB/s / limit GB/s) and the GB/s
behind each ratio.

For colocated it also measures the sender's packing alone (``colocated_pack_only_ratio``): the
copy into the bucket buffers with the checksum computed chunk by chunk, nobody receiving. An
update does that and, on the receiver, a verifying pass over the same bytes, so this ratio is
an upper bound of ``colocated_ratio`` on the machine that runs the benchmark.

Every update is checked on arrival: each tensor's checksum travels in its bucket's manifest
and, after the commit, the engine checks that it serves exactly those tensors
(``miles_transport_common.served``). The arrival checksum is the bucket checksum computed per
piece, no extra pass; the check of the served weights is the only added work and runs inside
the commit, so its seconds (``served_s``, measured by the engine on the last update) are the
difference between the sync with the check and without it. ``<transport>_served_check_share``
is that time over the sync's (goal: at most 0.05); colocated and p2p report it (broadcast's
engine side keeps no timings).

    .venv/bin/python benchmarks/transports.py --size-mb 32      # a quick run
    .venv/bin/python benchmarks/transports.py                   # the full 512 MiB run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _machine import describe

DTYPE = torch.bfloat16
WARMUP = 2  # unmeasured updates that allocate the staging memory kept from then on


def model_shapes(size_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-like model of at least ``size_mb`` MiB in bf16
    (hidden 1024, MLP 2816, vocabulary 32000), cut down to a few layers for small sizes."""
    hidden, inter, vocab = 1024, 2816, 32000
    target = size_mb * (1 << 20)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    total = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal total
        shapes.append((name, shape))
        total += 2 * int(torch.Size(shape).numel())

    if target >= 4 * 2 * vocab * hidden:
        add("model.embed_tokens.weight", (vocab, hidden))
    layer = 0
    while total < target:
        p = f"model.layers.{layer}."
        for name, shape in [
            ("input_layernorm.weight", (hidden,)),
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (hidden // 4, hidden)),
            ("self_attn.v_proj.weight", (hidden // 4, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("post_attention_layernorm.weight", (hidden,)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
        ]:
            add(p + name, shape)
        layer += 1
    return shapes


def make_model(size_mb: float, *, random: bool) -> dict[str, torch.Tensor]:
    """The model's tensors: random (sender) or zeros (receiver)."""
    out = {}
    for name, shape in model_shapes(size_mb):
        t = torch.empty(shape, dtype=DTYPE)
        if random:
            t.uniform_(-0.05, 0.05)
        else:
            t.zero_()
        out[name] = t
    return out


def as_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The receiver's model: the tensors as the parameters of a module tree with their names
    (what an engine holds), loaded through :func:`module_target` like the engine loads."""
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


def nbytes(model: dict[str, torch.Tensor]) -> int:
    """Total bytes of the model."""
    return sum(t.numel() * t.element_size() for t in model.values())


# --- receiver process ------------------------------------------------------------------------


def run_receiver(args: argparse.Namespace) -> None:
    """The receiver process. colocated / broadcast: an engine stand-in serving SGLang's weight
    endpoints over the model (plus ``/bench/raw_broadcast`` for the gloo baseline); p2p: a NIXL
    receiver taking part in ``--updates`` updates, then staying alive for the raw baseline."""
    from miles_transport_common.staging import module_target

    torch.set_num_threads(1)
    model = make_model(args.size_mb, random=False)
    module = as_module(model)
    if args.transport in ("colocated", "broadcast"):
        from miles_transport_common.testing import serve_engine_stand_in

        def raw_broadcast(body: dict[str, Any], distributed: Any) -> dict[str, Any]:
            from miles_transport_broadcast.group import bcast

            (pg,) = distributed.groups.values()
            buf = torch.empty(max(body["sizes"]), dtype=torch.uint8)
            for _ in range(int(body["repeats"])):
                for n in body["sizes"]:
                    bcast(pg, buf[:n]).wait()
            return {"success": True}

        serve_engine_stand_in(module, routes={"/bench/raw_broadcast": raw_broadcast})
        return
    from miles_transport_p2p.config import P2POptions
    from miles_transport_p2p.receiver import P2PReceiver

    target = module_target(module)
    receiver = P2PReceiver(P2POptions.model_validate_json(args.options), (args.host, args.port))
    print(json.dumps({"ready": True}), flush=True)
    for _ in range(args.updates):
        t0 = time.perf_counter()
        version = receiver.receive(target)
        total = time.perf_counter() - t0
        print(
            json.dumps({"version": version, "receive_s": total, **receiver.last_timings}),
            flush=True,
        )
    print(json.dumps({"done": True}), flush=True)
    # stay alive (registered memory and all) while the sender measures its raw limit; the
    # sender kills this process when it is done. The NIXL agent has no progress thread, so the
    # receiver keeps progressing its UCX worker, as it does while waiting in an update.
    end = time.monotonic() + 3600
    while time.monotonic() < end:
        receiver.idle()
        time.sleep(0.0005)


def chunk_sizes(total: int, chunk: int) -> list[int]:
    """``total`` bytes cut in chunks of at most ``chunk``."""
    return [min(chunk, total - i) for i in range(0, total, chunk)]


# --- sender side -----------------------------------------------------------------------------


def copy_limit(model: dict[str, torch.Tensor], repeats: int) -> float:
    """GB/s of an in-process ``copy_`` of every tensor into a preallocated twin."""
    dst = {n: torch.empty_like(t) for n, t in model.items()}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, t in model.items():
            dst[n].copy_(t)
        best = min(best, time.perf_counter() - t0)
    return nbytes(model) / best / 1e9


def pack_only(model: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> float:
    """GB/s of the colocated sender's own work with nobody receiving: packing every tensor into
    bucket buffers with the checksum computed chunk by chunk (what ``ColocatedSender`` does
    before any receiver reads a byte). An update cannot be faster than this."""
    from miles_transport_common.bucketing import BucketPacker

    packer = BucketPacker(bucket_bytes, num_buffers=None, hash_inline=True, split=False)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass allocates the buffers
        t0 = time.perf_counter()
        for _bucket in packer.pack(model.items()):
            pass
        best = min(best, time.perf_counter() - t0)
    return nbytes(model) / best / 1e9


def gloo_limit(sender: Any, url: str, total: int, repeats: int) -> float:
    """GB/s of raw broadcasts of ``total`` bytes in bucket-sized chunks over the same group
    (the engine takes part through the stand-in's ``/bench/raw_broadcast``)."""
    import threading

    from miles_transport_broadcast.group import bcast
    from miles_transport_common.http import call

    sizes = chunk_sizes(total, sender.options.bucket_bytes)
    buf = torch.empty(sender.options.bucket_bytes, dtype=torch.uint8).fill_(7)
    peer = threading.Thread(
        target=call,
        args=(url, "/bench/raw_broadcast", {"sizes": sizes, "repeats": repeats}),
        kwargs={"timeout_s": 600},
    )
    peer.start()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n in sizes:
            bcast(sender._pg, buf[:n]).wait()
        best = min(best, time.perf_counter() - t0)
    peer.join()
    return total / best / 1e9


def nixl_limit(sender: Any, total: int, repeats: int) -> float:
    """GB/s of raw NIXL writes between the same agents: one registered buffer written into each
    of the receiver's registered regions of one staging set in turn (the same sizes the update
    wrote; no packing, checksum, control message or load)."""
    from miles_transport_p2p.agent import mem_type, region

    regions = [r for key, r in sorted(sender.regions[0].items()) if key[0] == 0]
    moved = sum(length for _, length, _ in regions)
    agent = sender.agent
    buf = torch.empty(max(length for _, length, _ in regions), dtype=torch.uint8).fill_(7)
    reg = agent.register_memory(buf)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for addr, n, dev in regions:
            local = agent.get_xfer_descs([region(buf, n)], mem_type(buf))
            remote = agent.get_xfer_descs([(addr, n, dev)], sender.remote_mem[0])
            h = agent.initialize_xfer("WRITE", local, remote, sender.remotes[0], b"raw")
            state = agent.transfer(h)
            deadline = time.monotonic() + 120
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(h)
            assert state == "DONE", state
            agent.release_xfer_handle(h)
        best = min(best, time.perf_counter() - t0)
    agent.deregister_memory(reg)
    return moved / best / 1e9


def run_transport(
    name: str, model: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, float]:
    """One transport: ``--repeats`` full updates, then its limit; returns GB/s of both."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/transports/common"))
    from miles_transport_common.testing import Worker

    common = {"bucket_size_mb": args.bucket_mb, "timeout_s": 300, "staging": args.staging}
    if name == "broadcast":
        from miles_transport_broadcast.config import BroadcastOptions
        from miles_transport_broadcast.sender import BroadcastSender

        options: Any = BroadcastOptions(**common)
        sender: Any = BroadcastSender(options)
    elif name == "colocated":
        from miles_transport_colocated.config import ColocatedOptions
        from miles_transport_colocated.sender import ColocatedSender

        options = ColocatedOptions(**common)
        sender = ColocatedSender(options)
    else:
        from miles_transport_p2p.config import P2POptions
        from miles_transport_p2p.sender import P2PSender

        options = P2POptions(**common)
        sender = P2PSender(options, num_receivers=1)
    host, port = sender.address if name == "p2p" else ("", 0)
    worker = Worker(
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
        "--size-mb",
        str(args.size_mb),
        "--updates",
        str(WARMUP + args.repeats),
        "--repeats",
        str(args.repeats),
    )
    total = nbytes(model)
    try:
        first = worker.report(timeout=300)
        url = str(first.get("url", ""))
        best = float("inf")
        served_s = float("nan")
        for v in range(1, WARMUP + args.repeats + 1):
            t0 = time.perf_counter()
            if name == "p2p":
                sender.send(model.items(), version=v)
            else:
                sender.send(model.items(), version=v, engines=[url])
            if v > WARMUP:
                best = min(best, time.perf_counter() - t0)
            if name == "p2p":
                report = worker.report(timeout=300)
                assert report["version"] == v
                served_s = float(report.get("served_s", "nan"))
            if args.verbose:
                print(f"  {name} update {v}: {time.perf_counter() - t0:.3f} s")
        gbps = total / best / 1e9
        if name == "colocated":
            from miles_transport_common.http import call

            timings = call(url, "/miles_test/timings", None, timeout_s=60, method="GET")
            served_s = float(timings.get("served_s", "nan"))
        extra: dict[str, float] = {"served_s": served_s, "served_share": served_s / best}
        if name == "colocated":
            limit = copy_limit(model, args.repeats)
            extra["pack_only_gbps"] = pack_only(model, options.bucket_bytes, args.repeats)
        elif name == "broadcast":
            limit = gloo_limit(sender, url, total, args.repeats)
        else:
            worker.report(timeout=300)
            limit = nixl_limit(sender, total, args.repeats)
    finally:
        sender.close()
        worker.stop()
    return {"gbps": gbps, "limit_gbps": limit, "ratio": gbps / limit, **extra}


def main() -> None:
    """Parse the arguments; run the receiver role or the whole benchmark."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=512, help="model size in MiB (default 512)")
    ap.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default 64)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement; best kept")
    ap.add_argument("--verbose", action="store_true", help="print the receiver's timings")
    ap.add_argument(
        "--staging", default="full", choices=["full", "bucket"], help="receiver staging mode"
    )
    ap.add_argument(
        "--transports", default="colocated,broadcast,p2p", help="comma-separated subset to run"
    )
    ap.add_argument(
        "--role", default="sender", choices=["sender", "receiver"], help=argparse.SUPPRESS
    )
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    ap.add_argument("--options", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--updates", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "receiver":
        run_receiver(args)
        return
    torch.set_num_threads(1)
    describe(
        {k: v for k, v in vars(args).items() if k in ("size_mb", "bucket_mb", "repeats", "staging")}
    )
    model = make_model(args.size_mb, random=True)
    print(
        f"model: {len(model)} tensors, {nbytes(model) / (1 << 20):.0f} MiB bf16; buckets of "
        f"{args.bucket_mb:g} MiB; staging {args.staging}; best of {args.repeats}",
        flush=True,
    )
    result: dict[str, Any] = {
        "size_mib": round(nbytes(model) / (1 << 20), 1),
        "bucket_mib": args.bucket_mb,
        "staging": args.staging,
    }
    for name in args.transports.split(","):
        r = run_transport(name, model, args)
        print(
            f"{name:>9}: {r['gbps']:.2f} GB/s, limit {r['limit_gbps']:.2f} GB/s, "
            f"ratio {r['ratio']:.2f}",
            flush=True,
        )
        result[f"{name}_ratio"] = round(r["ratio"], 3)
        result[f"{name}_gbps"] = round(r["gbps"], 3)
        result[f"{name}_limit_gbps"] = round(r["limit_gbps"], 3)
        if r["served_s"] == r["served_s"]:  # measured (not NaN)
            print(
                f"{'':>9}  check of the served weights: {r['served_s'] * 1e3:.2f} ms per sync, "
                f"{r['served_share']:.2%} of the sync time",
                flush=True,
            )
            result[f"{name}_served_check_s"] = round(r["served_s"], 5)
            result[f"{name}_served_check_share"] = round(r["served_share"], 4)
        if "pack_only_gbps" in r:
            # the sender's packing alone (copy + checksum, no receiver) against the same limit
            bound = r["pack_only_gbps"] / r["limit_gbps"]
            print(
                f"{'':>9}  packing alone (copy + checksum, no receiver): "
                f"{r['pack_only_gbps']:.2f} GB/s, ratio {bound:.2f}",
                flush=True,
            )
            result[f"{name}_pack_only_ratio"] = round(bound, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
