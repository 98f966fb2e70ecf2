"""The live dashboard: its JSON endpoints over a growing run folder (incremental, bounded,
malformed lines skipped and counted, missing files), the API key beyond loopback, and the page
itself rendered by headless Chromium while rows land (read back from the data attributes its
script writes)."""

from __future__ import annotations

import html
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

from miles_core.dashboard import traces as dash_traces
from miles_core.dashboard.reader import MAX_ROWS_PER_REQUEST
from miles_core.dashboard.server import BindRefused, Dashboard
from miles_core.dashboard.traces import TRACES_FILE, TracesIndex
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


def _stop(proc: subprocess.Popen[str], signum: int = signal.SIGINT) -> int:
    """One signal, then a wait: a second signal could land while the interpreter exits, after it
    gave the default actions back, and end it with that signal's status."""
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_miles_dashboard_serves_a_run_folder_until_interrupted(tmp_path: Path, signum: int) -> None:
    _append(tmp_path / "metrics.jsonl", _step(1), _step(2))
    proc = _miles("dashboard", str(tmp_path))
    try:
        url = _Lines(proc.stdout).wait_for(r"at (http://127\.0\.0\.1:\d+/)", 60).group(1)
        status, page = _get(url + "api/metrics")
        assert status == 200 and [r["step"] for r in page["rows"]] == [1, 2]
    finally:
        code = _stop(proc, signum)
    assert code == 0  # Ctrl-C (or SIGTERM) is the way it stops


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
    # the dashboard's own process ended with the run
    with pytest.raises(urllib.error.URLError):
        _get(url + "health")


def test_the_dashboard_process_beside_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``miles train --dashboard``'s server: a process of its own, started before the run
    makes its folder, stopped with it; one that cannot listen says why."""
    from miles_core.dashboard.process import DashboardProcess
    from miles_core.errors import MilesUserError

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    run = tmp_path / "not-yet"
    with DashboardProcess(run) as dash:
        assert dash.process is not None and dash.process.pid != os.getpid()
        status, page = _get(dash.url + "api/metrics")
        assert status == 200 and page["exists"] is False and page["rows"] == []
        run.mkdir()
        _append(run / "metrics.jsonl", _step(1))
        assert [r["step"] for r in _get(dash.url + "api/metrics")[1]["rows"]] == [1]
        port = int(dash.url.rsplit(":", 1)[1].strip("/"))
        # the same port again: the second cannot listen, and its error says so
        with pytest.raises(MilesUserError, match=f"cannot listen on 127.0.0.1:{port}"):
            DashboardProcess(run, port=port).start()
        child = dash.process
    assert child.returncode == 0  # SIGTERM ends it as Ctrl-C does
    with pytest.raises(urllib.error.URLError):
        _get(dash.url + "health")


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


# --- traces -------------------------------------------------------------------------------------


def _trace(
    step: int,
    group: int,
    sample: int,
    *,
    reward: float = 0.5,
    response: str = "ok",
    lp_d: list[float | None] | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A trace line as ``miles_core.runtime.traces`` writes it (five response tokens, the
    third not trained unless ``lp_d`` says otherwise)."""
    lp_e = [-0.5, -0.25, -1.0, -0.125, -2.0]
    d = lp_d if lp_d is not None else [0.01, -0.03, None, 0.02, 0.0]
    return {
        "step": step,
        "group": group,
        "sample": sample,
        "prompt": f"prompt of group {group}",
        "response": response,
        "reward": reward,
        "finish": "stop",
        "n": 5,
        "ids": [11, 12, 13, 14, 15],
        "mask": [0 if x is None else 1 for x in d],
        "lp_e": lp_e,
        "lp_t": [None if x is None else e + x for e, x in zip(lp_e, d, strict=True)],
        "lp_d": d,
        "ver": [step - 1] * 5,
        "cut": {"tokens": 0, "chars": 0},
        "dropped": 0,
        **more,
    }


def _append_traces(path: Path, *lines: dict[str, Any], raw: str = "") -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines) + raw)


