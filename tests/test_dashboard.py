"""The live dashboard: its JSON endpoints over a growing run folder (incremental, bounded,
malformed lines skipped and counted, missing files), the API key beyond loopback, and the page
itself rendered by headless Chromium while rows land (read back from the data attributes its
script writes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import MILES, REPO, run_miles

from miles_core.dashboard.reader import MAX_ROWS_PER_REQUEST
from miles_core.dashboard.server import BindRefused, Dashboard
from miles_core.hosts import API_KEY_ENV

KEY = "s3cret-dashboard-key"


def _get(url: str, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _step(step: int, *, queued: float = 3.0, dropped: int = 0) -> dict[str, Any]:
    """A row as an asynchronous run writes it (the keys of the reporter and the buffer)."""
    return {
        "step": step,
        "time": 1_800_000_000.0 + step,
        "reward/mean": 0.1 * step,
        "reward/std": 0.05,
        "time/rollout_s": 1.0,
        "time/train_s": 2.0,
        "time/sync_s": 0.5,
        "trainer/wait_s": 0.25,
        "buffer/size": queued,
        "buffer/capacity": 8.0,
        "staleness/consumed_mean": 0.5,
        "staleness/consumed_max": 1.0,
        "staleness/queued_mean": 0.25,
        "staleness/queued_max": 1.0,
        "ledger/produced": 4.0 * step + dropped,
        "ledger/trained": 4.0 * step,
        "ledger/dropped": float(dropped),
        **({"ledger/dropped.stale": float(dropped)} if dropped else {}),
        "rollout/tokens_per_s": 100.0 + step,
        "trainer/tokens_per_s": 50.0 + step,
        "rollout/idle_fraction": 0.1,
        "rollout/paused_fraction": 0.2,
        "engine/serving": 2.0,
        "engine/restarts": 0.0,
        "weight_version": float(step),
        "train/grad_norm": 1.0,  # not drawn: left out of the answer
    }


def _eval(step: int, accuracy: float, n: int) -> dict[str, Any]:
    return {"step": step, "time": 1_800_000_000.0, "eval/accuracy": accuracy, "eval/n": float(n)}


def _append(path: Path, *rows: dict[str, Any], raw: str = "") -> None:
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows) + raw)


@pytest.fixture
def dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dashboard]:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with Dashboard(tmp_path) as dash:
        yield dash


def test_metrics_are_read_incrementally_bounded_and_malformed_lines_counted(
    dashboard: Dashboard, tmp_path: Path
) -> None:
    url = dashboard.url + "api/metrics"
    status, page = _get(url)
    assert status == 200 and page["exists"] is False and page["rows"] == []

    metrics = tmp_path / "metrics.jsonl"
    _append(metrics, _eval(0, 0.25, 40), _step(1), raw="{not json\n[1, 2]\n")
    _append(metrics, _step(2), raw='{"step": 3, "reward/me')  # a line being written
    status, page = _get(url)
    assert status == 200 and page["exists"] is True
    assert [r["step"] for r in page["rows"]] == [0, 1, 2]
    assert page["malformed"] == 2 and page["next"] == 3 and page["more"] is False
    assert page["offset"] == len(metrics.read_bytes().rsplit(b"\n", 1)[0]) + 1
    assert "train/grad_norm" not in page["rows"][1] and page["rows"][1]["buffer/size"] == 3.0

    # the line completes and more land: the next request gets only what is new
    _append(metrics, raw='an": 0.3}\n')
    before = page["offset"]
    _append(metrics, _step(4), _step(5))
    status, page = _get(f"{url}?since=3")
    assert [r["step"] for r in page["rows"]] == [3, 4, 5] and page["since"] == 3
    assert page["offset"] == metrics.stat().st_size > before
    assert page["total"] == 6 and page["malformed"] == 2

    # bounded: a page holds at most `limit` rows, and says there are more
    status, page = _get(f"{url}?since=1&limit=2")
    assert [r["step"] for r in page["rows"]] == [1, 2] and page["more"] is True
    bad = (
        (f"limit={MAX_ROWS_PER_REQUEST + 1}", "limit"),
        ("since=-1", "since"),
        ('since="\\', "since"),
    )
    for query, name in bad:
        status, body = _get(f"{url}?{query}")
        assert status == 400 and f"'{name}'" in body["error"], body

    # a new file in its place (an earlier run moved aside): read again from its start
    metrics.write_text(json.dumps(_step(1)) + "\n")
    status, page = _get(f"{url}?since=0")
    assert [r["step"] for r in page["rows"]] == [1] and page["resets"] == 1
    # ... also when the new one is already longer than what was read of the old one
    moved = tmp_path / "metrics.new"
    _append(moved, _step(7), _step(8), _step(9))
    os.replace(moved, metrics)
    status, page = _get(f"{url}?since=0")
    assert [r["step"] for r in page["rows"]] == [7, 8, 9] and page["resets"] == 2


def test_ledger_and_run_endpoints_read_the_run_files(dashboard: Dashboard, tmp_path: Path) -> None:
    status, led = _get(dashboard.url + "api/ledger")
    assert status == 200 and led == {
        "exists": False,
        "error": None,
        "file": None,
        "step": None,
        "latest": {},
    }
    status, run = _get(dashboard.url + "api/run")
    assert status == 200 and run["exists"] is False and run["summary"] == {}

    _append(tmp_path / "metrics.jsonl", _step(1), _step(2, dropped=3))
    (tmp_path / "ledger.json").write_text(json.dumps({"trained": 8, "dropped": 3}))
    record = {
        "distributions": {"miles-core": "0.1.0"},
        "config": {"run": {"name": "r", "steps": 9, "mode": "async"}, "engine": {"name": "e"}},
    }
    (tmp_path / "run.json").write_text(json.dumps(record))
    status, led = _get(dashboard.url + "api/ledger")
    assert led["file"] == {"trained": 8, "dropped": 3} and led["step"] == 2
    assert led["latest"]["dropped.stale"] == 3.0 and led["latest"]["trained"] == 8.0
    status, run = _get(dashboard.url + "api/run")
    assert run["summary"] == {
        "run": {"name": "r", "steps": 9, "mode": "async"},
        "engine": "e",
        "miles_core": "0.1.0",
    }
    (tmp_path / "run.json").write_text("{half")  # being rewritten: said, not a 500
    status, run = _get(dashboard.url + "api/run")
    assert status == 200 and run["error"] and run["summary"] == {}


def test_beyond_loopback_needs_the_api_key_and_the_api_then_requires_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(BindRefused, match=API_KEY_ENV):
        Dashboard(tmp_path, host="0.0.0.0")
    out = run_miles("dashboard", str(tmp_path), "--host", "10.1.2.3", timeout=60)
    assert out.returncode == 2 and "without an API key" in out.stderr, out.stderr
    out = run_miles("dashboard", str(tmp_path / "nowhere"), timeout=60)
    assert out.returncode == 2 and "RUN_DIR" in out.stderr, out.stderr

    monkeypatch.setenv(API_KEY_ENV, KEY)
    Dashboard(tmp_path, host="0.0.0.0")  # allowed with a key (not started: traffic stays local)
    with Dashboard(tmp_path) as dash:
        for path in ("api/metrics", "api/ledger", "api/run"):
            assert _get(dash.url + path)[0] == 401
            assert _get(dash.url + path, key="wrong")[0] == 401
            assert _get(dash.url + path, key=KEY)[0] == 200
        # the page and its script hold no run data: served, and the page takes the key from
        # its URL's fragment
        with urllib.request.urlopen(dash.url, timeout=30) as r:
            assert r.status == 200 and b"dashboard.js" in r.read()
        with urllib.request.urlopen(dash.url + "static/dashboard.js", timeout=30) as r:
            assert b"Authorization" in r.read()


# --- the rendered page -------------------------------------------------------------------------


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip(
            "host: no `chromium` on PATH (scripts/bootstrap.sh installs Debian's package where "
            "apt-get can)"
        )
    return path


def _render(browser: str, url: str, profile: Path) -> dict[str, Any]:
    """The page at ``url`` after a few seconds of its (virtual) time: the body's and every
    chart's and series' data attributes, and the cells of its tables."""
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=4000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    body = re.search(r"<body ([^>]*)>", dom)
    assert body is not None, dom[:2000]
    return {
        "body": dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1))),
        "charts": {
            m[0]: int(m[1]) for m in re.findall(r'data-chart="(\w+)" data-points="(\d+)"', dom)
        },
        "series": {
            m[0]: int(m[1])
            for m in re.findall(r'<path [^>]*data-key="([^"]+)" data-points="(\d+)"', dom)
        },
        "cells": dict(re.findall(r'<td data-key="([^"]+)">([^<]*)</td>', dom)),
        "errbars": re.findall(r'class="errbar" data-stderr="([0-9.]+)"', dom),
        "error": re.search(r'<span id="error">([^<]*)</span>', dom),
    }


def test_the_page_of_a_run_in_progress_updates_as_steps_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    browser = _chromium()
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the page sends the key of its URL's fragment
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    _append(metrics, _eval(0, 0.25, 40), *(_step(s) for s in range(1, 4)))
    with Dashboard(run) as dash:
        first = _render(browser, f"{dash.url}#key={KEY}", tmp_path / "profile")
        assert first["error"] is not None and first["error"].group(1) == ""
        assert first["body"]["rows"] == "4" and first["body"]["step"] == "3"
        assert first["charts"]["reward"] == 3 and first["charts"]["accuracy"] == 1
        assert first["charts"]["step_time"] == 3 and first["charts"]["queue"] == 3
        assert first["series"]["trainer/wait_s"] == 3 and first["charts"]["drops"] == 3
        assert "ledger/dropped.stale" not in first["series"]
        # binomial standard error of 0.25 on 40 held-out prompts
        assert first["errbars"] == [f"{(0.25 * 0.75 / 40) ** 0.5:.5f}"]
        assert first["cells"]["buffer/size"] == "3"

        # steps land (the queue fills, groups go stale and are dropped, an evaluation)
        _append(metrics, *(_step(s, queued=8.0, dropped=2) for s in range(4, 8)), _eval(7, 0.5, 40))
        second = _render(browser, f"{dash.url}#key={KEY}", tmp_path / "profile")
        assert second["body"]["rows"] == "9" and second["body"]["step"] == "7"
        assert second["charts"]["reward"] == 7 and second["charts"]["accuracy"] == 2
        assert second["charts"]["queue"] == 7 and second["charts"]["staleness"] == 7
        assert second["charts"]["throughput"] == 7 and second["charts"]["fractions"] == 7
        assert second["series"]["ledger/dropped.stale"] == 4
        assert second["cells"]["buffer/size"] == "8" and second["cells"]["weight_version"] == "7"
        assert second["cells"]["rollout/tokens_per_s"] == "107"

        # without the key in the fragment the page draws nothing and says why
        keyless = _render(browser, dash.url, tmp_path / "profile")
        assert keyless["body"]["rows"] == "0" and "401" in keyless["error"].group(1)


# --- the two commands ---------------------------------------------------------------------------


class _Lines:
    """A child process's stream read on a thread (so that it never blocks on a full pipe),
    searched for a line as it comes."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r} in:\n{''.join(self.lines)[-3000:]}"
                self._cond.wait(left)


