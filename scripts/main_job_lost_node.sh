#!/usr/bin/env bash
# The main job losing a trainer node, on one machine: a Ray cluster of three loopback nodes
# (127.0.0.2, .3, .4; 2 logical CPUs each), started and stopped by this script (its own
# processes only). examples/main_two_nodes.yaml runs on two of them (a rank and an engine on
# each); once its step-8 checkpoint is written, the node of a rank other than the head's is
# killed (every process of it, no warning). The run stops with that checkpoint; the script
# resumes it with --resume on the nodes that remain, at one rank and one engine, and the run
# finishes its 16 steps. Arguments go to both `miles train` calls. Its last line is one JSON
# object: both runs' exit codes, where the killed rank was, and the resumed run's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m miles_modelfamilies.smollm2_model >/dev/null
.venv/bin/miles family verify smollm2 >/dev/null
exec .venv/bin/python - "$@" <<'PY'
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from miles_ray.cluster import LoopbackCluster

CONFIG = "examples/main_two_nodes.yaml"
RUN = Path("runs/smollm2-chain-sum-two-nodes")
CHECKPOINT = RUN / "checkpoints" / "step_8" / "loop.json"

with LoopbackCluster(3, cpus=2) as cluster:
    print(f"a cluster of three nodes at {cluster.address}: {cluster.node_addresses}", flush=True)
    env = {**os.environ, **cluster.driver_env()}
    # this process runs at 127.0.0.1, on none of the nodes: attach it to the head's
    attach = ["--set", f"plugins.options.ray.node_address={cluster.head_address}"]
    started = time.time()
    first = subprocess.Popen([".venv/bin/miles", "train", CONFIG, *attach, *sys.argv[1:]], env=env)
    killed = None
    while first.poll() is None:
        # this run's checkpoint (an earlier run's folder is set aside when this one starts)
        if killed is None and CHECKPOINT.is_file() and CHECKPOINT.stat().st_mtime > started:
            placed = json.loads((RUN / "run.json").read_text())["placement"]["processes"]
            rank = next(
                p for p in placed
                if p["role"] == "trainer_rank" and p["address"] != cluster.head_address
            )
            killed = {"rank": rank["index"], "address": rank["address"]}
            print(f"killing node {rank['address']} (trainer rank {rank['index']})", flush=True)
            cluster.kill_node(rank["address"])
        time.sleep(1)
    print(f"the first run exited with {first.returncode}", flush=True)
    resumed = [
        ".venv/bin/miles", "train", CONFIG, "--resume", *attach,
        "--set", "backend.world_size=1", "--set", "engine.num_engines=1",
        "--set", "plugins.options.ray.nodes=1", *sys.argv[1:],
    ]
    out = subprocess.run(resumed, env=env, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(out.stdout)
lines = out.stdout.strip().splitlines()
summary = json.loads(lines[-1]) if out.returncode == 0 and lines else None
print(json.dumps({"first_exit": first.returncode, "killed": killed,
                  "resumed_exit": out.returncode, "resumed": summary}))
sys.exit(out.returncode or (0 if killed and first.returncode != 0 else 1))
PY
