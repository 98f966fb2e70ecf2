"""Ways out of the sandbox that its first tests missed, each tried for real against a listener
or a file the test itself leaves on the host: a pathname unix socket in a folder the sandbox
can traverse, the host's ``/dev`` (``/dev/shm``), and a write past the per-file size limit that
was stopped but not recorded. Ordinary commands must keep working meanwhile."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_env_terminal import landlock, seccomp
from miles_env_terminal.sandbox import DEFAULT_DEVICES, Sandbox, SandboxLimits

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import assert_nothing_left, sandbox_or_skip

LIMITS = SandboxLimits(wall_s=6, cpu_s=2, memory_mb=256, max_processes=16, max_file_mb=1)

pytestmark = [
    pytest.mark.skipif(landlock.abi_version() < 1, reason="host: no Landlock in this kernel"),
    pytest.mark.skipif(not seccomp.supported(), reason="host: no seccomp table for this CPU"),
]


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with sandbox_or_skip(LIMITS) as sb:
        yield sb
    assert_nothing_left()


@pytest.fixture(autouse=True)
def _nothing_left_after() -> Iterator[None]:
    yield
    assert_nothing_left()


@contextlib.contextmanager
def _host_socket(where: str, kind: socket.SocketKind) -> Iterator[tuple[str, socket.socket]]:
    """A unix socket of the host, world-connectable, in a folder anyone traverses."""
    folder = tempfile.mkdtemp(
        prefix="miles-escape-", dir="/dev/shm" if where == "dev-shm" else "/tmp"
    )
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "x.sock")
    srv = socket.socket(socket.AF_UNIX, kind)
    try:
        srv.bind(path)
        os.chmod(path, 0o777)  # the sandbox's uid may connect as far as permissions go
        if kind == socket.SOCK_STREAM:
            srv.listen(8)
        srv.setblocking(False)
        yield path, srv
    finally:
        srv.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["dev-shm", "tmp"])
def listener(request: pytest.FixtureRequest) -> Iterator[tuple[str, socket.socket]]:
    """A unix stream listener of the host."""
    with _host_socket(request.param, socket.SOCK_STREAM) as found:
        yield found


def _assert_no_connection(srv: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        conn, _ = srv.accept()
        conn.close()


def test_the_listener_is_reachable_from_outside(listener: tuple[str, socket.socket]) -> None:
    """The refusals below come from the sandbox: the same connect works on the host."""
    path, srv = listener
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(path)
        conn, _ = srv.accept()
        conn.close()


@pytest.mark.parametrize(
    "code",
    [
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect({p!r}); s.sendall(b'x')",
        "import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | "
        "socket.SOCK_NONBLOCK); s.connect({p!r})",
    ],
    ids=["socket", "nonblocking"],
)
def test_unix_socket_connect_is_refused_and_recorded(
    sandbox: Sandbox, listener: tuple[str, socket.socket], code: str
) -> None:
    path, srv = listener
    r = sandbox.run(f'python3 -c "{code.format(p=path)}"')
    assert r.exit_code != 0 and "network" in r.violations, r
    _assert_no_connection(srv)


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', {p!r})",
        # a datagram pair is connected to itself, but sendto may name another destination
        "import socket; a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM); "
        "a.sendto(b'x', {p!r})",
    ],
    ids=["socket", "pair"],
)
def test_unix_datagram_to_a_host_socket_is_refused_and_recorded(
    sandbox: Sandbox, code: str
) -> None:
    with _host_socket("tmp", socket.SOCK_DGRAM) as (path, srv):
        r = sandbox.run(f'python3 -c "{code.format(p=path)}"')
        assert r.exit_code != 0 and "network" in r.violations, r
        with pytest.raises(BlockingIOError):
            srv.recv(16)


def test_unix_socket_refusal_is_recorded_even_when_silent(
    sandbox: Sandbox, listener: tuple[str, socket.socket]
) -> None:
    """The process is killed (SIGSYS): recorded from the exit status, whatever it prints."""
    path, srv = listener
    code = f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"
    r = sandbox.run(f'exec python3 -c "{code}" 2>/dev/null')
    assert r.killed_reason == "network" and "network" in r.violations, r
    _assert_no_connection(srv)


def test_dev_cannot_be_listed(sandbox: Sandbox) -> None:
    r = sandbox.run("ls /dev")
    assert r.exit_code != 0 and r.stdout == "" and "outside_dir" in r.violations, r
    assert "shm" not in r.stdout
    r = sandbox.run("python3 -c \"import os; print(os.listdir('/dev'))\"")
    assert r.exit_code != 0 and "shm" not in r.stdout and "outside_dir" in r.violations, r
    # the allowed devices, and only those, can be opened
    for dev in DEFAULT_DEVICES:
        if dev != "/dev/tty" and os.path.exists(dev):  # no controlling terminal inside
            # an open, not test -r: access(2) checks permissions only, not Landlock
            assert sandbox.run(f"exec 3<>{dev}").exit_code == 0, dev
    for dev in ("/dev/kmsg", "/dev/ptmx", "/dev/shm"):
        if os.path.exists(dev):
            r = sandbox.run(f"exec 3<{dev}")
            assert r.exit_code != 0 and "outside_dir" in r.violations, (dev, r)


def test_dev_shm_files_cannot_be_read(sandbox: Sandbox) -> None:
    secret = secrets.token_hex(16)
    fd, path = tempfile.mkstemp(prefix="miles-secret-", dir="/dev/shm")
    try:
        os.write(fd, secret.encode())
        os.close(fd)
        os.chmod(path, 0o644)  # world-readable: only the sandbox's own rules keep it out
        for command in (
            "ls /dev/shm",
            f"cat {path}",
            f"python3 -c \"print(open('{path}').read())\"",
            f"cat /proc/self/root{path}",
        ):
            r = sandbox.run(command)
            assert r.exit_code != 0, (command, r)
            assert secret not in r.stdout + r.stderr
            assert os.path.basename(path) not in r.stdout, (command, r)
            assert "outside_dir" in r.violations, (command, r)
    finally:
        os.unlink(path)


@pytest.mark.parametrize(
    "command",
    [
        "head -c 2M /dev/zero > big",  # the shell execs head: killed by SIGXFSZ, silently
        "python3 -c \"open('big', 'wb').write(bytes(2 << 20))\"",  # Python ignores SIGXFSZ
    ],
    ids=["head", "python"],
)
def test_a_write_over_the_file_limit_is_recorded(sandbox: Sandbox, command: str) -> None:
    r = sandbox.run(command)
    assert "disk_limit" in r.violations, r
    assert os.path.getsize(os.path.join(sandbox.scratch, "big")) <= LIMITS.max_file_mb << 20
    sandbox.run("rm -f big")


def test_a_write_under_the_file_limit_is_not_a_violation(sandbox: Sandbox) -> None:
    r = sandbox.run("head -c 512K /dev/zero > f && wc -c < f && rm f")
    assert (r.exit_code, r.stdout.strip(), r.violations) == (0, "524288", [])


@pytest.mark.parametrize(
    ("command", "stdout"),
    [
        ("echo hi", "hi\n"),
        ("python3 -c 'print(6 * 7)'", "42\n"),
        ("echo a b c | tr ' ' '\\n' | sort -r | head -1", "c\n"),
        ("echo x > /dev/null && echo ok 2>/dev/null", "ok\n"),
        ("echo hi | cat /dev/stdin", "hi\n"),
        ("cat <(echo sub)", "sub\n"),
        ("echo hi | (cat /dev/fd/0)", "hi\n"),
        ("head -c 8 /dev/urandom | wc -c", "8\n"),
        ("touch f && ls -l f | cut -c1; rm f", "-\n"),
        (
            "python3 -c 'import asyncio; print(asyncio.run(asyncio.sleep(0, 5)))'",
            "5\n",
        ),
        ("printf 'print(1)' > s.py && python3 s.py < /dev/null; rm s.py", "1\n"),
    ],
)
def test_ordinary_commands_still_work(sandbox: Sandbox, command: str, stdout: str) -> None:
    r = sandbox.run(command)
    assert (r.exit_code, r.stdout, r.violations) == (0, stdout, []), r


def test_without_seccomp_the_unix_socket_gap_is_named() -> None:
    """A sandbox without seccomp still runs (the network namespace isolates TCP/UDP), but its
    warnings say that pathname unix sockets stay reachable."""
    limits = LIMITS.model_copy(update={"disable_layers": ["seccomp"]})
    with sandbox_or_skip(limits) as sb:
        assert "seccomp" not in sb.mechanisms["network"]
        assert any("unix sockets" in w for w in sb.warnings), sb.warnings


@pytest.mark.parametrize("folder", ["/", "/dev", "/dev/shm", "/dev/../dev/"])
def test_a_readable_folder_that_exposes_dev_is_refused(folder: str) -> None:
    with pytest.raises(ValueError, match="would expose /dev"):
        SandboxLimits(readable=["/usr", folder])