def _miles(*args: str, site: Path | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [*MILES, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30)


def test_miles_dashboard_serves_a_run_folder_until_interrupted(tmp_path: Path) -> None:
    _append(tmp_path / "metrics.jsonl", _step(1), _step(2))
    proc = _miles("dashboard", str(tmp_path))
    try:
        url = _Lines(proc.stdout).wait_for(r"at (http://127\.0\.0\.1:\d+/)", 60).group(1)
        status, page = _get(url + "api/metrics")
        assert status == 200 and [r["step"] for r in page["rows"]] == [1, 2]
    finally:
        code = _stop(proc)
    assert code == 0  # Ctrl-C is the way it stops


def _train_config(tmp_path: Path, model: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(40)
        )
    )
    cfg = {
        "run": {"name": "dash", "output_dir": str(tmp_path / "runs"), "steps": 4},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 6},
        "eval": {"data": {"name": "jsonl", "path": str(data), "shuffle": False}, "limit": 6},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_miles_train_with_the_dashboard_shows_the_run_as_it_goes(
    tiny_qwen3_full_vocab: Path, reward_site: Path, tmp_path: Path
) -> None:
    browser = _chromium()
    config = _train_config(tmp_path, tiny_qwen3_full_vocab)
    proc = _miles("train", str(config), "--dashboard", site=reward_site)
    try:
        err = _Lines(proc.stderr)
        url = err.wait_for(r"dashboard of .* at (http://127\.0\.0\.1:\d+/)", 120).group(1)
        deadline = time.monotonic() + 300
        while _get(url + "api/metrics")[1]["total"] < 2:  # the first evaluation and step 1
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err.lines)[-3000:]
            time.sleep(0.5)
        page = _render(browser, url, tmp_path / "profile")
        assert proc.poll() is None, "the run ended before its page was read: make it longer"
        assert page["error"] is not None and page["error"].group(1) == ""
        assert page["charts"]["reward"] >= 1 and page["charts"]["accuracy"] >= 1
        assert page["charts"]["step_time"] >= 1 and page["charts"]["engines"] >= 1
        assert page["cells"]["engine/serving"] == "1"
        out, _ = proc.communicate(timeout=600)
    finally:
        _stop(proc)
    assert proc.returncode == 0, "".join(err.lines)[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 4


def test_the_run_dashboard_reads_the_file_the_jsonl_sink_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from miles_core.builtins.metric_sinks import JsonlSinkOptions
    from miles_core.config.schema import Selection
    from miles_core.dashboard.server import metrics_file_of

    def config(*sinks: Selection) -> Any:
        return SimpleNamespace(metrics=SimpleNamespace(sinks=list(sinks)))

    assert metrics_file_of(config()) == "metrics.jsonl"
    mine = Selection(name="jsonl", options=JsonlSinkOptions(filename="steps.jsonl"))
    assert metrics_file_of(config(Selection(name="stdout"), mine)) == "steps.jsonl"
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    _append(tmp_path / "steps.jsonl", _step(1))
    with Dashboard(tmp_path, metrics_file="steps.jsonl") as dash:
        assert [r["step"] for r in _get(dash.url + "api/metrics")[1]["rows"]] == [1]
