"""An engine node joining a running job: how long until it serves, and what it costs the others.

    .venv/bin/python benchmarks/elastic.py [--quick] [--steps N] [--join-at S]

The cluster is a :class:`miles_ray.cluster.LoopbackCluster` on this machine: the head
(127.0.0.2) holds the trainer's rank, the second node (127.0.0.3) engine 0, and a spare node
(127.0.0.4) is started mid-run. The run: fully asynchronous, disaggregated, FSDP2 (one rank),
one embedded engine in a Ray actor (one thread), broadcast transport, GRPO, 2 groups of 4
samples a step, a random 2-layer Qwen3 with the real Qwen vocabulary, ``--hidden`` wide. This
process is the run's driver; after step ``--join-at`` a thread starts the spare node, then asks
the run for one more engine (``miles fleet join``'s request), which Ray places on the new node.

Figures (engine 0's generated tokens are read from its ``/server_info`` every 0.2 s):

1. ``join_to_first_served_s``: from the join request (the node already up; ``node_start_s``
   is the node's own start) to the first token the new engine generated.
2. ``join_cost``: engine 0's tokens a second from the node's start to the new engine's first
   token, over engine 0's tokens a second in the same length of time just before (steady).
   Goal >= 0.9: the join must not slow the serving engines. On one machine the new node and
   its engine start on the same cores as engine 0, which separate machines would not share:
   ``join_cost_per_cpu`` is the same ratio of engine 0's tokens per CPU second of its server
   process (1.0: engine 0 lost only CPU time, never waited for the join).
3. ``pull_over_link``: GB/s of the new engine's copy of engine 0's weights (the embedded
   engine's ``weights_from_peer``: bytes over the seconds of ``POST /miles/pull_weights``),
   over the TCP limit from engine 0's node to the new node's address measured in the same run
   (``benchmarks/multinode.py``'s stream). Goal >= 0.8. When the copy fails the new engine
   takes the next update (``pull_from`` says ``update``), and the figure is that update's rate
   from the trainer's node.

Last line: one JSON object (machine, figures, goals). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from _machine import describe
from multinode import diversity, make_model, say, tcp_limit, write_prompts

GOALS = {"join_cost": ">= 0.9", "pull_over_link": ">= 0.8"}
POLL_S = 0.2


def raw_config(tmp: Path, model: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run's config (see the module docstring)."""
    ray = {"trainer_cpus": 1, "ready_timeout_s": 180}
    engine = {"name": "embedded", "num_threads": 1, "launch_in": "ray_actor", "ray_num_cpus": 1}
    engine["max_running_requests"] = 8
    return {
        "run": {
            "name": "elastic",
            "output_dir": str(tmp),
            "steps": args.steps,
            "mode": "async",
            "placement": "disaggregated",
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-3, "cpu_threads": 1},
        "engine": engine,
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": {"name": "broadcast", "bucket_size_mb": 64, "timeout_s": 300},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 8},
        "buffer": {"capacity": 4, "max_staleness": 2},
        "metrics": {"sinks": ["jsonl"]},
        "plugins": {"options": {"ray": ray}},
    }


