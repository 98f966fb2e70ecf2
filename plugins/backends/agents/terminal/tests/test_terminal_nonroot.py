"""The non-root paths, run for real as an unprivileged user (``nobody``, via ``setpriv``) when
the tests run as root; when they do not run as root the other test files cover them directly.

Two configurations: with an unprivileged user namespace (network, PID and mount namespaces,
RLIMIT_NPROC counted in the namespace) and without one (seccomp for the network, RLIMIT_NPROC
shared with the user's other processes, a child subreaper to kill what the command left)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NOBODY = 65534


def _python_for_nobody() -> tuple[str, dict[str, str]] | None:
    """An interpreter the unprivileged user can run, with the paths it needs."""
    import pydantic

    import miles_core

    paths = [
        str(HERE.parent),
        str(Path(miles_core.__file__).parent.parent),
        str(Path(pydantic.__file__).parent.parent),
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(paths)}
    for python in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3"):
        if not python:
            continue
        probe = subprocess.run(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                python,
                "-c",
                "import pydantic, miles_env_terminal.sandbox, subprocess, sys; "
                "subprocess.run([sys.executable, '-c', '0'], check=True)",
            ],
            env=env,
            capture_output=True,
            timeout=60,
            cwd="/",
        )
        if probe.returncode == 0:
            return python, env
    return None


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="host: needs root to switch to an unprivileged user",
)


@pytest.fixture(scope="module")
def runner() -> tuple[str, dict[str, str]]:
    found = _python_for_nobody()
    if found is None:
        pytest.skip("host: no interpreter the unprivileged user can run with pydantic importable")
    return found


def _probe(runner: tuple[str, dict[str, str]], disabled: list[str]) -> dict:  # type: ignore[type-arg]
    python, env = runner
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            python,
            str(HERE / "terminal_nonroot_probe.py"),
            json.dumps(disabled),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    if proc.returncode != 0 and "user namespace unavailable" in proc.stderr:
        pytest.skip("host: unprivileged user namespaces are not allowed here")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def _check_common(out: dict) -> None:  # type: ignore[type-arg]
    assert out["uid"] == NOBODY
    assert "process_limit" in out["bomb"]["violations"]
    assert "process_limit" in out["pyfork"]["violations"]
    assert "network" in out["network"]["violations"]
    assert "outside_dir" in out["outside"]["violations"] and not out["escaped"]
    assert out["kill_caller"]["exit"] != 0
    assert out["background"]["stdout"] == "ok\n"
    assert out["ok"] == {"exit": 0, "violations": [], "stdout": "hi\n"}
    assert "network" in out["unix"]["violations"] and not out["unix_connected"]
    assert out["dev"]["exit"] != 0 and "outside_dir" in out["dev"]["violations"]
    assert out["left"] == [], out["left"]


@pytest.mark.slow
def test_unprivileged_with_user_namespace(runner) -> None:  # type: ignore[no-untyped-def]
    out = _probe(runner, [])
    if "userns+rlimit-nproc" not in out["mechanisms"]["processes"]:
        pytest.skip(f"host: no unprivileged user namespace here: {out['warnings']}")
    assert "netns" in out["mechanisms"]["network"]
    assert out["mechanisms"]["cleanup"] == ["pidns"]
    _check_common(out)


@pytest.mark.slow
def test_unprivileged_without_namespaces(runner) -> None:  # type: ignore[no-untyped-def]
    out = _probe(runner, ["userns"])
    assert out["mechanisms"]["processes"] == ["rlimit-nproc-shared"]
    assert out["mechanisms"]["network"][-1] == "seccomp"
    assert out["mechanisms"]["cleanup"] == ["subreaper"]
    assert any("shares RLIMIT_NPROC" in w for w in out["warnings"])
    _check_common(out)
