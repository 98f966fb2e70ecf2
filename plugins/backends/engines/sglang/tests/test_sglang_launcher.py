"""Launcher process-management tests.

These start a stand-in HTTP server (``sglang_launcher_standin.py``), not SGLang, through the
launcher's own code path (``python -m <server_module>`` in its own process group, logs to a
file, ``/health`` polling, SIGTERM then SIGKILL). They test how the launcher manages processes;
nothing here says anything about SGLang's behaviour, which was not run on this machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from miles_engine_sglang.launcher import (
    EngineStartError,
    SGLangLauncher,
    group_members,
    port_is_free,
)
from miles_engine_sglang.launcher import pid_alive as alive
from miles_engine_sglang.options import SGLangEngineConfig

from miles_core.contracts import EngineLauncher

Options = Callable[..., SGLangEngineConfig]


def _info(launcher: SGLangLauncher, url: str) -> dict[str, object]:
    async def ask() -> dict[str, object]:
        async with launcher.client(url) as c:
            return await c.get_server_info()

    return asyncio.run(ask())


def test_two_engines_start_serve_and_stop(standin_options: Options) -> None:
    opts = standin_options(
        count=2,
        cuda_visible_devices="per_engine",
        visible_devices=["0", "1", "2", "3"],
        tp_size=2,
        env={"STANDIN_MARKER": "m1"},
    )
    with SGLangLauncher(opts) as launcher:
        assert isinstance(launcher, EngineLauncher)
        urls = [launcher.launch("standin:ok", index=i) for i in range(2)]
        assert urls == [
            f"http://127.0.0.1:{opts.port}",
            f"http://127.0.0.1:{opts.port + opts.port_stride}",
        ]
        infos = [_info(launcher, u) for u in urls]
        # Each process got its own command line and devices through build_command/build_env.
        assert [i["cuda_visible_devices"] for i in infos] == ["0,1", "2,3"]
        assert all(i["marker"] == "m1" for i in infos)
        argv = infos[1]["argv"]
        assert isinstance(argv, list)
        assert argv[argv.index("--port") + 1] == str(opts.port + opts.port_stride)
        assert "--skip-tokenizer-init" in argv

        async def gen() -> tuple[list[int], list[float], str, str]:
            async with launcher.client(urls[0]) as c:
                r = await c.generate([5, 6], {"max_new_tokens": 3})
                return r.output_ids, r.logprobs, r.finish_reason, r.weight_version

        assert asyncio.run(gen()) == ([7, 8, 9], [-0.5] * 3, "length", "0")
        log = launcher.logs[0].read_text()
        assert log.startswith("# miles: ") and "stand-in starting: mode=ok" in log
        procs = dict(launcher.processes)
        assert all(launcher.poll(i) is None for i in procs)
    # The context manager shut both down; nothing listens on their ports any more.
    assert all(p.poll() is not None for p in procs.values())
    assert all(port_is_free("127.0.0.1", opts.port + i * opts.port_stride) for i in range(2))


def test_process_dying_at_startup_reports_its_log_tail(standin_options: Options) -> None:
    launcher = SGLangLauncher(standin_options())
    with pytest.raises(EngineStartError) as err:
        launcher.launch("standin:die", index=0)
    msg = str(err.value)
    assert "exited with code 3 during startup" in msg
    assert "stand-in could not load the model (simulated failure)" in msg
    assert str(launcher.logs[0]) in msg
    assert launcher.processes == {}


def test_hung_startup_times_out_and_is_stopped(standin_options: Options, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    launcher = SGLangLauncher(
        standin_options(
            # long enough for the stand-in's first line even on a loaded 2-core machine
            startup_timeout_s=5.0,
            shutdown_grace_s=1.0,
            env={"STANDIN_PID_FILE": str(pid_file)},
        )
    )
    start = time.monotonic()
    with pytest.raises(EngineStartError, match=r"did not answer /health .* within 5s") as err:
        launcher.launch("standin:hang", index=0)
    assert time.monotonic() - start >= 5.0
    assert "stand-in starting: mode=hang" in str(err.value)
    # The hung server and its child (which ignores SIGTERM) are gone.
    pids = [int(p) for p in pid_file.read_text().split()]
    assert not any(alive(p) for p in pids)
    assert launcher.processes == {}


def test_shutdown_kills_the_whole_process_group(standin_options: Options, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    launcher = SGLangLauncher(
        standin_options(shutdown_grace_s=1.0, env={"STANDIN_PID_FILE": str(pid_file)})
    )
    launcher.launch("standin:ok", index=0)
    leader, child = (int(p) for p in pid_file.read_text().split())
    assert os.getpgid(child) == leader  # the server's worker shares its process group
    assert sorted(group_members(leader) or []) == sorted([leader, child])
    launcher.shutdown()
    # The leader exits on SIGTERM; the child ignores it and must have been SIGKILLed.
    assert not alive(leader) and not alive(child)
    assert group_members(leader) == []


def test_server_ignoring_sigterm_is_killed(standin_options: Options) -> None:
    launcher = SGLangLauncher(standin_options(shutdown_grace_s=0.5))
    launcher.launch("standin:ignore-term", index=0)
    proc = launcher.processes[0]
    launcher.stop(0)
    assert proc.returncode == -signal.SIGKILL


def test_wait_health_generate_times_out_on_that_endpoint(standin_options: Options) -> None:
    launcher = SGLangLauncher(standin_options(wait_health_generate=True, startup_timeout_s=8.0))
    with pytest.raises(EngineStartError, match="did not answer /health_generate"):
        launcher.launch("standin:no-generate", index=0)
    launcher.shutdown()
    ok = SGLangLauncher(launcher.options)
    try:
        assert ok.launch("standin:ok", index=0).endswith(str(launcher.options.port))
    finally:
        ok.shutdown()


def test_port_in_use_is_refused_before_starting(standin_options: Options) -> None:
    opts = standin_options()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", opts.port))
        taken.listen()
        launcher = SGLangLauncher(opts)
        with pytest.raises(EngineStartError, match=f"port {opts.port} .* already in use"):
            launcher.launch("standin:ok", index=0)
        assert launcher.processes == {}


def test_running_index_is_refused_and_a_dead_one_relaunches(standin_options: Options) -> None:
    with SGLangLauncher(standin_options()) as launcher:
        url = launcher.launch("standin:ok", index=0)
        with pytest.raises(EngineStartError, match="already running"):
            launcher.launch("standin:ok", index=0)
        pid = launcher.processes[0].pid
        os.killpg(pid, signal.SIGKILL)  # the server crashes
        launcher.processes[0].wait()
        assert launcher.poll(0) == -signal.SIGKILL
        assert launcher.launch("standin:ok", index=0) == url
        assert launcher.processes[0].pid != pid