def generated(url: str) -> int | None:
    """The tokens the engine at ``url`` has generated so far (``None``: it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=2) as resp:
            info = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return int(info["internal_states"][0]["generated_tokens"])


class Watcher:
    """The thread that starts the spare node after step ``join_at`` and asks for an engine,
    and reads the engines' generated tokens all along."""

    def __init__(self, cluster: Any, run: Any, join_at: int) -> None:
        self.cluster, self.run, self.join_at = cluster, run, join_at
        self.step_done = threading.Event()
        self.stop = threading.Event()
        self.series: list[tuple[float, int, float]] = []  # (time, engine 0's tokens, CPU s)
        self._pid: int | None = None
        self.marks: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.new_node = ""
        self.thread = threading.Thread(target=self._body, daemon=True)

    def _url(self, index: int) -> str | None:
        fleet = self.run.fleet  # None until the run has started its engines
        for engine in list(fleet.engines if fleet is not None else []):
            if engine.index == index:
                return str(engine.url)
        return None

    def _cpu_s(self) -> float:
        """CPU seconds engine 0's server process has used."""
        if self._pid is None:
            self._pid = int(self.run.fleet.launcher.pids(0)[1])
        stat = Path(f"/proc/{self._pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        url = self._url(0)
        n = generated(url) if url else None
        if n is not None:
            self.series.append((time.perf_counter(), n, self._cpu_s()))

    def _wait(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not self.stop.is_set():
            self._sample()
            time.sleep(POLL_S)

    def _body(self) -> None:
        from miles_core.runtime.control import request

        while not self.step_done.is_set() and not self.stop.is_set():
            self._sample()
            time.sleep(POLL_S)
        self.marks["node_start"] = time.perf_counter()
        node = threading.Thread(target=self._add_node)
        node.start()
        while node.is_alive():
            self._sample()
            time.sleep(POLL_S)
        self.marks["request"] = time.perf_counter()
        request(self.run.run_dir, {"action": "join", "engines": 1})
        while not self.stop.is_set():
            self._sample()
            url = self._url(1)
            if url and (generated(url) or 0) > 0:
                self.marks["first_served"] = time.perf_counter()
                break
            time.sleep(POLL_S / 4)
        self._wait(5.0)  # after the join: both engines serve

    def _add_node(self) -> None:
        self.new_node = self.cluster.add_node()
        self.marks["node_up"] = time.perf_counter()

    def rate(self, t0: float, t1: float) -> tuple[float, float]:
        """Engine 0's tokens a second and tokens a CPU second of its server between ``t0``
        and ``t1`` (the readings inside)."""
        inside = [r for r in self.series if t0 <= r[0] <= t1]
        if len(inside) < 2:
            return float("nan"), float("nan")
        (ta, na, ca), (tb, nb, cb) = inside[0], inside[-1]
        return (nb - na) / max(tb - ta, 1e-9), (nb - na) / max(cb - ca, 1e-9)


def train_with_join(cluster: Any, raw: dict[str, Any], join_at: int) -> tuple[Watcher, Any]:
    """Train the run in this process with the :class:`Watcher` running; its metric rows."""
    from miles_core import RewardFunction, hookimpl
    from miles_core.config import validate_config
    from miles_core.plugins import Plugins, collect_registry, create_plugin_manager
    from miles_core.runtime import Run, train

    holder: list[Watcher] = []

    class Bench:
        @hookimpl
        def miles_register_reward_functions(self, register: Any) -> None:
            register(RewardFunction(name="diversity", factory=lambda options: diversity))

        @hookimpl
        def miles_metrics_emitted(self, step: int, metrics: Any) -> None:
            if holder and step == join_at:
                holder[0].step_done.set()

    pm = create_plugin_manager(autoload=True, trace=False)
    pm.register_plugin(Bench(), name="bench", distribution="bench", version="0")
    plugins = Plugins(pm=pm, registry=collect_registry(pm))
    run = Run(validate_config(raw, plugins.registry), plugins, progress="off")
    watcher = Watcher(cluster, run, join_at)
    holder.append(watcher)
    watcher.thread.start()
    try:
        train(run)
    finally:
        watcher.stop.set()
        watcher.thread.join(timeout=30)
    run_dir = Path(raw["run"]["output_dir"]) / raw["run"]["name"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return watcher, [r for r in rows if "time/step_s" in r]


def figures(
    w: Watcher, rows: list[dict[str, Any]], tcp: float, copy: dict[str, Any]
) -> dict[str, Any]:
    """The result's figures (see the module docstring); ``copy``: the fleet's answer of the
    new engine's weight copy (empty: it took the next update)."""
    m = w.marks
    if "first_served" not in m:
        raise SystemExit("the joined engine never served: see the run's log above")
    window = m["first_served"] - m["node_start"]
    steady, steady_cpu = w.rate(m["node_start"] - window, m["node_start"])
    during, during_cpu = w.rate(m["node_start"], m["first_served"])
    after = [r for r in rows if r.get("engine/serving") == 2]
    pull = after[0] if after else {}
    if copy:
        pull_bytes, pull_s = float(copy["bytes"]), float(copy["seconds"])
    elif pull:
        pull_bytes, pull_s = pull["sync/bytes"], pull["sync/seconds"]
    else:
        pull_bytes, pull_s = 0.0, float("nan")
    pull_gbps = pull_bytes / pull_s / 1e9
    return {
        "join_to_first_served_s": round(m["first_served"] - m["request"], 2),
        "node_start_s": round(m["node_up"] - m["node_start"], 2),
        "join_cost": round(during / steady, 3),
        "join_cost_per_cpu": round(during_cpu / steady_cpu, 3),
        "engine0_tokens_per_s_steady": round(steady, 1),
        "engine0_tokens_per_s_during_join": round(during, 1),
        "pull_over_link": round(pull_gbps / tcp, 3),
        "pull_gbps": round(pull_gbps, 3),
        "pull_mb": round(pull_bytes / 1e6, 1),
        "pull_s": round(pull_s, 3),
        "pull_from": "engine 0 (copy)" if copy else "the trainer (update)",
        "pull_in_place": bool(copy.get("in_place")),
        "pull_fetch_s": round(float(copy.get("fetch_seconds", pull_s)), 3),
        "tcp_link_gbps": round(tcp, 3),
        "joined_at_step": int(pull["step"]) if pull else None,
        "steps_s_median": round(statistics.median(r["time/step_s"] for r in rows), 3),
        "new_node": w.new_node,
    }


def parse() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="30 steps, the join after step 4")
    ap.add_argument("--steps", type=int, default=40, help="steps of the run (default 40)")
    ap.add_argument("--join-at", type=int, default=8, help="join after this step (default 8)")
    ap.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    ap.add_argument("--link-mb", type=float, default=256, help="raw stream, MiB (default 256)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.join_at = 30, 4
    if not 1 <= args.join_at < args.steps:
        ap.error(f"--join-at ({args.join_at}): at least 1 and below --steps ({args.steps})")
    return args


def main() -> int:
    """Run the benchmark; print the final JSON line."""
    args = parse()
    from miles_ray.cluster import LoopbackCluster

    settings = {k: vars(args)[k] for k in ("steps", "join_at", "hidden", "link_mb")}
    line = io.StringIO()
    describe(settings, file=line)
    print(line.getvalue(), end="", flush=True)
    os.environ.pop("MILES_RAY", None)  # the run's own section says everything

    with tempfile.TemporaryDirectory(prefix="miles-elastic-") as name:
        tmp = Path(name)
        model = make_model(tmp / "model", args.hidden)
        data = write_prompts(tmp / "prompts.jsonl", 16 * args.steps)
        t0 = time.perf_counter()
        with LoopbackCluster(2, 1, spare=1) as cluster:
            say(f"cluster of 2 nodes up in {time.perf_counter() - t0:.1f} s (one spare)")
            # what the run prints goes to stderr: stdout's last line is the result
            with cluster.connect(log_to_driver=False), redirect_stdout(sys.stderr):
                watcher, rows = train_with_join(
                    cluster, raw_config(tmp, model, data, args), args.join_at
                )
            copy = dict(watcher.run.fleet.membership.last_copy)
            # the copy comes from engine 0's node, an update from the trainer's
            source = cluster.node_addresses[1 if copy else 0]
            tcp = tcp_limit(source, watcher.new_node, int(args.link_mb * (1 << 20)), 3)
    out = figures(watcher, rows, tcp, copy)
    say(
        f"node up in {out['node_start_s']} s; join request to first token "
        f"{out['join_to_first_served_s']} s; engine 0 at {out['engine0_tokens_per_s_during_join']}"
        f" tokens/s during the join vs {out['engine0_tokens_per_s_steady']} steady "
        f"(join_cost {out['join_cost']}, per CPU second {out['join_cost_per_cpu']}); "
        f"pull from {out['pull_from']}: {out['pull_mb']} MB at {out['pull_gbps']} GB/s vs "
        f"TCP {out['tcp_link_gbps']} GB/s (pull_over_link {out['pull_over_link']})"
    )
    machine = line.getvalue().split(" | machine: ", 1)[-1].strip()
    print(json.dumps({**out, "machine": machine, "settings": settings, "goals": GOALS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
