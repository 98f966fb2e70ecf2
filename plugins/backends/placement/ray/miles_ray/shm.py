"""torch's shared memory that a trainer actor's process leaves behind, removed at release.

A CPU trainer that feeds colocated engines keeps its buckets in torch's shared memory
(``/dev/shm/torch_<pid>_<random>_<n>``, libshm's naming, ``<pid>`` the creating process). The
manager process that removes these files once the last process using them exits is a child of
the actor, and Ray ends an actor's children with it: the files would stay until the machine
restarts, as large as two copies of the model's weights for every rank, after every run.

At release the placement runs :func:`remove_left` on each node that held a trainer actor: once
an actor's process has exited, the files it made that no live process maps any more (an
engine still being stopped keeps its own) are removed. Nothing else is touched: only names of
the actors' own pids, and only while such a pid is no running process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

#: where torch (libshm) makes its shared memory on Linux
SHM_DIR = "/dev/shm"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _mapped(paths: set[str]) -> set[str]:
    """Those of ``paths`` that some live process maps (read from ``/proc/*/maps``)."""
    found: set[str] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set(paths)  # no /proc: every file counts as in use
    for entry in entries:
        if not entry.isdigit() or found == paths:
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        found |= {p for p in paths - found if p in text}
    return found


def _names(pids: Iterable[int], root: str) -> list[str]:
    prefixes = tuple(f"torch_{int(pid)}_" for pid in pids)
    if not prefixes:
        return []
    try:
        return [n for n in os.listdir(root) if n.startswith(prefixes)]
    except OSError:
        return []


def remove_left(
    pids: Sequence[int], timeout_s: float = 30.0, root: str = SHM_DIR
) -> dict[str, int]:
    """On this node: remove the shared memory torch made in the processes ``pids`` once each
    has exited and no live process maps the file; wait up to ``timeout_s`` for the last ones
    (returns at once when there is nothing). Returns ``{"removed": n, "kept": m}``: ``kept``
    counts the files still there at the deadline (a process still running or mapping it)."""
    deadline = time.monotonic() + timeout_s
    removed = 0
    while True:
        gone = [pid for pid in pids if not _running(pid)]
        paths = {os.path.join(root, n) for n in _names(gone, root)}
        for path in paths - _mapped(paths) if paths else ():
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
        left = _names(pids, root)
        if not left or time.monotonic() >= deadline:
            return {"removed": removed, "kept": len(left)}
        time.sleep(0.2)


def remove_on_nodes(processes: Iterable[dict[str, Any]], timeout_s: float = 30.0) -> dict[str, int]:
    """From the driver: :func:`remove_left` on every live node that ran one of ``processes``
    (``where`` records: ``node_id`` and ``pid``), as one Ray task each; the counts summed. A
    node that is gone or does not answer in time is left as it is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    by_node: dict[str, list[int]] = {}
    for p in processes:
        if p.get("node_id") and p.get("pid"):
            by_node.setdefault(str(p["node_id"]), []).append(int(p["pid"]))
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    task = ray.remote(num_cpus=0, max_retries=0)(remove_left)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ).remote(pids, timeout_s)
        for node, pids in by_node.items()
        if node in alive
    ]
    total = {"removed": 0, "kept": 0}
    for ref in refs:
        try:
            counts = ray.get(ref, timeout=timeout_s + 30)
        except Exception:  # a node lost meanwhile: nothing more can be done from here
            continue
        for key in total:
            total[key] += int(counts.get(key, 0))
    return total


def remove_actor_memory(processes: Sequence[dict[str, Any]], timeout_s: float) -> None:
    """At a placement's release: :func:`remove_on_nodes` for the trainer's actors, the files
    still in use named on stdout; never raises (the release goes on)."""
    if not processes:
        return
    try:
        counts = remove_on_nodes(processes, timeout_s=timeout_s)
    except Exception as exc:
        print(f"miles: the trainer actors' shared memory was not removed: {exc}", flush=True)
        return
    if counts["kept"]:
        print(
            f"miles: {counts['kept']} shared-memory file(s) of the trainer actors are still in "
            "use after the run, left in /dev/shm",
            flush=True,
        )
