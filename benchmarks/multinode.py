"""Miles across nodes: the cost of crossing nodes, and cross-node weight sync against the link.

    .venv/bin/python benchmarks/multinode.py [--quick] [--steps N] [--repeats R]

Both clusters are :class:`miles_ray.cluster.LoopbackCluster` clusters on this machine (each
node a Ray node at its own loopback address), started and stopped one at a time, so that an
idle cluster takes no CPU from a measured one.

1. ``multinode_over_single``: the same RL run on a ONE-node cluster (127.0.0.2, 6 logical
   CPUs, ``strategy: PACK``) and on the three-node one (127.0.0.2, .3, .4, 2 logical CPUs each;
   ``STRICT_SPREAD``: rank 0, rank 1 and the engine each on its own node). The run: FSDP2 world
   2 (a torch thread a rank), one embedded engine in a Ray actor (one thread), disaggregated,
   synchronous, GRPO, broadcast transport, 2 groups of 4 samples a step (6 new tokens each), a
   random 2-layer Qwen3 with the real Qwen vocabulary, ``--hidden`` wide (256: a sync moves
   > 300 MB). Throughput = samples / summed ``time/step_s`` of the steps after ``--warmup``;
   runs alternate A B B A (``--repeats`` each); the ratio is of the medians (three / one).
   ``multinode_over_single_cpu``: the same ratio in CPU seconds a sample (one / three) of
   every process of the run (this one, the Ray workers, Ray's daemons; read from ``/proc`` at
   the end of each step): what a CPU-bound run would see, little moved by others' load.
2. ``sync_over_link``: GB/s of the three-node runs' syncs (``sync/bytes`` / ``sync/seconds``:
   from the update's start until the engine committed; the best step, as
   ``benchmarks/transports.py`` keeps the best), rank 0's node to the engine's, over the TCP
   limit between those addresses measured in the same run: a process listening at the engine's
   address, this one sending from rank 0's (socket bound there), ``--link-mb`` in 16 MiB
   chunks, best of 3. Where a sync's time goes: a raw gloo broadcast between the same addresses
   (devices bound to them, ``--bucket-mb`` chunks), and on the first three-node cluster the
   transport alone: the same state dict sent from a Ray task on rank 0's node out of memory
   (no gather from the ranks) to a real embedded engine on the engine's node.

Last line: one JSON object (machine, figures, goals). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from _machine import describe

HERE = Path(__file__).resolve()
VOCAB = 151936  # the real Qwen vocabulary: the qwen3 family's token ids are valid
CPUS = 6  # logical CPUs of either cluster in all
GOALS = {"multinode_over_single": ">= 0.9", "sync_over_link": ">= 0.8"}
CHUNK = 16 << 20  # bytes a send of the raw TCP stream hands the kernel at once
#: the mean of each measured step's metric kept (the run's time split and the sync's)
MEANS = {k: f"time/{k}" for k in ("step_s", "rollout_s", "train_s", "sync_s")}
MEANS.update(transport_s="sync/seconds", send_s="sync/send_seconds", sync_bytes="sync/bytes")


def say(text: str) -> None:
    """Print a progress line (on stderr: ``run_all.py`` keeps stdout's last line)."""
    print(text, file=sys.stderr, flush=True)


def make_model(path: Path, hidden: int) -> Path:
    """Save a random Qwen3 of 2 layers, ``hidden`` wide, tied embeddings, the real vocab."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = {"hidden_size": hidden, "intermediate_size": 2 * hidden}
    shape.update(head_dim=hidden // 4, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, max_position_embeddings=512)  # the KV cache's size
    config = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, **shape)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def write_prompts(path: Path, count: int) -> Path:
    """``count`` prompts ``What is i + i?``, in order."""
    rows = (json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) for i in range(count))
    path.write_text("\n".join(rows) + "\n")
    return path


def raw_config(
    tmp: Path, model: Path, data: Path, name: str, args: argparse.Namespace, strategy: str
) -> dict[str, Any]:
    """The config of one run (the end-to-end multinode test's synchronous run, longer)."""
    ray = {"trainer_cpus": 1, "strategy": strategy, "ready_timeout_s": 180}
    engine = {"name": "embedded", "num_threads": 1, "launch_in": "ray_actor", "ray_num_cpus": 1}
    return {
        "run": dict(name=name, output_dir=str(tmp), steps=args.steps, placement="disaggregated"),
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-3, "cpu_threads": 1, "world_size": 2},
        "engine": engine,
        "algorithm": {"name": "grpo"},
        "transport": {"name": "broadcast", "bucket_size_mb": args.bucket_mb, "timeout_s": 300},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
        "metrics": {"sinks": ["jsonl"]},
        "plugins": {"options": {"ray": ray}},
    }


def diversity(sample: Any, prompt: Any) -> float:
    """A reward that differs between samples even for a random model: every step trains."""
    return float(sum(sample.response_ids) % 1000) / 1000


def cpu_s(cluster: Any) -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by this process (``driver``) and by every process of the
    cluster's nodes: the workers that run the run's actors (``ray::...``: ``workers``) and
    Ray's own (``daemons``); by pid."""
    out = {os.getpid(): ("driver", sum(os.times()[:2]))}
    for pid in (p for pids in cluster.processes().values() for p in pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        kind = "workers" if cmd.startswith(b"ray::") or b"default_worker" in cmd else "daemons"
        out[pid] = (kind, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> Any:
    """CPU seconds of each kind of process between two :func:`cpu_s` readings."""
    used = {"driver": 0.0, "workers": 0.0, "daemons": 0.0}
    for pid, (kind, seconds) in after.items():
        used[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    return used


def train_once(raw: dict[str, Any], cluster: Any) -> tuple[list[dict[str, Any]], Any, Any]:
    """Train the run of ``raw`` in this process (the cluster's driver). Returns its metric
    rows, a :func:`cpu_s` reading at the end of each step, and the address of each rank and
    engine (``rank0``, ``rank1``, ``engine0``)."""
    from miles_core import RewardFunction, hookimpl
    from miles_core.config import validate_config
    from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
    from miles_core.runtime import Run, train

    readings: list[dict[int, tuple[str, float]]] = []

    class Bench:
        @hookimpl
        def miles_register_reward_functions(self, register: Any) -> None:
            register(RewardFunction(name="diversity", factory=lambda options: diversity))

        @hookimpl
        def miles_metrics_emitted(self, step: int, metrics: Any) -> None:
            readings.append(cpu_s(cluster))

    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Bench(), name="bench", distribution="bench", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    train(Run(validate_config(raw, plugins.registry), plugins, progress="off"))
    run_dir = Path(raw["run"]["output_dir"]) / raw["run"]["name"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    placed = json.loads((run_dir / "run.json").read_text())["placement"]["processes"]
    roles = [p for p in placed if p["role"] in ("trainer_rank", "engine")]
    where = {f"{p['role'].removeprefix('trainer_')}{p['index']}": p["address"] for p in roles}
    return rows, readings, where


def summarize(rows: list[dict[str, Any]], readings: list[Any], warmup: int) -> dict[str, Any]:
    """Throughput, time split and CPU seconds a sample of the steps after ``warmup``; GB/s of
    each of their syncs."""
    steps = [r for r in rows if "time/step_s" in r][warmup:]
    seconds = sum(r["time/step_s"] for r in steps)
    samples = sum(r["samples_per_s"] * r["time/step_s"] for r in steps)
    means = {k: sum(r.get(m, 0.0) for r in steps) / len(steps) for k, m in MEANS.items()}
    cpu = cpu_used(readings[warmup - 1], readings[-1])
    return {
        "samples_per_s": samples / seconds,
        **means,
        "sync_gbps": [r["sync/bytes"] / r["sync/seconds"] / 1e9 for r in steps],
        "cpu_s_per_sample": sum(cpu.values()) / samples,
        **{f"cpu_{k}": v / samples for k, v in cpu.items()},
    }


def one_run(
    kind: str, index: int, tmp: Path, model: Path, data: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Start the ``kind`` cluster (``single`` or ``three``), train one run on it as its driver,
    stop it; the run's summary and where its processes ran. The first three-node run is
    followed, on the same cluster, by the transport alone (:func:`transport_alone`)."""
    from miles_ray.cluster import LoopbackCluster

    nodes, strategy = (1, "PACK") if kind == "single" else (3, "STRICT_SPREAD")
    name = f"{kind}-{index}"
    t0 = time.perf_counter()
    with LoopbackCluster(nodes, CPUS // nodes) as cluster:
        started = time.perf_counter() - t0
        with cluster.connect(log_to_driver=False):
            t1 = time.perf_counter()
            raw = raw_config(tmp, model, data, name, args, strategy)
            rows, readings, where = train_once(raw, cluster)
            wall = time.perf_counter() - t1
            alone = transport_alone(model, where, args) if kind == "three" and index == 0 else []
    out = summarize(rows, readings, args.warmup)
    out["where"], out["alone"] = where, alone[1:]
    o = {k: round(v, 2) for k, v in out.items() if isinstance(v, float)}
    say(
        f"  {name}: cluster up in {started:.1f} s, run {wall:.1f} s; steps {args.warmup + 1}-"
        f"{args.steps}: {o['samples_per_s']} samples/s, step {o['step_s']} s = rollout "
        f"{o['rollout_s']} + train {o['train_s']} + sync {o['sync_s']} (transport "
        f"{o['transport_s']}: send {o['send_s']}); sync {o['sync_bytes'] / 1e6:.0f} MB at "
        f"{max(out['sync_gbps']):.3f} GB/s best; CPU s a sample {o['cpu_s_per_sample']} (driver "
        f"{o['cpu_driver']}, workers {o['cpu_workers']}, Ray's daemons {o['cpu_daemons']})"
        f"; placed {where}",
    )
    for m in alone[1:]:
        sent, total = m["sync/send_seconds"], m["sync/seconds"]
        say(
            f"    transport alone (whole tensors in memory, no gather from the ranks): "
            f"{m['sync/bytes'] / 1e6:.0f} MB in {total:.2f} s (send {sent:.2f}, commit "
            f"{total - sent:.2f}) = {m['sync/gb_per_s']:.3f} GB/s",
        )
    return out


def send_updates(model: str, url: str, host: str, bucket_mb: float, updates: int) -> list[Any]:
    """Ray task on rank 0's node: ``updates`` broadcast-transport updates of the model's whole
    state dict (the names the trainer exports: the tied embedding once) to the engine at
    ``url``, the group's store at ``host``; each update's metrics."""
    import torch
    from miles_transport_broadcast.config import BroadcastOptions
    from miles_transport_broadcast.sender import BroadcastSender
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    from miles_core.contracts import each_tensor_once

    state = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict(
        keep_vars=True
    )
    weights = {n: t.detach() for n, t in each_tensor_once(state)}
    sender = BroadcastSender(BroadcastOptions(host=host, bucket_size_mb=bucket_mb, timeout_s=300))
    try:
        return [
            sender.send(weights.items(), version=v, engines=[url]) for v in range(1, updates + 1)
        ]
    finally:
        sender.close()


def transport_alone(model: Path, where: dict[str, str], args: argparse.Namespace) -> list[Any]:
    """The sync without the trainer: a real embedded engine on the engine's node, fed by a Ray
    task on rank 0's node from whole tensors in its memory (no gather from the ranks); the
    metrics of ``1 + --repeats`` updates (the first forms the group)."""
    import ray
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On

    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=1, num_threads=1))
    on_engine = On(node_id=ids[where["engine0"]], soft=False)
    launcher.place_engines(lambda i: {"num_cpus": 1, "scheduling_strategy": on_engine})
    try:
        url = launcher.launch(str(model), index=0)
        on_rank = On(node_id=ids[where["rank0"]], soft=False)
        task = ray.remote(num_cpus=1, scheduling_strategy=on_rank)(send_updates)
        ref = task.remote(str(model), url, where["rank0"], args.bucket_mb, 1 + args.repeats)
        return list(ray.get(ref, timeout=600))
    finally:
        launcher.shutdown()


# --- the link: raw TCP stream and raw gloo broadcast between two node addresses --------------


def child(*argv: str) -> subprocess.Popen[str]:
    """This file run as a child process in role ``argv``; its stdout a pipe."""
    return subprocess.Popen(
        [sys.executable, str(HERE), *argv], stdout=subprocess.PIPE, text=True, bufsize=1
    )


def read_json(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's next line of JSON (its other lines skipped)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"the child process {proc.args!r} exited with {proc.wait()}")


def stop(proc: subprocess.Popen[str]) -> None:
    """End a child process this benchmark started."""
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=30)


def tcp_listen(host: str, total: int, repeats: int) -> None:
    """Child role: at ``host``, take ``repeats`` streams of ``total`` bytes, answering one byte
    after each."""
    srv = socket.create_server((host, 0))
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    buf = memoryview(bytearray(CHUNK))
    for _ in range(repeats):
        conn, _ = srv.accept()
        with conn:
            left = total
            while left:
                n = conn.recv_into(buf, min(left, CHUNK))
                if not n:
                    raise RuntimeError("the sender closed the stream early")
                left -= n
            conn.sendall(b"k")


def tcp_limit(src: str, dst: str, total: int, repeats: int) -> float:
    """GB/s of a raw TCP stream of ``total`` bytes from ``src`` to a process listening at
    ``dst`` (timed until the receiver answers that it has every byte), best of ``repeats``."""
    proc = child("--role", "tcp", "--host", dst, "--total", str(total), "--repeats", str(repeats))
    try:
        port = int(read_json(proc)["port"])
        data = memoryview(bytearray(b"\7" * CHUNK))
        best = float("inf")
        for _ in range(repeats):
            with socket.create_connection((dst, port), timeout=120, source_address=(src, 0)) as s:
                t0 = time.perf_counter()
                left = total
                while left:
                    n = min(left, CHUNK)
                    s.sendall(data[:n])
                    left -= n
                if s.recv(1) != b"k":
                    raise RuntimeError("the receiver did not confirm the stream")
                best = min(best, time.perf_counter() - t0)
    finally:
        stop(proc)
    return total / best / 1e9


def gloo_peer(rank: int, host: str, master: str, port: int, args: argparse.Namespace) -> None:
    """Child role: rank ``rank`` of a gloo group of two whose device is bound to ``host`` (rank 0
    hosts the store at ``master``); broadcasts ``--total`` bytes in ``--bucket-mb`` chunks from
    rank 0, ``--repeats`` times after one warm-up, a barrier closing each; rank 0 prints the
    best time."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        master, port, 2, rank == 0, timedelta(seconds=120), wait_for_workers=False
    )
    if rank == 0:
        print(json.dumps({"port": store.port}), flush=True)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=300)
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    chunk = int(args.bucket_mb * (1 << 20))
    buf = torch.full((chunk,), 7, dtype=torch.uint8)
    sizes = [min(chunk, args.total - i) for i in range(0, args.total, chunk)]
    best = float("inf")
    for _ in range(1 + args.repeats):
        t0 = time.perf_counter()
        for n in sizes:
            pg.broadcast([buf[:n]]).wait()  # from rank 0
        pg.allreduce([torch.zeros(1)]).wait()
        best = min(best, time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"best_s": best}), flush=True)


def gloo_limit(src: str, dst: str, args: argparse.Namespace) -> float:
    """GB/s of a raw gloo broadcast of ``--link-mb`` MiB from ``src`` to ``dst``."""
    total = str(int(args.link_mb * (1 << 20)))
    common = ["--total", total, "--repeats", "3", "--bucket-mb", str(args.bucket_mb)]
    procs = [child("--role", "gloo", "--rank", "0", "--host", src, "--master", src, *common)]
    try:
        port = str(read_json(procs[0])["port"])
        peer = ["--role", "gloo", "--rank", "1", "--host", dst, "--master", src, "--port", port]
        procs.append(child(*peer, *common))
        best = float(read_json(procs[0])["best_s"])
    finally:
        for proc in procs:
            stop(proc)
    return int(total) / best / 1e9


# --- the benchmark ----------------------------------------------------------------------------


def multinode_runs(tmp: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every run, in the order A B B A A B ... (one node: A; three nodes: B)."""
    model = make_model(tmp / "model", args.hidden)
    data = write_prompts(tmp / "prompts.jsonl", 4 * args.steps)
    runs: dict[str, list[dict[str, Any]]] = {"single": [], "three": []}
    for rep in range(args.repeats):
        order = ("single", "three") if rep % 2 == 0 else ("three", "single")
        for kind in order:
            runs[kind].append(one_run(kind, rep, tmp, model, data, args))
    return runs


def figures(runs: dict[str, list[dict[str, Any]]], tcp: float, gloo: float) -> dict[str, Any]:
    """The result's figures from the runs and the limits."""
    single = statistics.median(r["samples_per_s"] for r in runs["single"])
    three = statistics.median(r["samples_per_s"] for r in runs["three"])
    cross = [g for r in runs["three"] for g in r["sync_gbps"]]
    local = [g for r in runs["single"] for g in r["sync_gbps"]]
    alone = runs["three"][0]["alone"]
    alone_best = max(alone, key=lambda m: m["sync/gb_per_s"])
    keys = [k for k in MEANS if k != "sync_bytes"] + [k for k in runs["three"][0] if "cpu" in k]
    cost = {kind: statistics.median(r["cpu_s_per_sample"] for r in rs) for kind, rs in runs.items()}
    split = {
        kind: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
        for kind, rs in runs.items()
    }
    return {
        "multinode_over_single": round(three / single, 3),
        "sync_over_link": round(max(cross) / tcp, 3),
        "multinode_over_single_cpu": round(cost["single"] / cost["three"], 3),
        "three_node_samples_per_s": round(three, 4),
        "one_node_samples_per_s": round(single, 4),
        "three_node_runs_samples_per_s": [round(r["samples_per_s"], 4) for r in runs["three"]],
        "one_node_runs_samples_per_s": [round(r["samples_per_s"], 4) for r in runs["single"]],
        "sync_mb": round(runs["three"][0]["sync_bytes"] / 1e6, 1),
        "cross_node_sync_gbps_best": round(max(cross), 3),
        "cross_node_sync_gbps_median": round(statistics.median(cross), 3),
        "one_node_sync_gbps_best": round(max(local), 3),
        "transport_alone_over_link": round(alone_best["sync/gb_per_s"] / tcp, 3),
        "transport_alone_gbps_best": round(alone_best["sync/gb_per_s"], 3),
        "tcp_link_gbps": round(tcp, 3),
        "gloo_link_gbps": round(gloo, 3),
        "step_split_s": split,
        "placed": runs["three"][0]["where"],
    }


def parse() -> argparse.Namespace:
    """The command line (the child roles' options hidden)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4 steps, 1 warm-up, 1 run each")
    ap.add_argument("--steps", type=int, default=6, help="steps of each run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs on each cluster (default 2)")
    ap.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    ap.add_argument("--bucket-mb", type=float, default=64, help="sync bucket, MiB (default 64)")
    ap.add_argument("--link-mb", type=float, default=256, help="raw stream, MiB (default 256)")
    hidden = argparse.SUPPRESS
    ap.add_argument("--role", default="bench", choices=["bench", "tcp", "gloo"], help=hidden)
    for flag in ("--host", "--master"):
        ap.add_argument(flag, help=hidden)
    for flag in ("--port", "--rank", "--total"):
        ap.add_argument(flag, type=int, default=0, help=hidden)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 4, 1, 1
    if not 1 <= args.warmup < args.steps:
        ap.error(f"--warmup ({args.warmup}): at least 1 and below --steps ({args.steps})")
    return args


def main() -> int:
    """Run a child role, or the whole benchmark; print the final JSON line."""
    args = parse()
    if args.role == "tcp":
        tcp_listen(args.host, args.total, args.repeats)
        return 0
    if args.role == "gloo":
        gloo_peer(args.rank, args.host, args.master, args.port, args)
        return 0
    settings = {k: vars(args)[k] for k in ("steps", "warmup", "repeats", "hidden", "bucket_mb")}
    line = io.StringIO()
    import torch

    torch.set_num_threads(1)
    describe({**settings, "link_mb": args.link_mb, "cpus": CPUS}, file=line)
    print(line.getvalue(), end="", flush=True)
    os.environ.pop("MILES_RAY", None)  # the runs' own section says everything
    # what the runs print goes to stderr: stdout's last line is the result, or else none
    with tempfile.TemporaryDirectory(prefix="mnb") as name, redirect_stdout(sys.stderr):
        runs = multinode_runs(Path(name), args)
    where = runs["three"][0]["where"]
    src, dst = where["rank0"], where["engine0"]
    tcp = tcp_limit(src, dst, int(args.link_mb * (1 << 20)), 3)
    say(f"  TCP stream {src} -> {dst}: {tcp:.3f} GB/s (best of 3)")
    gloo = gloo_limit(src, dst, args)
    say(f"  gloo broadcast {src} -> {dst}: {gloo:.3f} GB/s (best of 3)")
    result = figures(runs, tcp, gloo)
    keys = ("multinode_over_single", "multinode_over_single_cpu", "sync_over_link")
    say(", ".join(f"{k} {result[k]}" for k in keys))
    machine = line.getvalue().split(" | machine: ", 1)[-1].strip()
    print(json.dumps({**result, "machine": machine, "settings": settings, "goals": GOALS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
