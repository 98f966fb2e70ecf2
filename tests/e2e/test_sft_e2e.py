"""SFT end to end with the real plugins on a tiny random Qwen3: ``algorithm: sft`` on a
``conversations`` file, two steps, on the synchronous loop (colocated, in process) and on the
asynchronous one (Ray disaggregated placement). Each trains, evaluates the held-out loss and
greedy accuracy before and after, checkpoints, counts the conversation without an assistant
turn, and enters every group in the ledger; the synchronous run also resumes. A malformed row
stops the run before any work, naming the row and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import RAY, assert_ran, train, write_prompts


def _chat(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }


def _files(tmp_path: Path) -> dict[str, Path]:
    train_rows = [_chat(i) for i in range(40)]
    # a conversation without an assistant turn: skipped and counted, not trained
    train_rows.insert(3, {"messages": [{"role": "user", "content": "Hello?"}]})
    files = {
        "train": tmp_path / "train.jsonl",
        "heldout": tmp_path / "heldout.jsonl",
        "prompts": tmp_path / "prompts.jsonl",
    }
    files["train"].write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    files["heldout"].write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(100, 108)))
    write_prompts(files["prompts"], 8)
    return files


def _config(tmp_path: Path, model: Path, *, mode: str = "sync") -> dict[str, Any]:
    files = _files(tmp_path)
    cfg: dict[str, Any] = {
        "run": {"name": "sft", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1},
        "engine": {"name": "embedded", "max_running_requests": 4, "num_threads": 1},
        "algorithm": "sft",
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "exact_match",
        "data": {"name": "conversations", "path": str(files["train"]), "shuffle": False},
        "rollout": {"group_size": 1, "groups_per_step": 4, "max_new_tokens": 4},
        "eval": {
            "data": {"name": "jsonl", "path": str(files["prompts"]), "shuffle": False},
            "loss_data": {"name": "conversations", "path": str(files["heldout"])},
            "limit": 8,
        },
    }
    if mode == "async":
        cfg["run"].update(mode="async", placement="disaggregated")
        cfg["engine"].update(launch_in="ray_actor", ray_num_cpus=1)
        cfg["transport"] = {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60}
    else:
        cfg["run"]["checkpoint_every"] = 1
    return cfg


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check(out: Any, run: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    assert_ran(out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(r["eval/loss_n"] == 8 and r["eval/n"] == 8 for r in evals)
    assert all("eval/accuracy" in r for r in evals)
    steps = [r for r in rows if "eval/loss" not in r]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_version"] for s in steps] == [1.0, 2.0]
    for s in steps:
        assert math.isfinite(s["train/nll"]) and s["train/nll"] > 0
        assert s["train/grad_norm"] > 0 and s["sync/bytes"] > 0
        # conversations from data carry no engine log-probs: no mismatch is reported
        assert not [k for k in s if k.startswith("train/mismatch/")]
        assert s["data/skipped_rows"] == 1
        assert s["ledger/trained"] == 4 * s["step"]
        assert s["ledger/produced"] == sum(
            s[f"ledger/{k}"] for k in ("in_flight", "buffered", "trained", "dropped")
        )
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["steps"] == 2 and final["skipped_rows"] == 1
    assert final["n_heldout_loss"] == 8 and final["n_heldout"] == 8
    assert {"accuracy_before", "accuracy_after", "loss_before", "loss_after"} <= set(final)
    assert "eval at step 0: accuracy" in out.stderr and "held-out conversations" in out.stderr
    return steps, final


@pytest.mark.slow
def test_sft_on_the_synchronous_loop(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = train(_write(tmp_path, _config(tmp_path, tiny_qwen3)))
    run = tmp_path / "runs" / "sft"
    _, final = _check(out, run)
    # two steps of SFT lower the held-out loss of conversations of the same form
    assert final["loss_after"] < final["loss_before"], final
    assert (run / "checkpoints" / "step_2" / "loop.json").is_file()
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["rollout_function"]["name"] == "sft"  # the algorithm's default
    assert (run / "plot.png").stat().st_size > 1000
    # a resumed run continues from the checkpoint, the source at its saved position
    more = train(
        _write(tmp_path, _config(tmp_path, tiny_qwen3)), "--resume", "--set", "run.steps=3"
    )
    assert more.returncode == 0, more.stderr[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "train/nll" in r][-1]
    assert last["step"] == 3 and last["weight_version"] == 3.0 and last["ledger/trained"] == 12
    assert json.loads(more.stdout.strip().splitlines()[-1])["steps"] == 3


@pytest.mark.slow
def test_sft_on_the_asynchronous_loop(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = train(
        _write(tmp_path, _config(tmp_path, tiny_qwen3, mode="async")),
        env={"MILES_RAY": RAY},
        timeout=400,
    )
    steps, _ = _check(out, tmp_path / "runs" / "sft")
    for s in steps:
        # tokens from data have no weight version: an SFT group is never stale
        assert s["staleness/consumed_max"] == 0 and s.get("ledger/dropped.stale", 0) == 0


def test_a_malformed_conversation_stops_the_run_before_any_work(tmp_path: Path) -> None:
    model = tmp_path / "model"  # never loaded: the data is refused first
    model.mkdir()
    cfg = _config(tmp_path, model)
    bad = tmp_path / "bad.jsonl"
    rows = [_chat(0), {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant"}]}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg["data"]["path"] = str(bad)
    out = train(_write(tmp_path, cfg), timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"{bad!s}" in out.stderr and "line 2: messages[1]: an assistant message" in out.stderr
    assert "Traceback" not in out.stderr
