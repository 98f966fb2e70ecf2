"""Requests to a running job: engines join it or are drained from it.

A request is a small JSON file in the run's ``control/`` folder (``miles fleet join RUN_DIR``,
``miles fleet drain RUN_DIR --engine I``, or :func:`request`), written whole (a temporary name,
then a rename). The run reads the folder at each step's start, applies each request in the
order written, and moves it to ``control/done/`` with its outcome (``ok``, or ``error`` naming
the field). A request is data only: the fields below, validated; a file over
:data:`MAX_REQUEST_BYTES` or anything else is refused, the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from miles_core.errors import MilesUserError
from miles_core.runtime.fleet import EngineFleet

#: the largest request file read
MAX_REQUEST_BYTES = 4096
#: the most requests read at one step's start (the rest wait for the next)
MAX_REQUESTS_PER_STEP = 16


class JoinRequest(BaseModel):
    """Start ``engines`` more engines; each serves from the next weight update."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["join"]
    engines: int = Field(1, ge=1, le=64, description="engines to start")


class DrainRequest(BaseModel):
    """Take engine ``engine`` out of the job for good."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["drain"]
    engine: int = Field(ge=0, description="the engine's index (run.json, the run's log)")


Request = Annotated[JoinRequest | DrainRequest, Field(discriminator="action")]
_REQUEST: TypeAdapter[JoinRequest | DrainRequest] = TypeAdapter(Request)


def control_dir(run_dir: str | Path) -> Path:
    """Where requests to the run in ``run_dir`` go."""
    return Path(run_dir) / "control"


def request(run_dir: str | Path, body: dict[str, object]) -> Path:
    """Write the request ``body`` (validated here too) for the run in ``run_dir``; returns the
    file, whose outcome lands under ``control/done/`` with the same name."""
    try:
        _REQUEST.validate_python(body)
    except ValidationError as exc:
        raise MilesUserError(f"fleet request: {_first_error(exc)}") from exc
    if not Path(run_dir).is_dir():
        raise MilesUserError(f"fleet request: no run folder at {run_dir}")
    folder = control_dir(run_dir)
    folder.mkdir(exist_ok=True)
    name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, folder / name)  # whole, or not there
    return folder / name


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "request"
    return f"{where}: {err['msg']}"


class Control:
    """Reads and applies the run's requests; see the module docstring. ``grow``: given the
    job's engines (those starting included), how many engines a placement would add now
    (nodes that joined its cluster: :meth:`miles_core.hooks.Hooks.engines_to_add`), asked
    before the requests are read."""

    def __init__(
        self,
        run_dir: str | Path,
        fleet: EngineFleet,
        log: Callable[[str], None],
        grow: Callable[[int], int] | None = None,
    ):
        self.folder = control_dir(run_dir)
        self.fleet = fleet
        self.log = log
        self.grow = grow

    async def poll(self) -> int:
        """Add the engines the placement has room for, then apply the requests waiting now;
        returns how many requests were read."""
        await self._grow()
        if not self.folder.is_dir():
            return 0
        names = sorted(p.name for p in self.folder.glob("*.json"))[:MAX_REQUESTS_PER_STEP]
        for name in names:
            outcome = await self._apply(self.folder / name)
            done = self.folder / "done"
            done.mkdir(exist_ok=True)
            (done / name).write_text(json.dumps(outcome))
            (self.folder / name).unlink(missing_ok=True)
        return len(names)

    async def _grow(self) -> None:
        if self.grow is None:
            return
        membership = self.fleet.membership
        count = await asyncio.to_thread(self.grow, len(self.fleet.engines) + membership.joining)
        if count > 0:
            indices = membership.join(count)
            self.log(f"the cluster has room for {count} more engine(s): engines {indices} join")

    async def _apply(self, path: Path) -> dict[str, object]:
        try:
            if path.stat().st_size > MAX_REQUEST_BYTES:
                raise MilesUserError(f"larger than {MAX_REQUEST_BYTES} bytes")
            body = _REQUEST.validate_json(path.read_bytes())
            if isinstance(body, JoinRequest):
                indices = self.fleet.membership.join(body.engines)
                self.log(f"fleet request {path.name}: engines {indices} join")
                return {"ok": True, "joining": indices}
            engine = self.fleet.membership.find(body.engine)
            if len(self.fleet.engines) == 1:
                raise MilesUserError(f"engine {body.engine} is the job's last engine")
            await self.fleet.membership.leave(engine, f"drained by request {path.name}")
            return {"ok": True, "left": body.engine}
        except ValidationError as exc:
            error = _first_error(exc)
        except (MilesUserError, OSError) as exc:
            error = str(exc)
        self.log(f"fleet request {path.name} refused: {error}")
        return {"ok": False, "error": error}