def test_traces_are_indexed_incrementally_and_a_resumed_steps_later_block_wins(
    dashboard: Dashboard, tmp_path: Path
) -> None:
    url = dashboard.url + "api/traces"
    assert _get(url) == (200, {"exists": False, "steps": [], "malformed": 0})
    traces = tmp_path / TRACES_FILE
    _append_traces(traces, _trace(1, 0, 0), _trace(1, 0, 1), raw='{not json\n[1]\n{"step":"x"}\n')
    _append_traces(traces, _trace(2, 1, 0), _trace(2, 1, 1), raw='{"step":3,"gro')  # being written
    status, listing = _get(url)
    assert status == 200 and listing == {"exists": True, "steps": [1, 2], "malformed": 3}
    status, got = _get(f"{url}?step=2")
    assert status == 200 and got["step"] == 2 and got["truncated"] is False
    assert [(x["group"], x["sample"]) for x in got["lines"]] == [(1, 0), (1, 1)]
    assert got["lines"][0] == _trace(2, 1, 0) and got["steps"] == [1, 2]

    # the line completes and more land: only what is new is read
    _append_traces(traces, raw=json.dumps(_trace(3, 2, 0))[len('{"step": 3, "gro') :] + "\n")
    _append_traces(traces, _trace(3, 2, 1), _trace(4, 3, 0))
    assert _get(url)[1]["steps"] == [1, 2, 3, 4]
    assert [x["sample"] for x in _get(f"{url}?step=3")[1]["lines"]] == [0, 1]

    # a resumed run appends steps 3 (right after the step 4 it wrote) and 4 (right after the
    # step 4 of the first run: the same groups again) and 4 again: the later block counts
    _append_traces(traces, _trace(3, 2, 0, reward=1.0), _trace(4, 3, 0, reward=1.0))
    _append_traces(traces, _trace(4, 3, 0, reward=-1.0), _trace(4, 3, 1, reward=-1.0))
    assert _get(url)[1]["steps"] == [1, 2, 3, 4]
    assert [x["reward"] for x in _get(f"{url}?step=3")[1]["lines"]] == [1.0]
    assert [x["reward"] for x in _get(f"{url}?step=4")[1]["lines"]] == [-1.0, -1.0]

    # a step not traced, a bad step
    status, body = _get(f"{url}?step=9")
    assert status == 404 and "step 9 is not traced" in body["error"], body
    for bad in ("x", "1.5", "", "-1"):
        status, body = _get(f"{url}?step={bad}")
        assert status == 400 and "'step'" in body["error"], body

    # a new file in its place (an earlier run moved aside): indexed again from its start
    moved = tmp_path / "traces.new"
    _append_traces(moved, *(_trace(s, s, 0) for s in (7, 8)))
    os.replace(moved, traces)
    assert _get(url)[1] == {"exists": True, "steps": [7, 8], "malformed": 0}
    assert _get(f"{url}?step=2")[0] == 404


def test_a_traced_steps_lines_are_read_up_to_the_byte_cap(
    dashboard: Dashboard, tmp_path: Path
) -> None:
    traces = tmp_path / TRACES_FILE
    big = "x" * (1 << 20)  # six lines of over 1 MiB each: three fit in 4 MiB
    _append_traces(traces, *(_trace(5, 0, i, response=big) for i in range(6)), _trace(6, 1, 0))
    status, got = _get(dashboard.url + "api/traces?step=5")
    assert status == 200 and got["truncated"] is True
    assert [x["sample"] for x in got["lines"]] == [0, 1, 2] and got["lines"][2]["response"] == big
    assert sum(len(json.dumps(x, separators=(",", ":"))) + 1 for x in got["lines"]) <= (4 << 20)
    status, got = _get(dashboard.url + "api/traces?step=6")
    assert status == 200 and got["truncated"] is False and len(got["lines"]) == 1


