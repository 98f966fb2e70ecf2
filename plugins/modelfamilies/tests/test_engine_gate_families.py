"""The engine gate: a real engine process (the embedded engine) drives the scripted session
through the engine contract alone (``POST /generate`` by URL); the stored tokens are checked
against the canonical render.

Every registered family passes against the embedded engine by URL (a scripted tiny model with
the family's real vocabulary, SmolLM2-135M-Instruct as the real model); without a URL the gate
starts the engine whose record says it runs on CPU through the plugin registry; an engine that
answers with one wrong special token fails the gate with the first difference named; a session
whose stored tokens are altered fails with the turn named; the gate's modules import no plugin.
"""

from __future__ import annotations

import ast
import asyncio
import json
import pkgutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import import_module
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path
from typing import Any

import pytest
from miles_modelfamilies import deepseek_v4, qwen3, qwen3_5, smollm2
from miles_modelfamilies.engine_gate import (
    check_session,
    drive_session,
    make_scripted_model,
    run_engine_gate,
    scripted_reply,
)
from miles_modelfamilies.gate_engine import EngineGateError, cpu_engine
from miles_modelfamilies.options import DeepSeekV4Options, Qwen3_5Options, Qwen3Options

from miles_core.errors import ConfigError, UnknownComponentError
from miles_core.families import GateReport, family_status, verify_family

#: The modules of the engine gate, which must import no plugin (and no engine library).
GATE_MODULES = (
    "miles_modelfamilies.engine_gate",
    "miles_modelfamilies.gate_checks",
    "miles_modelfamilies.gate_engine",
    "miles_modelfamilies.gate_model",
    "miles_modelfamilies.gate_session",
    "miles_modelfamilies.options",
)
#: Every registered family configuration that passes the CPU gate, built by its factory.
BUILDS: dict[str, Callable[[], Any]] = {
    "qwen3": lambda: qwen3.build(),
    "qwen3_nothink": lambda: qwen3.build(Qwen3Options(enable_thinking=False)),
    "qwen3_5": lambda: qwen3_5.build(),
    "qwen3_5_nothink": lambda: qwen3_5.build(Qwen3_5Options(enable_thinking=False)),
    "deepseek_v4": lambda: deepseek_v4.build(),
    "deepseek_v4_chat": lambda: deepseek_v4.build(DeepSeekV4Options(enable_thinking=False)),
}


@pytest.fixture(autouse=True)
def cert_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "certs"
    monkeypatch.setenv("MILES_CERT_DIR", str(folder))
    return folder


