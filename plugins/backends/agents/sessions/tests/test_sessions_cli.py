"""The command line: a family without a gate certificate is refused; with one, the server
starts on loopback and answers; binding beyond loopback without a token is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx


def _env(cert_dir: Path) -> dict[str, str]:
    return {**os.environ, "MILES_CERT_DIR": str(cert_dir)}


def test_sessions_cli(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "miles_sessions.server", "--engine-url", "http://127.0.0.1:9"]
    refused = subprocess.run(
        [*cmd, "--family", "qwen3"], env=_env(tmp_path), capture_output=True, text=True
    )
    assert refused.returncode != 0 and "not_verified" in refused.stderr
    assert "miles family verify qwen3" in refused.stderr

    from miles_modelfamilies.qwen3 import build

    from miles_core.families import verify_family

    assert verify_family(build(), certificate_dir=tmp_path).passed

    public = subprocess.run(
        [*cmd, "--family", "qwen3", "--host", "0.0.0.0"],
        env={k: v for k, v in _env(tmp_path).items() if k != "MILES_SESSIONS_TOKEN"},
        capture_output=True,
        text=True,
    )
    assert public.returncode != 0 and "without a token" in public.stderr

    proc = subprocess.Popen(
        [*cmd, "--family", "qwen3"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.rsplit(" ", 1)[1].strip()
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        created = httpx.post(f"{url}/sessions", json={"mode": "branching"}).json()
        assert created["mode"] == "branching" and created["family"] == "qwen3"
        listed = httpx.get(f"{url}/sessions").json()["sessions"]
        assert [s["id"] for s in listed] == [created["id"]]
        # The engine is unreachable: a clear 502, not a crash.
        r = httpx.post(
            f"{url}{created['base_url']}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert r.status_code == 502 and "engine" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(10)
