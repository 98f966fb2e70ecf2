"""A live dashboard of a run: a web page over the run folder's own files (``metrics.jsonl``,
``ledger.json``, ``run.json``, ``traces.jsonl``), updated every second while the run goes.

``miles dashboard RUN_DIR`` serves it on its own; ``miles train CONFIG --dashboard`` beside the
run. The server (:mod:`miles_core.dashboard.server`) needs ``aiohttp``; importing this package
does not import it.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from miles_core.errors import MilesUserError

__all__ = ["server_module"]


def server_module() -> ModuleType:
    """:mod:`miles_core.dashboard.server`, or a user error saying what to install when
    ``aiohttp`` is missing (a core installed without any plugin that brings it)."""
    if importlib.util.find_spec("aiohttp") is None:
        raise MilesUserError(
            "the dashboard needs aiohttp, which is not installed: pip install "
            "'miles-core[dashboard]'"
        )
    from miles_core.dashboard import server

    return server