@contextmanager
def embedded_engine(model: Path | str) -> Iterator[str]:
    """An embedded engine process serving ``model``; yields its URL."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=1, context_length=16384, num_threads=1, startup_timeout_s=300
        )
    )
    try:
        yield launcher.launch(str(model), index=0)
    finally:
        launcher.shutdown()


@contextmanager
def corrupting_engine(upstream: str, swap: dict[int, int]) -> Iterator[str]:
    """An engine that forwards ``/generate`` to ``upstream`` and answers with the first
    generated token found in ``swap`` replaced (one wrong token per answer); yields its URL."""
    from aiohttp import ClientSession, web

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        async with ClientSession() as client:
            async with client.post(upstream + "/generate", json=body) as resp:
                data = await resp.json()
        ids = data["output_ids"]
        at = next(i for i, t in enumerate(ids) if t in swap)
        ids[at] = swap[ids[at]]
        return web.json_response(data)

    app = web.Application()
    app.router.add_post("/generate", handle)
    runner = web.AppRunner(app, access_log=None)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


# --- fast: the scripted reply, the options, the engine choice, the imports --------------------


def test_engine_gate_scripted_reply_has_distinct_tokens_and_parses() -> None:
    fam = qwen3.build()
    last, ids, text, calls = scripted_reply(fam)
    assert calls and fam.decode(ids) == text and ids[-1] == 151645
    sources = [last, *ids[:-1]]
    assert len(set(sources)) == len(sources)  # a bigram model can follow it
    parsed = fam.parse_assistant(text)
    assert parsed["tool_calls"][0]["function"]["name"] == "lookup"
    assert parsed["reasoning_content"] == "Checking."
    # DeepSeek V4's DSML repeats the special token ｜DSML｜: no bigram spelling calls a tool.
    _, _, ds_text, ds_calls = scripted_reply(deepseek_v4.build())
    assert not ds_calls and ds_text.endswith("<｜end▁of▁sentence｜>")


def test_engine_gate_options_are_refused_before_anything_starts() -> None:
    fam = qwen3.build()

    def run(**options: Any) -> GateReport:
        report = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
        return run_engine_gate(fam, report, **options)

    with pytest.raises(ConfigError, match=r"engine gate option.urll: unknown key 'urll'"):
        run(urll="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"give url .* not both"):
        run(url="http://127.0.0.1:1", engine="embedded")
    with pytest.raises(ConfigError, match="url must start with http"):
        run(url="127.0.0.1:1")
    with pytest.raises(UnknownComponentError, match=r"no rollout engine 'nope'.*embedded"):
        run(engine="nope")
    with pytest.raises(ConfigError, match=r"engine_options.bogus: unknown key 'bogus'"):
        run(engine_options={"bogus": 1})


def test_engine_gate_reports_an_unreachable_engine() -> None:
    fam = qwen3.build()
    # ``engine_url`` is the name `miles family verify --engine-url` passes; ``url`` the same.
    report = verify_family(
        fam, gates=("engine",), engine_options={"engine_url": "http://127.0.0.1:9"}
    )
    assert not report.passed and report.certificate is None
    (failure,) = report.failures
    assert failure.check == "engine" and "http://127.0.0.1:9 is unreachable" in failure.detail


def test_the_cpu_engine_is_chosen_by_what_its_record_says_it_runs_on() -> None:
    from miles_core import RolloutEngine
    from miles_core.plugins import PluginInfo
    from miles_core.registry import Registry

    def registry(*engines: tuple[str, tuple[str, ...]], images: bool = False) -> Registry:
        reg = Registry()
        for name, devices in engines:
            info = PluginInfo(name=f"p-{name}", distribution=f"d-{name}", version="0", module="m")
            reg.add(RolloutEngine(name=name, factory=dict, devices=devices), info)
        if images:  # a CPU engine for another modality is never the gate's choice
            info = PluginInfo(name="p-img", distribution="d-img", version="0", module="m")
            only = {"modality": ("diffusion",)}
            reg.add(RolloutEngine(name="img", factory=dict, devices=("cpu",), requires=only), info)
        return reg

    assert cpu_engine(registry(("text", ("cpu",)), images=True)) == "text"
    with pytest.raises(EngineGateError, match=r"no installed rollout engine runs on CPU"):
        cpu_engine(registry(images=True))
    assert cpu_engine(registry(("gpu", ("cuda",)), ("here", ("cpu", "cuda")))) == "here"
    with pytest.raises(EngineGateError, match=r"no installed rollout engine runs on CPU.*gpu"):
        cpu_engine(registry(("gpu", ("cuda",))))
    with pytest.raises(EngineGateError, match=r"several .* \(a, b\); choose one with .*engine="):
        cpu_engine(registry(("a", ("cpu",)), ("b", ("cpu",))))


def _plugin_packages() -> set[str]:
    """Every top-level package the gate must not import: those of the distributions that
    register Miles plugins, and every other importable ``miles_*`` package (the engine client
    is a library, not a plugin), all but the core and this plugin."""
    plugins = entry_points(group="miles")
    dists = {ep.dist.name for ep in plugins if ep.dist is not None}
    packages = {ep.module.split(".")[0] for ep in plugins}
    packages |= {pkg for pkg, owners in packages_distributions().items() if set(owners) & dists}
    packages |= {m.name for m in pkgutil.iter_modules() if m.name.startswith("miles_")}
    return packages - {"miles_core", "miles_modelfamilies"}


def _imports(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports anywhere (in functions too), and of
    ``import_module("...")`` / ``__import__("...")`` calls with a literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value).split(".")[0])
    return names


def test_the_engine_gate_imports_no_plugin() -> None:
    plugins = _plugin_packages()
    # The check can fail: the engine and the engine client are in the forbidden set, and an
    # import hidden in a function or behind import_module is seen.
    assert {"miles_engine_embedded", "miles_engine_client"} <= set(plugins), sorted(plugins)
    hidden = (
        "def f():\n    import miles_sessions.server\n"
        "    importlib.import_module('miles_engine_client')\n"
    )
    assert {"miles_sessions", "miles_engine_client"} <= _imports(hidden)
    for name in GATE_MODULES:
        source = Path(import_module(name).__file__ or "").read_text()
        bad = sorted(_imports(source) & set(plugins))
        assert not bad, f"{name} imports plugin package(s) {bad}"
    # Importing the gate loads no plugin module either (checked in a fresh interpreter).
    code = (
        "import sys, json\n"
        + "".join(f"import {m}\n" for m in GATE_MODULES)
        + f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(plugins)!r})\n"
        "print(json.dumps(bad)); sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- slow: real engine processes -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The qwen3_thinking_2507 family and an embedded engine serving its scripted model."""
    fam = qwen3_5.build_thinking_2507()
    path, _, calls = make_scripted_model(fam, tmp_path_factory.mktemp("tiny-2507"))
    assert calls
    with embedded_engine(path) as url:
        yield fam, url


