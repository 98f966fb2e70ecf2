"""A control group per sandbox, where the machine lets us make one (usually as root): a total
memory bound for all the episode's processes together, a hard process count, and counters
that say for certain when either limit was hit.

Both hierarchies are handled: cgroup v1 (separate ``memory`` and ``pids`` mounts) and v2 (the
unified mount, where the controllers must be enabled in the parent's ``subtree_control``).
The group is created below the cgroup this process is in, so a container's own limits still
apply above it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid


def _mounts() -> dict[str, str]:
    """Controller (``memory``, ``pids``, or ``unified``) -> mount point."""
    found: dict[str, str] = {}
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, point, fstype, options = line.split()[:4]
            if fstype == "cgroup2":
                found.setdefault("unified", point)
            elif fstype == "cgroup":
                for controller in ("memory", "pids"):
                    if controller in options.split(","):
                        found.setdefault(controller, point)
    return found


def _own_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path (``""`` key for v2)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _keyed(path: str) -> dict[str, int]:
    """A ``key value`` per line file (``memory.events``, ``pids.events``...)."""
    out = {}
    for line in _read(path).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


class Cgroup:
    """The sandbox's control group(s); :meth:`create` returns ``None`` (with the reason in
    ``why_not``) when none can be made here."""

    why_not = ""

    def __init__(self, dirs: dict[str, str], version: int) -> None:
        self.dirs = dirs  # "memory" / "pids" -> directory (the same one on v2)
        self.version = version

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> Cgroup | None:
        """Make the group with the two limits, or return ``None``."""
        name = f"miles-terminal-{uuid.uuid4().hex[:12]}"
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError as exc:
            cls.why_not = f"cannot read the cgroup mounts: {exc}"
            return None
        made: list[str] = []
        try:
            if "memory" in mounts and "pids" in mounts:
                dirs = {}
                for c in ("memory", "pids"):
                    d = os.path.join(mounts[c], own.get(c, "/").lstrip("/"), name)
                    os.mkdir(d)
                    made.append(d)
                    dirs[c] = d
                _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # without it the group could spill into swap
                    _write(memsw, str(memory_bytes))
                _write(os.path.join(dirs["pids"], "pids.max"), str(max_processes))
                return cls(dirs, 1)
            if "unified" in mounts:
                parent = os.path.join(mounts["unified"], own.get("", "/").lstrip("/"))
                enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
                missing = [c for c in ("memory", "pids") if c not in enabled]
                if missing:
                    _write(
                        os.path.join(parent, "cgroup.subtree_control"),
                        " ".join(f"+{c}" for c in missing),
                    )
                d = os.path.join(parent, name)
                os.mkdir(d)
                made.append(d)
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_processes))
                return cls({"memory": d, "pids": d}, 2)
            cls.why_not = "no memory and pids cgroup controllers are mounted"
        except OSError as exc:
            cls.why_not = f"cannot create a cgroup: {exc}"
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
        return None

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid into to join."""
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def counters(self) -> dict[str, int]:
        """How often each limit was hit so far: ``memory`` and ``processes``."""
        out = {"memory": 0, "processes": 0}
        try:
            if self.version == 1:
                memory = self.dirs["memory"]
                oom = _keyed(os.path.join(memory, "memory.oom_control"))
                # OOM kills, not failcnt: failcnt also counts page-cache reclaim at the limit,
                # which is no violation (old kernels lack oom_kill: failcnt it is then)
                if "oom_kill" in oom:
                    out["memory"] = oom["oom_kill"]
                else:
                    out["memory"] = int(_read(os.path.join(memory, "memory.failcnt")))
            else:
                mem = _keyed(os.path.join(self.dirs["memory"], "memory.events"))
                out["memory"] = mem.get("oom", 0) + mem.get("oom_kill", 0)
            events = _keyed(os.path.join(self.dirs["pids"], "pids.events"))
            out["processes"] = events.get("max", 0)
        except (OSError, ValueError):
            pass
        return out

    def pids(self) -> list[int]:
        """Processes in the group now."""
        found: set[int] = set()
        for f in self.procs_files():
            try:
                found.update(int(p) for p in _read(f).split())
            except OSError:
                pass
        return sorted(found)

    def kill_all(self) -> int:
        """SIGKILL every process in the group until it is empty; returns how many."""
        killed = 0
        for _ in range(1000):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        return killed

    def remove(self) -> None:
        """Kill what is left and remove the group."""
        self.kill_all()
        for d in sorted(set(self.dirs.values())):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last killed processes are still exiting
