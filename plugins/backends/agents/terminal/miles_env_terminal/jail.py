"""The process that runs one sandboxed command: ``python -m miles_env_terminal.jail <json>``.

It is started by :class:`miles_env_terminal.sandbox.Sandbox` and works in three levels:

* the **supervisor** (this process) enters new namespaces where it can (user, network,
  mount + PID), enforces the wall-clock limit, and at the end kills every process the command
  left behind, then reports a JSON status on the file descriptor named in its config;
* with a PID namespace, an **init** (PID 1 of the namespace) mounts a private ``/proc``, reaps
  orphans and exits with the command's status; its exit makes the kernel kill everything
  left in the namespace;
* the **command** process applies the limits that cannot be undone (rlimits, the dedicated
  uid, ``no_new_privs``, Landlock, seccomp) and execs the shell. If a required property
  ended up with no working mechanism, it refuses (exit 125) before running anything.

Only the standard library and the two sibling modules are imported: this runs for every command.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
from typing import Any, NoReturn

from miles_env_terminal import landlock, seccomp

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
REFUSED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _enter_namespaces(cfg: dict[str, Any], status: dict[str, Any]) -> dict[str, bool]:
    """Enter what namespaces we can; record each failure as a warning."""
    layers = set(cfg["layers"])
    got = {"userns": False, "netns": False, "pidns": False}
    root = os.geteuid() == 0
    if not root and layers & {"netns", "pidns"} and "userns" in layers:
        uid, gid = os.getuid(), os.getgid()
        try:
            _unshare(_CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            # map ourselves to ourselves: same uid inside, but with capabilities over the
            # new namespaces, and RLIMIT_NPROC counted within this namespace only
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
            got["userns"] = True
        except OSError as exc:
            status["warnings"].append(f"user namespace unavailable: {exc}")
    if "netns" in layers:
        try:
            _unshare(_CLONE_NEWNET)
            got["netns"] = True
        except OSError as exc:
            status["warnings"].append(f"network namespace unavailable: {exc}")
    if "pidns" in layers:
        try:
            _unshare(_CLONE_NEWPID | _CLONE_NEWNS)
            got["pidns"] = True
        except OSError as exc:
            status["warnings"].append(f"PID/mount namespace unavailable: {exc}")
    return got


def _count_processes_of(uid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _refuse(report_fd: int, message: str) -> NoReturn:
    """Report that the command will not run and exit before running anything."""
    os.write(report_fd, json.dumps({"refused": message}).encode() + b"\n")
    os._exit(REFUSED)


def _join_cgroup(cfg: dict[str, Any], applied: dict[str, list[str]], warnings: list[str]) -> None:
    """Move this process into the sandbox's cgroup (its children follow)."""
    if not cfg["cgroup_procs"]:
        return
    try:
        for procs in cfg["cgroup_procs"]:
            _write(procs, "0")  # "0" is the writing process, in any PID namespace
        applied["processes"].append("cgroup-pids")
        applied["memory"].append("cgroup-memory")
    except OSError as exc:
        warnings.append(f"could not join the cgroup: {exc}")


def _set_resource_limits(cfg: dict[str, Any]) -> None:
    """Address space, file size, core dumps, open files and CPU time, never above a hard
    limit already in place."""
    for limit, soft, hard in (
        (resource.RLIMIT_AS, cfg["memory_bytes"], cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["max_file_bytes"], cfg["max_file_bytes"]),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, 256, 256),
        (resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),
    ):
        _, current = resource.getrlimit(limit)
        if current != resource.RLIM_INFINITY:  # a non-root user cannot raise a hard limit
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(limit, (soft, hard))