def test_the_traces_index_keeps_byte_ranges_of_the_newest_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dash_traces, "MAX_STEPS", 3)
    monkeypatch.setattr(dash_traces, "MAX_BYTES_PER_READ", 256)  # a line spans reads
    monkeypatch.setattr(dash_traces, "MAX_LINE_BYTES", 600)  # a longer one is skipped
    path = tmp_path / TRACES_FILE
    index = TracesIndex(path)
    assert index.listing() == {"exists": False, "steps": [], "malformed": 0}
    _append_traces(path, _trace(1, 0, 0), _trace(1, 0, 1), raw="z" * 700 + "\n")
    _append_traces(path, _trace(2, 1, 0))
    assert index.listing() == {"exists": True, "steps": [1, 2], "malformed": 1}
    data = path.read_bytes()
    first = data.index(b"\n", data.index(b"\n") + 1) + 1  # step 1's two lines, one range
    assert index.steps[1] == [(0, first)]
    assert index.steps[2] == [(data.rindex(b"\n", 0, len(data) - 1) + 1, len(data))]
    # what is kept is the index, not the lines
    assert all(
        isinstance(a, int) and isinstance(b, int) for r in index.steps.values() for a, b in r
    )

    _append_traces(path, *(_trace(s, s, 0) for s in (3, 4, 5)))
    assert index.listing()["steps"] == [3, 4, 5] and index.step(1) is None
    got = index.step(4)
    assert got is not None and got["lines"] == [_trace(4, 4, 0)]
    # an older step landing after the newest ones is kept only if it is among the newest
    _append_traces(path, _trace(2, 9, 0))
    assert index.listing()["steps"] == [3, 4, 5]
    with pytest.raises(ValueError, match="NaN"):
        dash_traces._reject_constant("NaN")
    _append_traces(path, raw='{"step":6,"reward":NaN}\n')  # not JSON: skipped, counted
    assert index.listing() == {"exists": True, "steps": [3, 4, 5], "malformed": 2}


def test_the_dashboard_serves_the_lines_the_run_writes(
    dashboard: Dashboard, tmp_path: Path
) -> None:
    from miles_core.config import TracesSection
    from miles_core.data import Group, Sample
    from miles_core.runtime.traces import FILE_NAME, Traces

    assert FILE_NAME == TRACES_FILE

    def group(reward: float) -> Group:
        s = Sample(prompt_ids=[1, 2, 3])
        s.append([10, 11, 12], logprobs=[-0.5, -0.25, -1.0], version=3)
        s.trainer_logprobs = [-0.5, -0.5, -1.0]
        s.reward = reward
        s.metadata["response_text"] = "<b>hi</b>"
        return Group(samples=[s, s], prompt={"prompt": "p"})

    groups = [group(0.25)]
    writer = Traces(TracesSection(), tmp_path)
    for step in (1, 2):
        writer.write(step, groups, None, print)
    groups[0].samples[0].reward = 1.0
    writer.write(2, groups, None, print)  # resumed: the same groups again
    written = [json.loads(x) for x in (tmp_path / FILE_NAME).read_text().splitlines()]
    status, got = _get(dashboard.url + "api/traces?step=2")
    assert status == 200 and got["steps"] == [1, 2] and got["malformed"] == 0
    assert got["lines"] == written[-2:] and got["lines"][0]["reward"] == 1.0
    assert got["lines"][0]["lp_d"] == [0.0, -0.25, 0.0]


def test_the_traces_endpoint_requires_the_api_key_with_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    _append_traces(tmp_path / TRACES_FILE, _trace(1, 0, 0))
    with Dashboard(tmp_path) as dash:
        for path in ("api/traces", "api/traces?step=1"):
            assert _get(dash.url + path)[0] == 401
            assert _get(dash.url + path, key="wrong")[0] == 401
            assert _get(dash.url + path, key=KEY)[0] == 200


