"""The live dashboard's price: a run's step rate with the dashboard served and polled as the page
polls it, over the same run without it.

Each round runs the same short synchronous ``miles train`` twice, once plain and once with
``--dashboard``, the order alternating by round: a tiny random Qwen3 (the tests' model: FSDP2
trainer, embedded engine, colocated transport, GRPO, the ``diversity`` reward), ``--steps``
steps of two groups of four. While the second runs, a client makes the page's requests every
second (``/api/metrics`` from where the last answer stopped, ``/api/ledger``, ``/api/run``
every tenth poll, and every fifth the traces' steps and a new step's lines), so the server
reads and answers as it does with the page open. A run's step
rate is its steps over the sum of their ``time/step_s`` in ``metrics.jsonl`` (start-up and
evaluations left out).

The last line is JSON: ``dashboard_cost`` (step rate with over without, the median of the
rounds' ratios; goal >= 0.98; ``dashboard_cost_mean`` their mean), the rates behind it and
the polls answered; and
``poll_cpu_s``, the CPU seconds one poll costs (server and client, in one process, over a
finished run's folder), so ``poll_cpu_fraction`` is the share of one CPU the page's poll a
second takes at most: a bound that holds where the step rates of a busy machine are too noisy
to show a 2% difference.

    .venv/bin/python benchmarks/dashboard.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from _machine import describe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from core_support import DIVERSITY, save_tiny_qwen3, write_dist, write_prompts  # noqa: E402


def config(tmp: Path, model: Path, name: str, steps: int) -> Path:
    """The run config of one measured run."""
    import yaml

    data = tmp / "prompts.jsonl"
    if not data.exists():
        write_prompts(data, 400)
    cfg = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "steps": steps},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 8},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 4},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def get_json(url: str) -> Any:
    """The JSON answer of a ``GET``."""
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Poller:
    """The page's requests, every second, until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.polls, self.next = url, 0, 0
        self.trace_step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _get(self, path: str) -> Any:
        return get_json(self.url + path)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                if self.polls % 10 == 0:
                    self._get("api/run")
                more = True
                while more:
                    page = self._get(f"api/metrics?since={self.next}")
                    self.next, more = page["next"], page["more"]
                self._get("api/ledger")
                if self.polls % 5 == 0:  # the traces panel: its steps, a new step's lines
                    steps = self._get("api/traces")["steps"]
                    if steps and steps[-1] != self.trace_step:
                        self.trace_step = steps[-1]
                        self._get(f"api/traces?step={self.trace_step}")
                self.polls += 1
            except OSError:  # the run ended and its server with it
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.polls


def run_once(
    tmp: Path, model: Path, site: Path, name: str, steps: int, dash: bool
) -> dict[str, Any]:
    """One run; its step rate (and the polls answered, with the dashboard)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "miles_core.cli", "train", str(config(tmp, model, name, steps))]
    proc = subprocess.Popen(
        [*cmd, *(["--dashboard"] if dash else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stderr is not None
    poller, tail = None, []
    for line in proc.stderr:
        tail = [*tail[-40:], line]
        if dash and poller is None and (m := re.search(r"at (http://127\.0\.0\.1:\d+/)", line)):
            poller = Poller(m.group(1))
    polls = poller.stop() if poller is not None else 0
    if proc.wait() != 0:
        raise SystemExit(f"run {name} failed:\n{''.join(tail)}")
    lines = (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "time/step_s" in r]
    return {"rate": len(rows) / sum(r["time/step_s"] for r in rows), "polls": polls}


def poll_cpu(run_dir: Path, polls: int = 200) -> float:
    """CPU seconds of one poll of the page (``/api/metrics`` of a whole finished run read
    anew, ``/api/ledger``, ``/api/run``, the traces' steps and a step's lines), server and
    client both in this process: an upper
    bound of what a poll a second costs the run's process, which the step rates on a busy
    machine cannot resolve."""
    from miles_core.dashboard.server import Dashboard

    with Dashboard(run_dir) as dash:
        t0 = time.process_time()
        for _ in range(polls):
            for path in ("api/run", "api/metrics?since=0", "api/ledger", "api/traces"):
                get_json(dash.url + path)
            steps = get_json(dash.url + "api/traces")["steps"]
            get_json(dash.url + f"api/traces?step={steps[-1]}")
        return (time.process_time() - t0) / polls


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    describe(vars(args))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = save_tiny_qwen3(tmp / "tiny-qwen3")
        site = write_dist(
            tmp / "site", "miles-diversity", "miles_diversity", DIVERSITY, "diversity"
        )
        ratios, rows = [], []
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {
                dash: run_once(tmp, model, site, f"r{i}-{int(dash)}", args.steps, dash)
                for dash in order
            }
            ratios.append(got[True]["rate"] / got[False]["rate"])
            rows.append({"with": got[True], "without": got[False], "ratio": ratios[-1]})
            print(f"round {i}: {json.dumps(rows[-1])}", flush=True)
        # the server's thread shares the process with the run: its CPU per poll, a poll a second
        cpu = poll_cpu(tmp / "runs" / "r0-1")
    for row in rows:
        row["ratio"] = round(row["ratio"], 3)
        for side in ("with", "without"):
            row[side]["rate"] = round(row[side]["rate"], 3)
    out = {
        "dashboard_cost": round(statistics.median(ratios), 3),
        "dashboard_cost_mean": round(statistics.fmean(ratios), 3),
        "poll_cpu_s": round(cpu, 5),
        "poll_cpu_fraction": round(cpu / 1.0, 5),
        "rounds": rows,
        "steps": args.steps,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
