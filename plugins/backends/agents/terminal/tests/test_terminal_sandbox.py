"""The sandbox with real processes: every violation is stopped within its limit, recorded, and
leaves nothing behind; each isolation layer is checked alone; a missing one is refused."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_env_terminal import landlock
from miles_env_terminal.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, classify

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import assert_nothing_left, sandbox_or_skip

ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(wall_s=4, cpu_s=1, memory_mb=256, max_processes=16)
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with sandbox_or_skip(LIMITS) as sb:
        yield sb
    assert_nothing_left()


@pytest.fixture(autouse=True)
def _nothing_left_after() -> Iterator[None]:
    yield
    assert_nothing_left()


def test_mechanisms_reported(sandbox: Sandbox) -> None:
    m = sandbox.mechanisms
    assert m["filesystem"] and m["processes"]
    assert {"netns", "seccomp"} & set(m["network"])
    if ROOT:
        assert "dedicated-uid+rlimit-nproc" in m["processes"]
    r = sandbox.run("id -u; pwd")
    uid, cwd = r.stdout.split()
    assert cwd == sandbox.scratch
    if ROOT:
        assert int(uid) == sandbox.uid != 0


def test_scratch_is_writable_and_state_persists(sandbox: Sandbox) -> None:
    r = sandbox.run("mkdir -p d && echo hello > d/f && mv d/f g && cat g && rm -r d")
    assert (r.exit_code, r.stdout, r.violations) == (0, "hello\n", [])
    assert sandbox.run("cat g; rm g").stdout == "hello\n"
    assert sandbox.run("echo x > /dev/null && echo ok").stdout == "ok\n"


@pytest.mark.parametrize(
    "target",
    ["/tmp/miles_terminal_escape", str(HERE / "escape.txt"), str(Path.home() / "escape.txt")],
    ids=["tmp", "repo", "home"],
)
def test_write_outside_is_refused(sandbox: Sandbox, target: str) -> None:
    r = sandbox.run(f"echo pwned > {target}")
    assert r.exit_code != 0 and "outside_dir" in r.violations
    r = sandbox.run(f"python3 -c \"open('{target}', 'w').write('x')\"")
    assert r.exit_code != 0 and "outside_dir" in r.violations
    assert not os.path.exists(target)


def test_reading_outside_is_refused(sandbox: Sandbox) -> None:
    r = sandbox.run(f"cat {HERE / 'test_terminal_sandbox.py'}")
    assert r.exit_code != 0 and not r.stdout and "outside_dir" in r.violations
    # the system's programs stay usable
    assert sandbox.run("python3 -c 'import json; print(json.dumps([1]))'").stdout == "[1]\n"


@pytest.mark.parametrize("host", ["127.0.0.1", "1.1.1.1"])
def test_network_is_stopped(sandbox: Sandbox, host: str) -> None:
    code = f"import socket; socket.create_connection(('{host}', 80), timeout=2)"
    r = sandbox.run(f'python3 -c "{code}"')
    assert r.exit_code != 0 and "network" in r.violations
    assert r.duration_s < LIMITS.wall_s


def test_signals_cannot_reach_the_caller(sandbox: Sandbox) -> None:
    r = sandbox.run(f"kill -9 {os.getpid()}")
    assert r.exit_code != 0  # no such process (PID namespace) or not permitted
    assert Path(f"/proc/{os.getpid()}").exists()


def test_shell_fork_bomb_is_contained(sandbox: Sandbox) -> None:
    r = sandbox.run(":(){ :|:& };:; sleep 1; echo survived")
    assert "process_limit" in r.violations
    assert r.duration_s < LIMITS.wall_s + 2


def test_python_fork_loop_is_contained(sandbox: Sandbox) -> None:
    code = "import os, time\\nwhile True:\\n    os.fork()"
    r = sandbox.run(f"printf '{code}' > bomb.py && python3 bomb.py; rm -f bomb.py")
    assert "process_limit" in r.violations
    assert r.duration_s < LIMITS.wall_s + 2


def test_forked_sleepers_and_setsid_are_killed_at_the_end(sandbox: Sandbox) -> None:
    r = sandbox.run("setsid sleep 300 & nohup sleep 300 >/dev/null 2>&1 & (sleep 300 &); echo ok")
    assert r.stdout == "ok\n" and r.exit_code == 0
    # the autouse fixture checks /proc: nothing of the sandbox is alive


def test_infinite_loop_hits_the_cpu_limit(sandbox: Sandbox) -> None:
    r = sandbox.run("python3 -c 'while True: pass'")
    assert r.killed_reason == "cpu_time" and "cpu_time" in r.violations
    assert r.duration_s < LIMITS.wall_s + 2


def test_sleeping_forever_hits_the_wall_clock(sandbox: Sandbox) -> None:
    r = sandbox.run("sleep 600", timeout_s=1.5)
    assert r.timed_out and r.killed_reason == "timeout" and "timeout" in r.violations
    assert 1.4 < r.duration_s < 4.5


def test_memory_hog_is_stopped(sandbox: Sandbox) -> None:
    r = sandbox.run("python3 -c 'x = bytearray(1 << 30)'")
    assert r.exit_code != 0 and "memory" in r.violations


def test_output_is_capped(sandbox: Sandbox) -> None:
    r = sandbox.run("yes")
    assert r.truncated and r.killed_reason == "output_limit"
    assert len(r.stdout) <= LIMITS.max_output_bytes


def test_classify_reads_messages() -> None:
    assert classify("touch: cannot touch '/etc/x': Permission denied", 1, "/s") == ["outside_dir"]
    assert classify("bash: /s/sub/x: Permission denied", 1, "/s") == []
    assert classify("", 128 + 31, "/s") == ["network"]


# --- each layer alone, and refusal when none is left -----------------------------------------


def _alone(keep: set[str]) -> SandboxLimits:
    every = {
        "netns",
        "pidns",
        "userns",
        "uid",
        "landlock",
        "landlock-tcp",
        "seccomp",
        "rlimit-shared",
    }
    # process isolation for every user, and the root-only extras
    needed = {"uid", "userns", "pidns", "rlimit-shared", "cgroup", "tmpfs"}
    return SandboxLimits(
        wall_s=4, cpu_s=1, max_processes=16, disable_layers=sorted(every - keep - needed)
    )


@pytest.mark.parametrize("layer", ["netns", "seccomp"])
def test_network_layer_alone(layer: str) -> None:
    limits = _alone({layer, "landlock"})
    with sandbox_or_skip(limits) as sb:
        assert layer in sb.mechanisms["network"]
        for host in ("127.0.0.1", "1.1.1.1"):
            code = f"import socket; socket.create_connection(('{host}', 80), timeout=2)"
            r = sb.run(f'python3 -c "{code}"')
            assert r.exit_code != 0 and "network" in r.violations, r
    # the same connection works outside: the refusal came from the sandbox
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        socket.create_connection(srv.getsockname(), timeout=2).close()


@pytest.mark.skipif(landlock.abi_version() < 4, reason="host: Landlock ABI < 4 has no TCP rules")
def test_landlock_tcp_alone_refuses_connect() -> None:
    limits = _alone({"landlock", "landlock-tcp"}).model_copy(
        update={"allow_unisolated": ["network"]}
    )
    with Sandbox(limits) as sb:
        assert sb.mechanisms["network"] == ["landlock-tcp"]
        assert any("network is NOT isolated" in w for w in sb.warnings)
        code = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=2)"
        r = sb.run(f'python3 -c "{code}"')
        assert "PermissionError" in r.stderr


def test_missing_filesystem_isolation_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match="filesystem"):
        Sandbox(_alone({"netns", "seccomp"}))


def test_missing_network_isolation_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match="network"):
        Sandbox(_alone({"landlock"}))


@pytest.mark.skipif(not ROOT, reason="host: as root, process isolation needs the dedicated uid")
def test_missing_process_isolation_is_refused() -> None:
    limits = SandboxLimits(disable_layers=["uid", "cgroup"])
    with pytest.raises(SandboxUnavailable, match="processes"):
        Sandbox(limits)


def test_allowed_unisolated_runs_with_a_warning() -> None:
    limits = _alone({"netns", "seccomp"}).model_copy(update={"allow_unisolated": ["filesystem"]})
    with sandbox_or_skip(limits) as sb:
        assert sb.mechanisms["filesystem"] == []
        assert any("filesystem is NOT isolated" in w for w in sb.warnings)
        assert sb.run("echo ok").stdout == "ok\n"


# --- the cgroup and tmpfs extras (root) ------------------------------------------------------


@pytest.fixture(scope="module")
def cg_sandbox() -> Iterator[Sandbox]:
    limits = LIMITS.model_copy(update={"total_memory_mb": 200, "disk_mb": 8})
    with sandbox_or_skip(limits) as sb:
        if sb.cgroup is None:
            pytest.skip(f"host: no cgroup can be made here: {sb.warnings}")
        yield sb


def test_cgroup_bounds_memory_of_all_processes_together(cg_sandbox: Sandbox) -> None:
    # four processes of 120 MiB each: every one is under the per-process limit (256 MiB),
    # together they are over the group's 200 MiB
    hog = "x = bytearray(120 << 20); import time; time.sleep(1)"
    r = cg_sandbox.run(f"for i in 1 2 3 4; do python3 -c '{hog}' & done; wait")
    assert "memory" in r.violations, r
    assert r.duration_s < LIMITS.wall_s + 2


def test_cgroup_records_a_silent_fork_bomb(cg_sandbox: Sandbox) -> None:
    r = cg_sandbox.run("(:(){ :|:& };:) >/dev/null 2>&1; sleep 0.5")
    assert "process_limit" in r.violations and r.stderr == ""


def test_scratch_is_a_bounded_tmpfs(cg_sandbox: Sandbox) -> None:
    if cg_sandbox.mechanisms["disk"] != ["tmpfs"]:
        pytest.skip("host: no tmpfs here")
    r = cg_sandbox.run("head -c 32M /dev/zero > big; rm -f big")
    assert "disk_limit" in r.violations


def test_a_killed_caller_leaves_nothing_running() -> None:
    """The caller dies mid-command (SIGKILL, no cleanup of its own): the jail is told through
    the parent-death signal and still kills everything the command started."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import time

    script = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from miles_env_terminal.sandbox import Sandbox, SandboxLimits\n"
        "lim = SandboxLimits(wall_s=60, disable_layers=['cgroup', 'tmpfs'])\n"
        "sb = Sandbox(lim, base_dir=sys.argv[1])\n"
        "print('ready', flush=True)\n"
        "sb.run('setsid sleep 301.5 & sleep 301.5')\n"
    )
    paths = [str(HERE.parent), *sys.path]
    base = tempfile.mkdtemp(prefix="miles-terminal-test-")
    os.chmod(base, 0o711)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, base, *paths], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"

        def sleepers() -> list[int]:
            found = []
            for entry in os.listdir("/proc"):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as fh:
                        if fh.read() == b"sleep\x00301.5\x00":
                            found.append(int(entry))
                except (OSError, ValueError):
                    pass
            return found

        deadline = time.monotonic() + 10
        while len(sleepers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sleepers()) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while sleepers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleepers() == []
    finally:
        proc.kill()  # a no-op when the test got that far
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)  # the caller died before removing it


def test_without_namespaces_or_cgroup_everything_still_holds() -> None:
    """What a container without CAP_SYS_ADMIN (or a user without user namespaces) gets:
    seccomp for the network, the uid or a shared RLIMIT_NPROC for processes, and a child
    subreaper (plus kill-by-uid as root) to kill what a command leaves."""
    limits = LIMITS.model_copy(
        update={"disable_layers": ["netns", "pidns", "userns", "cgroup", "tmpfs"]}
    )
    with sandbox_or_skip(limits) as sb:
        assert sb.mechanisms["network"][-1] == "seccomp" and "netns" not in sb.mechanisms["network"]
        assert sb.mechanisms["cleanup"][0] == "subreaper"
        assert "process_limit" in sb.run(":(){ :|:& };:").violations
        code = "import socket; socket.create_connection(('127.0.0.1', 80))"
        assert sb.run(f'python3 -c "{code}"').killed_reason == "network"
        assert "outside_dir" in sb.run("touch /tmp/miles_terminal_nons").violations
        assert sb.run("setsid sleep 300 & (sleep 300 &); echo ok").stdout == "ok\n"
    assert not os.path.exists("/tmp/miles_terminal_nons")