def _limit_processes(
    cfg: dict[str, Any],
    got: dict[str, bool],
    applied: dict[str, list[str]],
    warnings: list[str],
) -> None:
    """Bound the processes alive at once (RLIMIT_NPROC), dropping to the dedicated uid when
    there is one."""
    nproc = cfg["max_processes"]
    if "cgroup-pids" in applied["processes"]:
        # the cgroup must be the limit that trips first: its counter is what records it
        nproc += 2
    uid = cfg.get("uid")
    if uid is not None:
        # a dedicated uid: RLIMIT_NPROC counts only this sandbox's processes (root is exempt
        # from the limit, so it only works after dropping to the uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(uid)
        applied["processes"].append("dedicated-uid+rlimit-nproc")
    elif got["userns"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        applied["processes"].append("userns+rlimit-nproc")
    elif os.geteuid() != 0 and "rlimit-shared" in cfg["layers"]:
        # without a namespace of our own the count includes the user's other processes
        base = _count_processes_of(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (base + nproc, base + nproc))
        applied["processes"].append("rlimit-nproc-shared")
        warnings.append(f"process limit shares RLIMIT_NPROC with the user's {base} other processes")


def _apply_landlock(
    cfg: dict[str, Any], applied: dict[str, list[str]], warnings: list[str]
) -> None:
    """Restrict the filesystem (and TCP, where the kernel can) to what the sandbox may use."""
    layers = set(cfg["layers"])
    if "landlock" not in layers:
        return
    try:
        features = landlock.restrict(
            [cfg["scratch"]],
            [p for p in cfg["devices"] if os.path.exists(p)],
            [p for p in cfg["readable"] if os.path.exists(p)],
            deny_tcp="landlock-tcp" in layers,
        )
        applied["filesystem"].append("landlock")
        if "tcp" in features:
            applied["network"].append("landlock-tcp")
        if "scope" not in features:
            warnings.append("Landlock ABI < 6: signals to outside processes not scoped")
    except OSError as exc:
        warnings.append(f"Landlock unavailable: {exc}")


def _apply_seccomp(cfg: dict[str, Any], applied: dict[str, list[str]], warnings: list[str]) -> None:
    """Install the syscall filter that refuses sockets outside the sandbox."""
    if "seccomp" in cfg["layers"]:
        try:
            seccomp.install()
            applied["network"].append("seccomp")
        except OSError as exc:
            # a network namespace separates abstract unix sockets, but only seccomp refuses
            # a connect to a pathname socket the host left in a traversable folder
            warnings.append(
                f"seccomp unavailable: {exc}; pathname unix sockets of the host stay reachable"
            )
    else:
        warnings.append("seccomp disabled: pathname unix sockets of the host stay reachable")


def _missing_properties(cfg: dict[str, Any], applied: dict[str, list[str]]) -> list[str]:
    """The required properties that no applied mechanism isolates."""
    strong = {
        "filesystem": bool(applied["filesystem"]),
        "network": bool({"netns", "seccomp"} & set(applied["network"])),
        "processes": bool(applied["processes"]),
    }
    return [p for p in cfg["required"] if not strong[p]]


def _lockdown_and_exec(cfg: dict[str, Any], got: dict[str, bool], report_fd: int) -> None:
    """In the command process: apply the irreversible limits, then exec the shell."""
    applied: dict[str, list[str]] = {
        "filesystem": [],
        "network": [],
        "processes": [],
        "memory": ["rlimit-as"],
    }
    warnings: list[str] = []
    os.setpgid(0, 0)
    _join_cgroup(cfg, applied, warnings)
    if got["netns"]:
        applied["network"].append("netns")
    _set_resource_limits(cfg)
    _limit_processes(cfg, got, applied, warnings)
    try:
        landlock.set_no_new_privs()
    except OSError as exc:
        _refuse(report_fd, str(exc))
    _apply_landlock(cfg, applied, warnings)
    _apply_seccomp(cfg, applied, warnings)
    missing = _missing_properties(cfg, applied)
    if missing:
        _refuse(
            report_fd,
            f"no isolation mechanism works here for: {', '.join(missing)} "
            f"(applied: {applied}; warnings: {warnings})",
        )
    os.write(report_fd, json.dumps({"applied": applied, "warnings": warnings}).encode() + b"\n")
    os.close(report_fd)
    os.chdir(cfg["scratch"])
    os.closerange(3, 1 << 16)
    shell = cfg["shell"]
    os.execve(shell, [shell, "-c", cfg["command"]], cfg["env"])


def _status_code(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _init(cfg: dict[str, Any], got: dict[str, bool], report_fd: int) -> None:
    """PID 1 of the new PID namespace."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        # our own /proc so the command sees only its own processes; private propagation
        # keeps the mount from leaking back to the host
        if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "make / private")
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        if _libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
            raise OSError(ctypes.get_errno(), "mount /proc")
    except OSError:
        pass  # the host's /proc stays; the PID namespace still contains the processes
    child = os.fork()
    if child == 0:
        try:
            _lockdown_and_exec(cfg, got, report_fd)
        finally:
            os._exit(127)
    code = 127
    while True:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            code = _status_code(st)
            break
    left = _linger(cfg)
    os.write(report_fd, json.dumps({"left_running": left}).encode() + b"\n")
    os._exit(code)


def _linger(cfg: dict[str, Any]) -> int:
    """After the command exits, give the processes it left behind ``linger_s`` to finish (we
    are their reaper: init of the namespace, or a child subreaper); returns how many are still
    running then. A fork bomb started in the background keeps multiplying meanwhile, so it
    runs into the process limit and is recorded, instead of dying unnoticed with the command."""
    deadline = time.monotonic() + cfg["linger_s"]
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            if time.monotonic() >= deadline:
                return len(_descendants(os.getpid()))
            time.sleep(0.01)


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found.extend(kids)
        frontier.extend(kids)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep_descendants() -> int:
    """Kill every descendant of this process (a child subreaper, so orphans count) until none
    is left; returns how many were killed."""
    killed = 0
    for _ in range(10_000):
        found = _descendants(os.getpid())
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.001)
        _reap()
    _reap()
    return killed


def sweep_uid(uid: int) -> int:
    """Kill every process of ``uid`` (from a child that takes that uid and signals -1, which
    reaches exactly the processes of that uid); returns how many were found."""
    found = 0
    for _ in range(1000):
        n = _count_processes_of(uid)
        if n == 0:
            return found
        found += n
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.002)
    return found


def main() -> None:
    """Run the command described by the JSON in ``sys.argv[1]``; the status JSON goes to the
    descriptor ``status_fd``."""
    cfg = json.loads(sys.argv[1])
    status: dict[str, Any] = {"warnings": []}
    # SIGTERM from the caller means "stop now"; it and SIGCHLD are taken synchronously
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM})
    # if the caller dies, we are told (SIGTERM) and still kill everything we started
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    got = _enter_namespaces(cfg, status)
    if not got["pidns"]:
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD, signal.SIGTERM})
        try:
            if got["pidns"]:
                _init(cfg, got, write_fd)
            else:
                _lockdown_and_exec(cfg, got, write_fd)
        finally:
            os._exit(127)
    os.close(write_fd)
    deadline = start + cfg["wall_s"]
    timed_out = terminated = False
    wait_status: int | None = None
    while wait_status is None:
        pid, st = os.waitpid(child, os.WNOHANG)
        if pid == child:
            wait_status = st
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        info = signal.sigtimedwait({signal.SIGCHLD, signal.SIGTERM}, min(remaining, 1.0))
        if info is not None and info.si_signo == signal.SIGTERM:
            terminated = True
            break
    if wait_status is None:
        os.kill(child, signal.SIGKILL)
        if not got["pidns"]:
            try:
                os.killpg(child, signal.SIGKILL)
            except OSError:
                pass
        _, wait_status = os.waitpid(child, 0)
    elapsed = time.monotonic() - start
    left_running = 0
    if not got["pidns"] and not (timed_out or terminated):
        left_running = _linger(cfg)
    leftovers = 0 if got["pidns"] else sweep_descendants()
    if cfg.get("uid") is not None:
        leftovers += sweep_uid(cfg["uid"])
    report = b""
    while chunk := os.read(read_fd, 65536):
        report += chunk
    inner: dict[str, Any] = {}
    for line in report.splitlines():
        inner.update(json.loads(line))
    left_running = max(left_running, int(inner.get("left_running", 0)))
    status.update(
        exit_code=_status_code(wait_status),
        timed_out=timed_out,
        terminated=terminated,
        elapsed_s=elapsed,
        leftovers_killed=leftovers,
        left_running=left_running,
        namespaces=[k for k, v in got.items() if v],
        applied=inner.get("applied"),
        refused=inner.get("refused"),
    )
    status["warnings"] += inner.get("warnings", [])
    os.write(cfg["status_fd"], json.dumps(status).encode())
    os.close(cfg["status_fd"])


if __name__ == "__main__":
    main()
