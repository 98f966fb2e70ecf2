"""Runs every benchmark in this folder and prints each one's final JSON line.

    .venv/bin/python benchmarks/run_all.py [--quick]

Each benchmark measures its own baseline in the same run and prints ratios; its last line of
output is JSON. The summary's last line is one JSON object keyed by benchmark name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    """Run each benchmark, collect its final JSON line."""
    here = Path(__file__).resolve().parent
    extra = sys.argv[1:]
    results: dict[str, object] = {}
    status = 0
    for script in sorted(here.glob("*.py")):
        if script.name == Path(__file__).name:
            continue
        print(f"== {script.name}", flush=True)
        proc = subprocess.run(
            [sys.executable, str(script), *extra], capture_output=True, text=True, check=False
        )
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        try:
            results[script.stem] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            results[script.stem] = {
                "error": f"exit {proc.returncode}",
                "stderr": proc.stderr[-2000:],
            }
            status = 1
        print(json.dumps(results[script.stem]), flush=True)
    print(json.dumps(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
