"""Checkpoints: the trainer's state plus the run's own (step, version, data position, ledger,
judge counters, engine restarts), written so that a checkpoint is either whole or ignored.

Each checkpoint lists its files with their sizes and sha256 in ``manifest.json``, written
before ``loop.json`` (which marks the checkpoint complete). Loading checks every file against
it before anything is deserialized: a damaged checkpoint is refused by name, and a resumed run
falls back to the newest one that verifies."""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from miles_core.errors import MilesUserError
from miles_core.ledger import BUFFERED, IN_FLIGHT, DropReason, Ledger

#: The name of a checkpoint's folder; anything else under ``checkpoints/`` is not one.
STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST = "manifest.json"
LOOP = "loop.json"
_CHUNK = 1 << 20


class CheckpointError(MilesUserError):
    """A checkpoint that cannot be used: a file missing, of the wrong size or content, or
    unreadable. The message names the file and what is wrong."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(path: Path) -> list[str]:
    """Every file under ``path`` (relative, POSIX style) but the manifest itself."""
    return sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.is_file() and p.relative_to(path).as_posix() != MANIFEST
    )


def verify(path: Path) -> None:
    """Check the checkpoint at ``path`` against its ``manifest.json``: every listed file is
    there with its size and sha256, and no other file is. Raises :class:`CheckpointError`
    naming the file and what is wrong; reads nothing but bytes (nothing is unpickled)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(
            f"checkpoint {path}: no {MANIFEST} (the save did not finish, or it was written by "
            "an older version of miles, whose checkpoints cannot be resumed)"
        )
    try:
        listed = json.loads(manifest_file.read_text())["files"]
        entries = {str(name): (int(e["size"]), str(e["sha256"])) for name, e in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {manifest_file} is unreadable: {exc!r}") from None
    for name in entries:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or "\\" in name:
            raise CheckpointError(
                f"checkpoint {manifest_file} lists {name!r}: only paths inside the folder "
                "are allowed"
            )
    for name, (size, sha) in entries.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        try:
            actual = file.stat().st_size
            if actual != size:
                raise CheckpointError(
                    f"checkpoint file {file} has {actual} bytes, its manifest says {size}"
                )
            if _sha256(file) != sha:
                raise CheckpointError(
                    f"checkpoint file {file} does not match its sha256 in {MANIFEST} "
                    "(the file is damaged or was changed)"
                )
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {file} is unreadable: {exc}") from None
    extra = sorted(set(_files(path)) - set(entries))
    if extra:
        raise CheckpointError(
            f"checkpoint {path} holds files its {MANIFEST} does not list: {', '.join(extra)}"
        )


class Checkpointer:
    """Saves and finds the checkpoints under ``<run_dir>/checkpoints/step_<n>``."""

    def __init__(self, run_dir: Path, every: int) -> None:
        self.root = run_dir / "checkpoints"
        self.every = every
        #: checkpoints this run has checked against their manifest (each is hashed once)
        self._verified: set[Path] = set()

    def saved(self) -> list[Path]:
        """Complete checkpoints (their ``loop.json`` was written last), oldest first. Folders
        not named ``step_<n>`` are not checkpoints and are ignored."""
        done = [
            p
            for p in self.root.glob("step_*")
            if STEP_DIR.fullmatch(p.name) and (p / LOOP).is_file()
        ]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def has(self, step: int) -> bool:
        """Whether step ``step`` has a complete checkpoint."""
        return (self.root / f"step_{step}" / LOOP).is_file()

    def due(self, step: int) -> bool:
        """Whether the run saves after step ``step`` (every ``checkpoint_every`` steps)."""
        return bool(self.every) and step % self.every == 0

    def latest_verified(self, log: Callable[[str], None]) -> Path:
        """The newest complete checkpoint whose files match its manifest; each newer one that
        does not is logged with the reason and skipped. Raises :class:`CheckpointError` when
        none verifies (or there is none)."""
        reasons: list[str] = []
        for path in reversed(self.saved()):
            try:
                verify(path)
            except CheckpointError as exc:
                reasons.append(str(exc))
                log(f"--resume: skipping checkpoint {path.name}: {exc}")
                continue
            self._verified.add(path)
            return path
        if not reasons:
            raise CheckpointError(f"--resume: no checkpoint under {self.root}")
        raise CheckpointError(
            f"--resume: no checkpoint under {self.root} verifies: " + "; ".join(reasons)
        )

    def save(self, step: int, trainer: Any, state: dict[str, Any]) -> Path:
        """Write the trainer's state, then the manifest of every file, then the run's
        ``state`` (last: it marks the checkpoint complete)."""
        path = self.root / f"step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        # Saved again into the same folder: it is incomplete until the new loop.json lands.
        (path / LOOP).unlink(missing_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)
        trainer.save(str(path / "trainer"))
        loop = json.dumps(state).encode()
        files = {
            name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
            for name in _files(path)
        }
        files[LOOP] = {"size": len(loop), "sha256": hashlib.sha256(loop).hexdigest()}
        tmp = path / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
        tmp.replace(path / MANIFEST)
        tmp = path / f"{LOOP}.tmp"
        tmp.write_bytes(loop)
        tmp.replace(path / LOOP)
        return path

    def load(self, path: Path, trainer: Any) -> dict[str, Any]:
        """Verify ``path`` against its manifest (unless :meth:`latest_verified` chose it),
        restore the trainer from it and return the run's state. Groups the checkpoint has in
        flight or queued died with the process that held them: they are dropped as
        ``interrupted`` in the restored ledger (``state["ledger"]`` is a :class:`Ledger`)."""
        if path not in self._verified:  # latest_verified has already hashed its choice
            verify(path)
        trainer.load(str(path / "trainer"))
        state: dict[str, Any] = json.loads((path / LOOP).read_text())
        ledger = Ledger.from_state_dict(state["ledger"])
        for gid, where in state["ledger"]["state"].items():
            if where in (IN_FLIGHT, BUFFERED):
                ledger.drop(int(gid), DropReason.INTERRUPTED)
        state["ledger"] = ledger
        return state


def _run_name(run_dir: Path) -> str | None:
    """The ``run.name`` an earlier run stored in ``run_dir/run.json``; ``None`` when there is
    no readable one (the folder is not a run's)."""
    try:
        stored = json.loads((run_dir / "run.json").read_text())
        name = stored["config"]["run"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """A new run (not ``--resume``) starts in an empty folder: what an earlier run of the same
    name left there (metrics, checkpoints, ledger) is renamed to ``<name>.<UTC time>`` beside
    it, not overwritten or mixed in. Returns the new name, or ``None`` when there was nothing.

    Only an earlier run is moved: a folder there whose ``run.json`` does not name a run of
    this name (or that has none) is not this run's to move, and is refused."""
    if run_dir.exists() and not run_dir.is_dir():
        raise MilesUserError(f"the run folder {run_dir} exists and is not a folder")
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    if _run_name(run_dir) != run_dir.name:
        raise MilesUserError(
            f"the run folder {run_dir} is not empty and holds no earlier run named "
            f"{run_dir.name!r} (no run.json of one): it is not moved or written to; choose "
            "another run.name or run.output_dir, or empty it"
        )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.{stamp}.{n}")
    run_dir.rename(target)
    return target
