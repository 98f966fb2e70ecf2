"""Servers forked from a fork server that imported their module once
(:class:`miles_core.forks.ForkedServer`): a real fork server process and real forks, each
answering as the ``subprocess.Popen`` of ``python -m module ARGS`` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.forks import ForkedServer, ForkServerError

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="host: needs /proc")

# Its import is counted (a line in IMPORTS); main() reports what the fork sees, then does what
# its first argument says.
SERVER = """
import json, os, sys, time

with open(os.environ["MILES_FORK_IMPORTS"], "a") as f:
    f.write("imported\\n")


def main(argv):
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().rstrip(b"\\0").decode()
    print(json.dumps({
        "argv": argv, "sys_argv": sys.argv, "mark": os.environ.get("MILES_FORK_MARK"),
        "session": os.getsid(0) == os.getpid(), "title": title,
        "stdin": sys.stdin.read(),
    }), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if argv[0] == "exit":
        raise SystemExit(int(argv[1]))
    if argv[0] == "refuse":
        raise SystemExit("--flag: not allowed")
    if argv[0] == "raise":
        raise ValueError("broken")
    if argv[0] == "sleep":
        time.sleep(300)
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A server module of its own name on the fork server's path (PYTHONPATH: the server is a
    new process), its imports counted."""
    name = f"miles_fork_toy_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MILES_FORK_IMPORTS", str(tmp_path / "imports.txt"))
    yield name


def _report(log: Path) -> dict[str, object]:
    import json

    lines = log.read_text().splitlines()
    assert lines[1] == "to stderr", lines
    return dict(json.loads(lines[0]))


def test_forks_run_main_as_the_command_would(
    module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a Ray worker: the title still gets the room of the server's environment.
    monkeypatch.setenv("SPT_NOENV", "1")
    first = ForkedServer(module, ["exit", "0"], str(tmp_path / "a.log"))
    assert first.wait(timeout=60) == 0 and first.returncode == 0 and first.poll() == 0
    seen = _report(tmp_path / "a.log")
    assert seen["argv"] == ["exit", "0"] and seen["sys_argv"] == [module, "exit", "0"]
    assert seen["session"] is True and seen["stdin"] == "" and seen["mark"] is None
    assert seen["title"] == f"{sys.executable} -m {module} exit 0"
    assert first.args == [sys.executable, "-m", module, "exit", "0"]

    # A variable set after the fork server started reaches the next fork; the module was
    # imported once, by the server.
    monkeypatch.setenv("MILES_FORK_MARK", "later")
    second = ForkedServer(module, ["exit", "7"], str(tmp_path / "b.log"))
    assert second.wait(timeout=60) == 7
    assert _report(tmp_path / "b.log")["mark"] == "later"
    assert (tmp_path / "imports.txt").read_text() == "imported\n"
    assert second.pid != first.pid


def test_exit_codes_and_signals(module: str, tmp_path: Path) -> None:
    refused = ForkedServer(module, ["refuse"], str(tmp_path / "r.log"))
    assert refused.wait(timeout=60) == 1
    assert "--flag: not allowed" in (tmp_path / "r.log").read_text()
    failed = ForkedServer(module, ["raise"], str(tmp_path / "f.log"))
    assert failed.wait(timeout=60) == 1
    assert "ValueError: broken" in (tmp_path / "f.log").read_text()

    sleeper = ForkedServer(module, ["sleep"], str(tmp_path / "s.log"))
    try:
        assert sleeper.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.3)
        sleeper.terminate()
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
        sleeper.kill()  # ended: nothing is sent to a pid that may be another's by now
    finally:
        if sleeper.poll() is None:
            os.kill(sleeper.pid, signal.SIGKILL)
    killed = ForkedServer(module, ["sleep"], str(tmp_path / "k.log"))
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL


def test_a_module_the_server_cannot_import(tmp_path: Path) -> None:
    with pytest.raises(ForkServerError, match="could not import miles_no_such_module"):
        ForkedServer("miles_no_such_module", [], str(tmp_path / "x.log"))
