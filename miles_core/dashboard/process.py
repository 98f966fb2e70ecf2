"""``miles train --dashboard``: the run's dashboard served by ``miles dashboard`` in a process of
its own, started beside the run and stopped with it.

The page reads only the run folder's files, so nothing ties the server to the run's process;
in a process of its own its requests never take the interpreter's lock from the training loop,
and a slow or failing request cannot reach the run. It runs in a session of its own (a Ctrl-C
at the terminal is the run's to handle, and the run stops it), and the run's orphan guard stops
it with the rest should the run be killed.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from miles_core.errors import MilesUserError

#: what ``miles dashboard`` prints once it listens
_LISTENING = re.compile(r" at (https?://\S+)")


class DashboardProcess:
    """``miles dashboard RUN_DIR --port PORT --metrics-file FILE`` in a child process.

    :meth:`start` returns the page's URL once the child listens (a user error with the child's
    own message when it cannot: ``aiohttp`` missing, the port taken); :meth:`stop` ends it
    (SIGTERM, then SIGKILL after ``grace_s``). The run folder may not exist yet: the run makes
    it, and the page shows "waiting for metrics.jsonl" until then."""

    def __init__(
        self,
        run_dir: Path,
        *,
        port: int = 0,
        metrics_file: str = "metrics.jsonl",
        start_timeout_s: float = 60.0,
        grace_s: float = 10.0,
    ) -> None:
        self.run_dir, self.port, self.metrics_file = Path(run_dir), port, metrics_file
        self.start_timeout_s, self.grace_s = start_timeout_s, grace_s
        self.url = ""
        self.process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def __enter__(self) -> DashboardProcess:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> str:
        """Start the child and wait until it listens; its URL."""
        command = [
            sys.executable,
            "-m",
            "miles_core.cli",
            "dashboard",
            str(self.run_dir),
            "--port",
            str(self.port),
            "--metrics-file",
            self.metrics_file,
            "--folder-may-not-exist",
        ]
        # its messages go to a file, never a pipe nobody reads that could fill and stall it
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,
        )
        try:
            self.url = self._wait_listening()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_listening(self) -> str:
        process = self.process
        assert process is not None and process.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        said = b""
        while b"\n" not in said:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MilesUserError(
                    f"dashboard: the server did not listen within {self.start_timeout_s:.0f} s"
                )
            if select.select([process.stdout], [], [], min(left, 0.5))[0]:
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:  # the child ended before listening: its own message says why
                    process.wait(timeout=self.grace_s)
                    assert self._stderr is not None
                    self._stderr.seek(0)
                    reason = self._stderr.read().decode(errors="replace").strip()
                    raise MilesUserError(reason or f"dashboard: exited with {process.returncode}")
                said += chunk
        found = _LISTENING.search(said.decode(errors="replace"))
        if found is None:
            raise MilesUserError(f"dashboard: unexpected first line {said[:200]!r}")
        return found.group(1)

    def stop(self) -> None:
        """End the child (idempotent)."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdout, self._stderr):
            if stream is not None:
                stream.close()
