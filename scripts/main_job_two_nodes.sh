#!/usr/bin/env bash
# The main job across two nodes, on one machine: a Ray cluster of two nodes at the loopback
# addresses 127.0.0.2 and 127.0.0.3 (2 logical CPUs each), started and stopped by this script
# (its own processes only), and examples/main_two_nodes.yaml run on it. Arguments go to
# `miles train`. Its last line is the run's JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m miles_modelfamilies.smollm2_model >/dev/null
.venv/bin/miles family verify smollm2 >/dev/null
exec .venv/bin/python - "$@" <<'PY'
import os
import subprocess
import sys

from miles_ray.cluster import LoopbackCluster

with LoopbackCluster(2, cpus=2) as cluster:
    print(f"a cluster of two nodes at {cluster.address}: {cluster.node_addresses}", flush=True)
    command = [
        ".venv/bin/miles", "train", "examples/main_two_nodes.yaml",
        # this process runs at 127.0.0.1, on neither node: attach it to the head's
        "--set", f"plugins.options.ray.node_address={cluster.head_address}",
        *sys.argv[1:],
    ]
    code = subprocess.call(command, env={**os.environ, **cluster.driver_env()})
sys.exit(code)
PY
