"""The ``miles`` command line.

User errors (bad config, broken plugin, incompatible combination) print one paragraph and exit
with code 2; no traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core import __version__
from miles_core.errors import MilesUserError


def _plugins_for(raw: dict[str, Any] | None = None) -> Any:
    from miles_core.plugins import load_plugins

    section = (raw or {}).get("plugins") or {}
    allow = section.get("allow") if isinstance(section, dict) else None
    block = section.get("block") if isinstance(section, dict) else None
    return load_plugins(allow=allow or None, block=block or None)


def cmd_plugins(args: argparse.Namespace) -> int:
    """``miles plugins``: every loaded plugin, its distribution, version, hooks and components."""
    plugins = _plugins_for()
    hooks = {n for n in dir(plugins.pm.hook) if n.startswith("miles_")}
    if args.hook and args.hook not in hooks:
        raise MilesUserError(f"no hook {args.hook!r}; hooks: {', '.join(sorted(hooks))}")
    infos = [i.to_dict() for i in plugins.pm.infos.values()]
    if args.hook:
        infos = [i for i in infos if args.hook in i["hooks"]]
    if args.json:
        print(json.dumps(infos, indent=2))
        return 0
    for info in infos:
        print(f"{info['distribution']} {info['version']}  [{info['name']}]  {info['module']}")
        for kind, names in info["registers"].items():
            print(f"    {kind}: {', '.join(names)}")
        if not info["registers"]:
            print(f"    hooks: {', '.join(info['hooks']) or 'none'}")
    return 0


def _load_config(path: str, overrides: Sequence[str]) -> tuple[Any, Any]:
    from miles_core.config import read_config, validate_config

    raw = read_config(path, overrides)
    plugins = _plugins_for(raw)
    return validate_config(raw, plugins.registry, source=path), plugins


def cmd_config_validate(args: argparse.Namespace) -> int:
    """``miles config validate FILE``: validate and print the resolved config."""
    config, _ = _load_config(args.file, args.set or [])
    if args.json:
        print(json.dumps(config.to_plain(), indent=2))
    else:
        print(f"{args.file}: valid")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    """``miles config schema``: JSON schema of a run config with the installed plugins."""
    from miles_core.config import json_schema

    print(json.dumps(json_schema(_plugins_for().registry), indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``miles train FILE``: validate, then run."""
    config, plugins = _load_config(args.file, args.set or [])
    plugins.hooks.configure(config)
    from miles_core.runtime import Run, train

    run = Run(config, plugins, resume=args.resume, progress=args.progress)
    if args.dashboard is None:
        train(run)
        return 0
    from miles_core.dashboard import server_module
    from miles_core.dashboard.process import DashboardProcess

    # `miles dashboard` in a process of its own: it reads the run folder's files as the run
    # writes them, and its requests never take this process's interpreter lock from the loop
    metrics_file = server_module().metrics_file_of(config)  # aiohttp missing: said here
    with DashboardProcess(run.run_dir, port=args.dashboard, metrics_file=metrics_file) as dash:
        print(f"miles: dashboard of {run.run_dir} at {dash.url}", file=sys.stderr, flush=True)
        train(run)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """``miles dashboard RUN_DIR``: serve the live dashboard of a run folder until interrupted
    (Ctrl-C or SIGTERM: both end it with exit code 0)."""
    import signal
    import threading

    from miles_core.dashboard import server_module

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir() and not args.folder_may_not_exist:
        raise MilesUserError(
            f"RUN_DIR {args.run_dir!r}: no such folder (a run's folder: run.output_dir/run.name)"
        )
    dash = server_module().Dashboard(
        run_dir, host=args.host, port=args.port, metrics_file=args.metrics_file
    )
    # the signals only set a flag, so one that lands at any point of the start is still heard
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        print(f"miles: dashboard of {run_dir} at {dash.start()} (Ctrl-C stops it)", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        dash.stop()
    return 0


def _family_options(plugins: Any, name: str, pairs: Sequence[str]) -> Any:
    from miles_core.components import Kind
    from miles_core.config import apply_overrides, format_validation_error

    component = plugins.registry.get(Kind.MODEL_FAMILY, name)
    raw = apply_overrides({}, list(pairs))
    if component.config is None:
        if raw:
            raise MilesUserError(f"model family {name!r} takes no options")
        return None
    from pydantic import ValidationError

    try:
        return component.config.model_validate(raw)
    except ValidationError as exc:
        from miles_core.errors import ConfigError

        raise ConfigError(format_validation_error(exc, "option", component.config)) from None


def cmd_family_list(args: argparse.Namespace) -> int:
    """``miles family list``: every registered family and its certificate status."""
    from miles_core.components import Kind
    from miles_core.families import family_status
    from miles_core.runtime.run import build_family

    plugins = _plugins_for()
    rows = []
    for name in plugins.registry.names(Kind.MODEL_FAMILY):
        row = family_status(build_family(plugins, name))
        row["distribution"] = plugins.registry.owner(Kind.MODEL_FAMILY, name).distribution
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['name']:<20} {row['status']:<13} {row.get('message', '')}")
    return 0