def _render_traces(browser: str, url: str, profile: Path, budget_ms: int) -> dict[str, Any]:
    """The page at ``url`` after ``budget_ms`` of its (virtual) time: its traces panel (the
    body's ``data-trace-*``, the samples' cells, the trace charts) and the whole DOM."""
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
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
    table = re.search(r'<table id="trace-samples"[^>]*>(.*?)</table>', dom, re.S)
    assert table is not None, dom[-3000:]
    return {
        "body": dict(re.findall(r'data-(trace-[a-z]+)="([^"]*)"', body.group(1))),
        "rows": [
            re.findall(r"<td>([^<]*)</td>", m)
            for m in re.findall(r'<tr data-sample="\d+"[^>]*>(.*?)</tr>', table.group(1))
        ],
        "selected": re.findall(r'<tr data-sample="(\d+)" class="selected">', table.group(1)),
        "charts": {
            m[0]: int(m[1])
            for m in re.findall(r'data-chart="(trace_\w+)" data-points="(\d+)"', dom)
        },
        "error": re.search(r'<span id="error">([^<]*)</span>', dom),
        "dom": dom,
    }


def test_the_traces_panel_follows_the_newest_step_and_shows_trace_text_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    browser = _chromium()
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    calls = {"listing": 0, "step": 0}
    listing, step = TracesIndex.listing, TracesIndex.step

    def counted_listing(self: TracesIndex) -> dict[str, Any]:
        calls["listing"] += 1
        return listing(self)

    def counted_step(self: TracesIndex, n: int) -> dict[str, Any] | None:
        calls["step"] += 1
        return step(self, n)

    monkeypatch.setattr(TracesIndex, "listing", counted_listing)
    monkeypatch.setattr(TracesIndex, "step", counted_step)
    run = tmp_path / "run"
    run.mkdir()
    traces = run / TRACES_FILE
    attack = "<img src=x onerror=alert(1)>"
    _append_traces(traces, _trace(1, 0, 0), _trace(1, 0, 1))
    _append_traces(
        traces,
        _trace(2, 1, 0, response=f"answer {attack}", reward=0.75),
        _trace(2, 1, 1, lp_d=[0.5, None, None, -0.25, 0.125]),
        _trace(2, 1, 2),
    )
    with Dashboard(run) as dash:
        first = _render_traces(browser, dash.url, tmp_path / "profile", 12000)
        assert first["error"] is not None and first["error"].group(1) == ""
        body = first["body"]
        assert body["trace-step"] == "2" and body["trace-steps"] == "2"
        assert body["trace-samples"] == "3" and body["trace-sample"] == "0"
        assert first["selected"] == ["0"]
        # group, sample, reward, finish, tokens, mean |lp_d| and max |lp_d| (trained), turns
        assert first["rows"][0] == ["1", "0", "0.750", "stop", "5", "0.015", "0.030", "–"]
        assert first["rows"][1][5:7] == ["0.292", "0.500"]
        # the first sample: four trained tokens of five in lp_d, five in lp_e and lp_t
        assert first["charts"] == {"trace_lp": 5, "trace_lp_d": 4}
        assert f"answer {html.escape(attack, quote=False)}" in first["dom"]
        assert "<img" not in first["dom"] and "prompt of group 1" in first["dom"]
        # 12 s of the page's time: the steps polled every 5 s, the lines fetched once
        assert calls == {"listing": 3, "step": 1}, calls

        # a third step lands, an agent episode: the panel follows it
        episode = _trace(
            3,
            2,
            0,
            turns=[0, 1],
            turn_rewards=[0.0, 1.0],
            messages=[
                {"role": "user", "content": "list files <script>alert(2)</script>"},
                {"role": "assistant", "content": "", "tool_calls": '[{"name": "ls"}]'},
            ],
        )
        _append_traces(traces, episode, _trace(3, 2, 1))
        second = _render_traces(browser, dash.url, tmp_path / "profile", 4000)
        body = second["body"]
        assert body["trace-step"] == "3" and body["trace-steps"] == "3"
        assert body["trace-samples"] == "2" and second["rows"][0][7] == "2"
        assert "user: </b>list files &lt;script&gt;alert(2)&lt;/script&gt;" in second["dom"]
        assert (
            'tool calls: [{"name": "ls"}]' in second["dom"] and "<script>alert" not in second["dom"]
        )
        assert "turn rewards" in second["dom"] and second["charts"]["trace_lp_d"] == 4