@pytest.mark.slow
def test_engine_gate_passes_for_a_scripted_tiny_model(
    tiny: tuple[Any, str], cert_dir: Path
) -> None:
    fam, url = tiny
    report = verify_family(fam, engine_options={"url": url, "scripted": True})
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert engine["turns"] == 4 and engine["rollbacks"] == 1 and engine["engine_url"] == url
    assert engine["engine_tool_calls"] >= 3  # every reply on the path calls the tool
    # The scripted reply leaves out the template's newlines: drift, counted, not a failure.
    assert engine["text_drift_turns"] == 4 and engine["replies_without_stop_token"] == []
    assert "assistant-text drift in 4 turn(s)" in report.format()
    cert = json.loads(Path(report.certificate or "").read_text())
    assert cert["gates"] == ["cpu", "engine"] and cert["details"]["engine"]["rollbacks"] == 1
    status = family_status(fam)
    assert status["status"] == "verified" and status["gates"] == ["cpu", "engine"]
    # A later CPU-only run keeps the engine gate in the certificate.
    again = verify_family(fam, gates=("cpu",))
    assert json.loads(Path(again.certificate or "").read_text())["gates"] == ["cpu", "engine"]


@pytest.mark.slow
def test_engine_gate_fails_when_the_engine_answers_a_wrong_special_token(
    tiny: tuple[Any, str],
) -> None:
    fam, url = tiny
    im_end, endoftext = (
        fam.tokenizer.token_id("<|im_end|>"),
        fam.tokenizer.token_id("<|endoftext|>"),
    )
    # <|endoftext|> is a stop token of the family too: only the token check can see it.
    with corrupting_engine(url, {im_end: endoftext}) as bad:
        report = verify_family(fam, engine_options={"url": bad, "scripted": True})
    assert not report.passed and report.certificate is None
    first = report.failures[0]
    assert (first.gate, first.check, first.role) == ("engine", "engine_tokens", "assistant")
    assert first.detail.startswith("turn 1: the special tokens of the generated reply")
    assert "first difference at special token" in first.detail
    assert f"'<|endoftext|>' ({endoftext}) vs '<|im_end|>' ({im_end})" in first.detail
    assert "turn 1" in report.format() and family_status(fam)["status"] == "not_verified"


@pytest.mark.slow
def test_engine_gate_fails_on_altered_tokens_naming_the_turn(tiny: tuple[Any, str]) -> None:
    fam, url = tiny
    session = drive_session(fam, url)
    ok = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=ok)
    assert not ok.failures, [f.format() for f in ok.failures]
    assert session.tip is not None

    # A non-assistant token changed: the user's text of turn 3 is not the canonical text.
    turn3 = session.tip.path()[2]
    saved = list(turn3.env_ids)
    turn3.env_ids[-8] = fam.tokenize(" banana")[0]
    report = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=report)
    turn3.env_ids[:] = saved
    text = "\n".join(f.format() for f in report.failures)
    assert "engine_text check" in text and "turn 3" in text and " banana" in text

    # A special token of a generated reply replaced by ordinary text: a special-token failure.
    turn1 = session.tip.path()[0]
    end = turn1.gen_ids.index(fam.tokenizer.token_id("</tool_call>"))
    turn1.gen_ids[end : end + 1] = fam.tokenize("</tool")
    report = GateReport(family=fam.name, fingerprint=fam.fingerprint(), gates=("engine",))
    check_session(fam, session, scripted=True, report=report)
    assert any(
        f.check == "engine_tokens" and "special tokens" in f.detail and "turn 1" in f.detail
        for f in report.failures
    ), [f.format() for f in report.failures]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_engine_gate_passes_on_the_embedded_engine_by_url(name: str, tmp_path: Path) -> None:
    fam = BUILDS[name]()
    path, _, calls = make_scripted_model(fam, tmp_path / "model")
    with embedded_engine(path) as url:
        report = verify_family(
            fam, gates=("engine",), engine_options={"url": url, "scripted": True}
        )
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert engine["turns"] == 4 and engine["rollbacks"] == 1
    assert engine["replies_without_stop_token"] == []
    assert (engine["engine_tool_calls"] > 0) == calls


@pytest.mark.slow
def test_engine_gate_passes_for_smollm2_on_the_real_model() -> None:
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    fam = smollm2.build()
    model = smollm2_model_folder()
    with embedded_engine(model) as url:
        report = verify_family(fam, gates=("engine",), engine_options={"url": url})
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert not engine["scripted"] and engine["engine_url"] == url
    assert engine["turns"] == 4 and engine["rollbacks"] == 1
    assert "text_drift_turns" in engine and "token_drift_turns" in engine


@pytest.mark.slow
def test_without_a_url_the_gate_starts_the_cpu_engine_through_the_registry() -> None:
    fam = qwen3.build()
    report = verify_family(fam, engine_options={"engine_options": {"num_threads": 1}})
    assert report.passed, report.format()
    engine = report.details["engine"]
    assert engine["rollout_engine"] == "embedded" and engine["scripted"]
    assert engine["engine_tool_calls"] >= 3
    assert family_status(fam)["status"] == "verified"
