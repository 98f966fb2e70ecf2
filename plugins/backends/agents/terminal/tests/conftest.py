"""Every terminal test records when it started, and the uids its process's sandboxes took, so
the leftover-process checks count only what that test started."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import miles_env_terminal.sandbox as sandbox_module
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from terminal_helpers import OWN_UIDS, mark_test_start


@pytest.fixture(autouse=True)
def _mark_test_start() -> None:
    mark_test_start()


@pytest.fixture(autouse=True, scope="session")
def _record_sandbox_uids() -> Iterator[None]:
    allocate = sandbox_module._allocate_uid

    def recorded(base: int) -> tuple[int, int]:
        uid, fd = allocate(base)
        OWN_UIDS.add(uid)
        return uid, fd

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox_module, "_allocate_uid", recorded)
        yield