def cmd_family_verify(args: argparse.Namespace) -> int:
    """``miles family verify NAME``: run the gates; a pass writes the certificate."""
    from miles_core.families import verify_family
    from miles_core.runtime.run import build_family

    plugins = _plugins_for()
    options = _family_options(plugins, args.name, args.option or [])
    from miles_core.config import apply_overrides

    gates = ("engine",) if args.engine_only else ("cpu",) if args.cpu_only else ("cpu", "engine")
    engine_options = apply_overrides({}, list(args.gate_option or []))
    engine_options.update(
        (k, v) for k, v in (("engine_url", args.engine_url), ("model", args.model)) if v is not None
    )
    report = verify_family(
        build_family(plugins, args.name, options), gates=gates, engine_options=engine_options
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed else 1


def cmd_new_plugin(args: argparse.Namespace) -> int:
    """``miles new plugin KIND NAME``: scaffold a plugin distribution."""
    from miles_core.scaffold import scaffold_plugin

    path = scaffold_plugin(
        args.kind,
        args.name,
        Path(args.output),
        template=Path(args.template) if args.template else None,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
    )
    print(f"created {path}")
    print(f"next: pip install -e {path} && pytest {path}")
    return 0


if TYPE_CHECKING:
    #: the ``miles`` subcommands' parser, which each ``_add_*`` adds its command to
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``miles``."""
    parser = argparse.ArgumentParser(
        prog="miles", description="RL post-training of LLMs and diffusion models."
    )
    parser.add_argument("--version", action="version", version=f"miles-core {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_plugins, _add_config, _add_train, _add_family, _add_new, _add_fleet):
        add(sub)
    return parser


def _add_plugins(sub: _Commands) -> None:
    """``miles plugins``."""
    p = sub.add_parser("plugins", help="list installed plugins and what they register")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--hook", metavar="NAME", help="only plugins implementing this hook")
    p.set_defaults(func=cmd_plugins)


def _add_config(sub: _Commands) -> None:
    """``miles config validate`` and ``miles config schema``."""
    cfg = sub.add_parser("config", help="validate a run config or print its schema")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    v = cfg_sub.add_parser("validate", help="validate a run config")
    v.add_argument("file")
    v.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    v.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    v.set_defaults(func=cmd_config_validate)
    s = cfg_sub.add_parser("schema", help="print the JSON schema of a run config")
    s.set_defaults(func=cmd_config_schema)


def _add_train(sub: _Commands) -> None:
    """``miles train``."""
    t = sub.add_parser("train", help="run RL post-training from a config")
    t.add_argument("file")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="live progress bar on stderr (auto: only when stdout and stderr are terminals; "
        "the per-step lines are always written)",
    )
    t.add_argument(
        "--dashboard",
        nargs="?",
        const=0,
        type=int,
        metavar="PORT",
        help="serve the live dashboard of the run on 127.0.0.1 while it goes (PORT: default a "
        "free one); its URL is printed on stderr",
    )
    t.set_defaults(func=cmd_train)
    # `miles dashboard` is listed right after `miles train`, which starts the same server
    _add_dashboard(sub)


def _add_dashboard(sub: _Commands) -> None:
    """``miles dashboard``."""
    d = sub.add_parser("dashboard", help="serve a live web dashboard of a run folder")
    d.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (run.output_dir/run.name)")
    d.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; any other needs MILES_API_KEY)",
    )
    d.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    d.add_argument(
        "--metrics-file",
        default="metrics.jsonl",
        help="the jsonl sink's file in the run folder (default metrics.jsonl)",
    )
    # `miles train --dashboard` starts the server before the run makes its folder
    d.add_argument("--folder-may-not-exist", action="store_true", help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_dashboard)


def _add_family(sub: _Commands) -> None:
    """``miles family list`` and ``miles family verify``."""
    fam = sub.add_parser("family", help="list and verify model families")
    fam_sub = fam.add_subparsers(dest="family_command", required=True)
    fl = fam_sub.add_parser("list", help="families and their certificate status")
    fl.add_argument("--json", action="store_true", help="print JSON")
    fl.set_defaults(func=cmd_family_list)
    fv = fam_sub.add_parser(
        "verify",
        help="run the CPU gate and the engine gate (a real model on the CPU engine, or "
        "--engine-url); a pass of both writes the certificate",
    )
    fv.add_argument("name")
    fv.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="a family option (e.g. thinking=false)",
    )
    gates = fv.add_mutually_exclusive_group()
    gates.add_argument(
        "--cpu-only",
        action="store_true",
        help="run the CPU gate alone (a family is verified only when both gates passed)",
    )
    gates.add_argument(
        "--engine-only", action="store_true", help="run the engine gate alone (no CPU gate)"
    )
    fv.add_argument(
        "--gate-option",
        action="append",
        metavar="KEY=VALUE",
        help="an engine-gate option: url=http://..., engine=NAME, engine_options.num_threads=1, "
        "model=DIR, scripted=true",
    )
    fv.add_argument("--engine-url", help="engine gate: a running engine serving the family's model")
    fv.add_argument(
        "--model",
        help="engine gate: a Hugging Face model folder for the embedded engine (default: "
        "SmolLM2 for smollm2, a scripted tiny model otherwise)",
    )
    fv.add_argument("--json", action="store_true", help="print the report as JSON")
    fv.set_defaults(func=cmd_family_verify)


def _add_new(sub: _Commands) -> None:
    """``miles new plugin``."""
    from miles_core.scaffold import KINDS

    new = sub.add_parser("new", help="scaffold a new plugin")
    new_sub = new.add_subparsers(dest="new_command", required=True)
    np_ = new_sub.add_parser("plugin", help="scaffold a plugin distribution")
    np_.add_argument(
        "kind", choices=sorted(KINDS), metavar="KIND", help=f"one of: {', '.join(sorted(KINDS))}"
    )
    np_.add_argument("name", help="component name, e.g. my_reward")
    np_.add_argument("--output", default=".", help="folder to create it in (default: .)")
    np_.add_argument(
        "--template",
        metavar="FILE",
        help="family: the chat template (jinja) shipped as chat_template.jinja (default: an "
        "append-only ChatML template)",
    )
    np_.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="family: the Hugging Face tokenizer.json shipped beside it",
    )
    np_.set_defaults(func=cmd_new_plugin)


def cmd_fleet(args: argparse.Namespace) -> int:
    """``miles fleet join|drain RUN_DIR``: a request to the running job in ``RUN_DIR``."""
    from miles_core.runtime.control import request

    if args.fleet_command == "join":
        body: dict[str, object] = {"action": "join", "engines": args.engines}
    else:
        body = {"action": "drain", "engine": args.engine}
    path = request(args.run_dir, body)
    print(f"requested: {path} (its outcome: {path.parent / 'done' / path.name})")
    return 0


def _add_fleet(sub: _Commands) -> None:
    """``miles fleet join|drain``."""
    fleet = sub.add_parser("fleet", help="engines join or leave a running job")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True)
    join = fleet_sub.add_parser("join", help="start more engines; each serves from the next update")
    join.add_argument("run_dir", help="the running job's folder (run.output_dir/run.name)")
    join.add_argument("--engines", type=int, default=1, help="how many (default: 1)")
    drain = fleet_sub.add_parser("drain", help="take an engine out of the job for good")
    drain.add_argument("run_dir", help="the running job's folder (run.output_dir/run.name)")
    drain.add_argument("--engine", type=int, required=True, help="the engine's index")
    for p in (join, drain):
        p.set_defaults(func=cmd_fleet)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``miles``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except MilesUserError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
