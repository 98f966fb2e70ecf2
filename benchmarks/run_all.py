"""Runs the benchmarks in this folder and writes one markdown table of every ratio.

    .venv/bin/python benchmarks/run_all.py [--only engine,router] [--table-only] [--tag T]
        [-- ARGS]

Each benchmark measures its own baseline in the same run and ends with one JSON line. That
line is kept in ``benchmarks/results/<name>.json`` with the date it was measured, and the
table ``benchmarks/results/RESULTS.md`` is written from every kept result: a benchmark run
alone (``--only``) replaces its own row and keeps the others. ``--table-only`` rewrites the
table from the kept results without running anything. Arguments after ``--`` go to every
benchmark run; ``--tag T`` keeps their results as ``<name>-T.json`` beside the untagged ones
(a second setting of the same benchmark, e.g. ``--only vs_trl --tag bf16 -- --precision
bf16``), rows of their own in the table. The last line printed is one JSON object keyed by
benchmark name.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: The goal of each headline ratio (the issue or README that set it).
GOALS: dict[tuple[str, str], str] = {
    ("engine", "engine_over_hf_best"): ">= 1.5",
    ("engine", "engine_over_roofline"): ">= 0.6",
    ("vs_trl", "miles_over_trl"): ">= 2.0",
    ("async_rl", "async_over_limit"): ">= 0.85",
    ("router", "router_over_direct"): ">= 0.95",
    ("transports", "colocated_ratio"): ">= 0.8",
    ("transports", "broadcast_ratio"): ">= 0.8",
    ("transports", "p2p_ratio"): ">= 0.8",
    ("tito", "turn50_over_turn1"): "<= 1.5",
    ("megatron_vs_fsdp2", "megatron_over_fsdp2"): ">= 0.85",
    ("opd_vs_grpo", "steps_ratio"): "< 1.0",
    ("multi_lora", "mixed_over_single"): ">= 0.8",
    ("lora_sync", "full_over_adapter_bytes"): ">= 50",
    ("routing_replay", "r3_overhead"): "<= 1.05",
    ("true_on_policy", "engine_cost"): ">= 0.7",
    ("true_on_policy", "trainer_cost"): ">= 0.7",
    ("multinode", "multinode_over_single"): ">= 0.9",
    ("multinode", "sync_over_link"): ">= 0.8",
    ("elastic", "join_cost"): ">= 0.9",
    ("elastic", "pull_over_link"): ">= 0.8",
    ("dashboard", "dashboard_cost"): ">= 0.98",
}


def benchmarks() -> list[str]:
    return sorted(
        p.stem for p in HERE.glob("*.py") if p.name != Path(__file__).name and p.stem[0] != "_"
    )


def is_ratio(key: str) -> bool:
    return (
        "_over_" in key
        or key.endswith("_ratio")
        or key.endswith("_overhead")
        or key.endswith("_cost")
    )


def reached(value: float, goal: str) -> str:
    op, target = goal.split()
    ok = {
        ">=": value >= float(target),
        "<=": value <= float(target),
        "<": value < float(target),
    }[op]
    return "yes" if ok else "**no**"


def table(results: dict[str, dict]) -> str:
    """The markdown table of every ratio of every kept result."""
    lines = [
        "| benchmark | ratio | value | goal | reached | measured |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(results):
        rec = results[name]
        out = rec.get("result", {})
        if "error" in out:
            lines.append(f"| {name} | (failed: {out['error']}) | | | | {rec.get('date', '')} |")
            continue
        for key, value in out.items():
            if not is_ratio(key) or not isinstance(value, int | float):
                continue
            goal = GOALS.get((name.split("-")[0], key), "")  # a tagged run has its goals
            mark = reached(float(value), goal) if goal else ""
            lines.append(f"| {name} | `{key}` | {value} | {goal} | {mark} | {rec['date']} |")
    return "\n".join(lines) + "\n"


def run_one(name: str, extra: list[str]) -> dict:
    print(f"== {name}", flush=True)
    proc = subprocess.run(
        [sys.executable, str(HERE / f"{name}.py"), *extra],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    settings = next((ln for ln in lines if ln.startswith("settings:")), "")
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"error": f"exit {proc.returncode}"}
    print(json.dumps(result), flush=True)
    return {
        "date": dt.date.today().isoformat(),
        "command": f"benchmarks/{name}.py {' '.join(extra)}".strip(),
        "settings": settings,
        "result": result,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--tag", default="", help="keep the results as <name>-TAG.json")
    p.add_argument("extra", nargs="*", help="arguments for every benchmark (after --)")
    args = p.parse_args()
    names = benchmarks()
    chosen = [n for n in args.only.split(",") if n] or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        p.error(f"--only: unknown benchmark(s) {unknown}; allowed: {names}")
    RESULTS.mkdir(exist_ok=True)
    status = 0
    if not args.table_only:
        for name in chosen:
            rec = run_one(name, args.extra)
            status |= int("error" in rec["result"])
            stem = f"{name}-{args.tag}" if args.tag else name
            (RESULTS / f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    kept = {f.stem: json.loads(f.read_text()) for f in sorted(RESULTS.glob("*.json"))}
    (RESULTS / "RESULTS.md").write_text(
        "# Benchmark results\n\nWritten by `benchmarks/run_all.py` from `benchmarks/results/"
        "*.json` (each row's date is when that benchmark ran; commands and settings are in its "
        "JSON file).\n\n" + table(kept)
    )
    print(f"table: {RESULTS / 'RESULTS.md'}", flush=True)
    print(json.dumps({k: v["result"] for k, v in kept.items()}))
    return status


if __name__ == "__main__":
    sys.exit(main())
