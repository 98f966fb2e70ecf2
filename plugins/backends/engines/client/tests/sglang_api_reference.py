"""SGLang's native HTTP API, read from SGLang's own source files, and a checker of JSON values
against the field types written there.

SGLang's request structs (``sglang.srt.managers.io_struct``) and ``ServerArgs`` cannot be
imported on a machine without CUDA: ``import sglang`` runs ``sglang/srt/utils/common.py``,
which imports ``triton`` (a GPU compiler), and ``io_struct`` further needs ``torchvision``
built for the installed torch. So the facts the tests need are read from the source with
:mod:`ast` instead (nothing of SGLang is executed):

- ``routes``: every path of ``sglang/srt/entrypoints/http_server.py`` (its ``@app.get`` /
  ``@app.post`` / ``@app.api_route`` decorators), its methods, and the class its handler
  parses the JSON body into;
- ``request_types``: the fields of those classes in ``sglang/srt/managers/io_struct.py``
  (name, annotation as written, required or not), inherited fields included;
- ``server_args``: every ``python -m sglang.launch_server`` flag: the fields of the
  namespaces ``ServerArgs`` is assembled from (``sglang/srt/arg_groups/fields/*.py``, as
  ``add_cli_args_from_dataclass`` turns them into flags) plus the flags ``add_cli_args`` in
  ``sglang/srt/server_args.py`` registers by hand, with their choices and deprecations.

The result is stored beside the tests (``sglang_api_<version>.json``) so the checks run
where SGLang is not installed; where it is installed, a test re-reads the installed files and
requires the stored file to equal what they say. Regenerate after changing the pinned SGLang::

    python plugins/backends/engines/client/tests/sglang_api_reference.py --write

The one module of SGLang that imports without CUDA, the generated HTTP contract
``sglang/api/v1/api_types.py`` (msgspec only), is loaded by :func:`load_api_types`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
PINNED_VERSION = "0.5.23"
DATA_FILE = HERE / f"sglang_api_{PINNED_VERSION.replace('.', '_')}.json"

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_FIELDS = "sglang/srt/arg_groups/fields"
API_TYPES = "sglang/api/v1/api_types.py"

_ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"],
                     "head": ["HEAD"], "patch": ["PATCH"], "websocket": ["WEBSOCKET"]}  # fmt: skip
_DEPRECATED_ACTIONS = {"DeprecatedStoreTrueAction", "DeprecatedStoreConstAction"}


# --- where SGLang is ---------------------------------------------------------------------------


def installed_version() -> str | None:
    """The installed ``sglang`` distribution's version (read from its metadata: importing
    ``sglang`` fails without CUDA), or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_root() -> Path:
    """The folder that holds the installed ``sglang`` package (its ``site-packages``)."""
    dist = importlib.metadata.distribution("sglang")
    root = Path(str(dist.locate_file("")))
    if not (root / HTTP_SERVER).is_file():
        raise FileNotFoundError(f"sglang {dist.version} is installed but {HTTP_SERVER} is missing")
    return root


def load_api_types(root: Path) -> ModuleType:
    """SGLang's generated HTTP contract module (``sglang.api.v1.api_types``), loaded from its
    file: importing it through the package would run ``sglang/__init__.py`` (CUDA imports),
    while the module itself needs only msgspec."""
    name = "_sglang_api_v1_api_types"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, root / API_TYPES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- extraction --------------------------------------------------------------------------------


def _parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text(encoding="utf-8"), filename=rel)


def _literal_path(node: ast.expr) -> tuple[str | None, str | None]:
    """A route path: a string literal, or ``os.environ.get("VAR", "/default")`` (the default
    and the variable that overrides it); ``(None, None)`` for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, None
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "os.environ.get"
        and len(node.args) == 2
        and all(isinstance(a, ast.Constant) for a in node.args)
    ):
        return node.args[1].value, node.args[0].value  # type: ignore[attr-defined]
    return None, None


def _unwrap_optional(node: ast.expr) -> ast.expr:
    """``X`` of ``Optional[X]``; any other annotation as it is."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Optional":
        return node.slice
    return node


def _body_class(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The class a FastAPI handler parses its JSON body into: its ``obj`` parameter's
    annotation, ``Cls`` or ``Annotated[Cls, Body()]``."""
    for arg in fn.args.args:
        ann = arg.annotation
        if ann is None:
            continue
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            if any(ast.unparse(e) == "Body()" for e in elts[1:]):
                return ast.unparse(_unwrap_optional(elts[0]))
        ann = _unwrap_optional(ann)
        if arg.arg == "obj" and isinstance(ann, ast.Name):
            return ann.id
    return None


def extract_routes(root: Path) -> dict[str, dict[str, Any]]:
    """Every route of ``http_server.py``: ``{path: {"methods", "body", "handler"}}``."""
    routes: dict[str, dict[str, Any]] = {}
    for fn in ast.walk(_parse(root, HTTP_SERVER)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and isinstance(dec.func.value, ast.Name)
                and dec.func.value.id == "app"
                and dec.args
            ):
                continue
            kind = dec.func.attr
            path, env = _literal_path(dec.args[0])
            if path is None:
                continue  # a path computed at import time (e.g. the Ollama root route)
            if kind == "api_route":
                methods_kw = next((k.value for k in dec.keywords if k.arg == "methods"), None)
                methods = (
                    [e.value for e in methods_kw.elts]  # type: ignore[attr-defined]
                    if isinstance(methods_kw, ast.List)
                    else ["GET"]
                )
            elif kind in _ROUTE_DECORATORS:
                methods = _ROUTE_DECORATORS[kind]
            else:
                continue
            entry = routes.setdefault(
                path, {"methods": [], "body": _body_class(fn), "handler": fn.name}
            )
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
            if env is not None:
                entry["path_env_override"] = env
    return dict(sorted(routes.items()))


def _class_fields(cls: ast.ClassDef, *, dataclass: bool) -> dict[str, dict[str, Any]]:
    fields: dict[str, dict[str, Any]] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if dataclass and ast.unparse(stmt.annotation).startswith("ClassVar"):
            continue
        required = stmt.value is None
        if (
            isinstance(stmt.value, ast.Call)
            and ast.unparse(stmt.value.func) in ("field", "msgspec.field", "dataclasses.field")
            and not any(k.arg in ("default", "default_factory") for k in stmt.value.keywords)
        ):
            required = True
        fields[name] = {"type": ast.unparse(stmt.annotation), "required": required}
    return fields


def extract_request_types(root: Path, names: set[str]) -> dict[str, dict[str, Any]]:
    """Fields of the named ``io_struct.py`` classes, those of their bases first (as msgspec
    and dataclasses order them)."""
    classes = {
        node.name: node for node in _parse(root, IO_STRUCT).body if isinstance(node, ast.ClassDef)
    }

    def fields_of(name: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
        node = classes[name]
        dataclass = any(ast.unparse(d) in ("dataclass", "dataclasses.dataclass")
                        for d in node.decorator_list)  # fmt: skip
        chain: list[str] = []
        merged: dict[str, dict[str, Any]] = {}
        for base in node.bases:
            base_name = ast.unparse(base)
            if base_name in classes:
                base_chain, base_fields = fields_of(base_name)
                chain += base_chain
                merged.update(base_fields)
        merged.update(_class_fields(node, dataclass=dataclass))
        return [name, *chain], merged

    out: dict[str, dict[str, Any]] = {}
    for name in sorted(n for n in names if n in classes):
        chain, fields = fields_of(name)
        out[name] = {"classes": chain, "fields": fields}
    return out


def _choices(node: ast.expr | None, constants: dict[str, list[Any]]) -> list[Any] | None:
    """A literal choice list, or a module-level constant list it names; ``None`` when the
    choices are computed (the flag then takes any value as far as this file can tell)."""
    if node is None:
        return None
    if isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


def _module_constants(root: Path, rel: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for stmt in _parse(root, rel).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                value = _choices(stmt.value, {})
                if value is not None:
                    out[target.id] = value
    return out


def _input_namespaces(tree: ast.Module) -> list[str]:
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and [ast.unparse(t) for t in stmt.targets] == ["_INPUT_NAMESPACES"]
            and isinstance(stmt.value, ast.List)
        ):
            return [ast.unparse(e) for e in stmt.value.elts]
    raise ValueError(f"{SERVER_ARGS}: no _INPUT_NAMESPACES list")


def extract_server_args(root: Path) -> dict[str, Any]:
    """Every flag of ``sglang.launch_server``: ``{flag: {"field", "kind", "choices",
    "deprecated"}}``, and the ``ServerArgs`` field names."""
    constants = _module_constants(root, "sglang/srt/arg_groups/choices.py")
    server_args = _parse(root, SERVER_ARGS)
    wanted = set(_input_namespaces(server_args))
    flags: dict[str, dict[str, Any]] = {}
    fields: list[str] = []
    files: list[str] = [SERVER_ARGS]
    for path in sorted((root / ARG_FIELDS).glob("*.py")):
        rel = f"{ARG_FIELDS}/{path.name}"
        for cls in _parse(root, rel).body:
            if not (isinstance(cls, ast.ClassDef) and cls.name in wanted):
                continue
            wanted.discard(cls.name)
            files.append(rel)
            for stmt in cls.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                name = stmt.target.id
                fields.append(name)
                ann = stmt.annotation
                if not (
                    isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in ("A", "Annotated")
                ):
                    continue
                elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                inner, meta = elts[0], elts[1:]
                arg: dict[str, ast.expr] | None = None
                for m in meta:
                    if isinstance(m, ast.Constant) and isinstance(m.value, str):
                        arg = {}
                        break
                    if isinstance(m, ast.Call) and ast.unparse(m.func) == "Arg":
                        arg = {k.arg: k.value for k in m.keywords if k.arg}
                        break
                if arg is None:
                    continue  # no CLI metadata: add_cli_args_from_dataclass skips it
                if "no_cli" in arg and ast.literal_eval(arg["no_cli"]) is True:
                    continue
                cli = ast.literal_eval(arg["cli_name"]) if "cli_name" in arg else None
                aliases = ast.literal_eval(arg["aliases"]) if "aliases" in arg else []
                inner_src = ast.unparse(inner)
                if "action" in arg:
                    kind = "action"
                elif inner_src in ("bool", "Optional[bool]"):
                    kind = "switch"
                else:
                    kind = "value"
                choices = _choices(arg.get("choices"), constants)
                lit = _unwrap_optional(inner)
                if (
                    choices is None
                    and isinstance(lit, ast.Subscript)
                    and ast.unparse(lit.value) == "Literal"
                ):
                    elts_ = lit.slice.elts if isinstance(lit.slice, ast.Tuple) else [lit.slice]
                    choices = [ast.literal_eval(e) for e in elts_]
                names = [cli or "--" + name.replace("_", "-"), *aliases]
                if "action" in arg and ast.unparse(arg["action"]).endswith("BooleanOptionalAction"):
                    kind = "switch"  # argparse adds the --no- spelling of each name
                    names += ["--no-" + n[2:] for n in names if n.startswith("--")]
                for flag in names:
                    flags[flag] = {"field": name, "kind": kind, "choices": choices,
                                   "deprecated": False, "file": rel}  # fmt: skip
    if wanted:
        raise ValueError(f"namespaces not found under {ARG_FIELDS}: {sorted(wanted)}")
    # The flags add_cli_args registers by hand (computed choices, deprecated spellings).
    add_cli = next(
        n
        for n in ast.walk(server_args)
        if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"
    )
    for call in ast.walk(add_cli):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant)]
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        action = ast.unparse(kw["action"]) if "action" in kw else None
        help_text = ast.unparse(kw["help"]) if "help" in kw else ""
        deprecated = action in _DEPRECATED_ACTIONS or "Deprecated" in help_text
        kind = "switch" if action in ("'store_true'", "DeprecatedStoreTrueAction") else "value"
        for flag in names:
            flags[flag] = {
                "field": kw["dest"].value if "dest" in kw else flag[2:].replace("-", "_"),  # type: ignore[attr-defined]
                "kind": kind,
                "choices": _choices(kw.get("choices"), constants),
                "deprecated": deprecated,
                "file": SERVER_ARGS,
            }
    return {"files": files, "fields": fields, "flags": dict(sorted(flags.items()))}


#: The HTTP contract types the tests use (``sglang/api/v1/api_types.py``).
CONTRACT_TYPES = ("GenerateRequest", "SamplingParams", "GetModelInfoResponse",
                  "GetServerInfoResponse")  # fmt: skip


def extract_contract(root: Path) -> dict[str, Any]:
    """Fields of the HTTP contract structs (``api_types.py``), whether each rejects unknown
    keys (its docstring says so), and the module's type aliases the fields are written in."""
    tree = _parse(root, API_TYPES)
    types: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in CONTRACT_TYPES:
            doc = ast.get_docstring(node) or ""
            types[node.name] = {
                "unknown_keys": "rejected" if "unknown keys rejected" in doc else "ignored",
                "fields": _class_fields(node, dataclass=False),
            }
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)
        ):
            aliases[node.targets[0].id] = ast.unparse(node.value)
    return {"file": API_TYPES, "types": types, "aliases": aliases}


def extract(root: Path) -> dict[str, Any]:
    """The whole reference, read from the SGLang source under ``root``."""
    version = importlib.metadata.version("sglang")
    routes = extract_routes(root)
    bodies = {r["body"] for r in routes.values() if r["body"]}
    return {
        "sglang_version": version,
        "note": "Read from SGLang's source by sglang_api_reference.py (ast, nothing executed); "
        "regenerate with `python sglang_api_reference.py --write`.",
        "routes": {"file": HTTP_SERVER, "items": routes},
        "request_types": {"file": IO_STRUCT, "items": extract_request_types(root, bodies)},
        "server_args": extract_server_args(root),
        "contract": extract_contract(root),
    }


def load_reference() -> dict[str, Any]:
    """The stored reference of the pinned SGLang version."""
    return json.loads(DATA_FILE.read_text(encoding="utf-8"))


# --- what the engine client sends ----------------------------------------------------------------


def client_endpoint_methods(client_cls: type) -> set[str]:
    """Public coroutine methods of the engine client class that call an endpoint (all but
    ``request`` and ``close``)."""
    import inspect

    return {
        name
        for name, fn in inspect.getmembers(client_cls, inspect.iscoroutinefunction)
        if not name.startswith("_") and name not in ("request", "close")
    }


def client_paths(client_cls: type) -> dict[str, set[tuple[str, str]]]:
    """Method name -> the (HTTP method, path) pairs its source sends through
    ``self.request``, read from the source. A call whose method or path is not a literal
    raises: the paths must be knowable to be checked."""
    import inspect
    import textwrap

    out: dict[str, set[tuple[str, str]]] = {}
    for name in sorted(client_endpoint_methods(client_cls)):
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(client_cls, name))))
        pairs = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "request"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"
            ):
                method, path = node.args[0], node.args[1]
                if not (isinstance(method, ast.Constant) and isinstance(path, ast.Constant)):
                    raise ValueError(
                        f"{client_cls.__name__}.{name} calls self.request with a computed "
                        f"method or path: {ast.unparse(node)}"
                    )
                pairs.add((method.value, path.value))
        out[name] = pairs
    return out


# --- checking JSON values against an annotation as written -------------------------------------


class UncheckableType(ValueError):
    """An annotation this checker does not understand (the test must then be extended)."""


def check_value(
    value: Any,
    annotation: str,
    aliases: dict[str, str] | None = None,
    structs: dict[str, dict[str, Any]] | None = None,
) -> str | None:
    """Whether the JSON ``value`` fits the Python annotation written in SGLang's source (as
    pydantic validates an HTTP body: ``int`` is accepted for ``float``, ``bool`` is not an
    ``int``, ``bytes`` marked ``Base64Bytes`` arrive as base64 text). Returns ``None`` when it
    fits, else why not; raises :class:`UncheckableType` for annotations it cannot judge.
    ``aliases`` maps type alias names to the annotations they stand for, ``structs`` struct
    names to ``{"unknown_keys", "fields"}`` (a JSON object checked field by field)."""
    return _Checker(aliases or {}, structs or {}).check(
        value, ast.parse(annotation, mode="eval").body
    )


def check_object(
    body: dict[str, Any],
    fields: dict[str, dict[str, Any]],
    aliases: dict[str, str] | None = None,
    structs: dict[str, dict[str, Any]] | None = None,
    *,
    unknown_keys: str = "rejected",
) -> list[str]:
    """Every way ``body`` breaks a struct's ``fields``: an unknown key (SGLang ignores or
    rejects it; either way the sender meant something that has no effect), a missing
    required field, a value of the wrong type."""
    problems = []
    for key, value in body.items():
        if key not in fields:
            problems.append(f"{key!r} is not a field (unknown keys are {unknown_keys} there)")
            continue
        why = check_value(value, fields[key]["type"], aliases, structs)
        if why is not None:
            problems.append(f"{key!r} ({fields[key]['type']}): {why}")
    missing = [k for k, f in fields.items() if f["required"] and k not in body]
    problems += [f"required field {k!r} is missing" for k in missing]
    return problems


class _Checker:
    def __init__(self, aliases: dict[str, str], structs: dict[str, dict[str, Any]]) -> None:
        self.aliases = aliases
        self.structs = structs

    def check(self, v: Any, node: ast.expr, b64: bool = False) -> str | None:
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return self.check(v, ast.parse(self.aliases[node.id], mode="eval").body, b64)
        if isinstance(node, ast.Name) and node.id in self.structs:
            if not isinstance(v, dict):
                return f"{v!r} is not an object"
            struct = self.structs[node.id]
            problems = check_object(
                v, struct["fields"], self.aliases, self.structs,
                unknown_keys=struct["unknown_keys"],
            )  # fmt: skip
            if struct["unknown_keys"] == "ignored":
                problems = [p for p in problems if "is not a field" not in p]
            return "; ".join(problems) or None
        return _check(v, node, b64, self)


def _check(v: Any, node: ast.expr, b64: bool = False, c: _Checker | None = None) -> str | None:
    c = c or _Checker({}, {})
    if isinstance(node, ast.Constant) and node.value is None:
        return None if v is None else f"{v!r} is not null"
    if isinstance(node, ast.Name):
        t = node.id
        if t == "Any":
            return None
        if t == "str":
            return None if isinstance(v, str) else f"{v!r} is not a string"
        if t == "bool":
            return None if isinstance(v, bool) else f"{v!r} is not a boolean"
        if t == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
            return None if ok else f"{v!r} is not an integer"
        if t == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            return None if ok else f"{v!r} is not a number"
        if t == "bytes" and b64:
            import base64
            import binascii

            try:
                base64.b64decode(v, validate=True)
            except (binascii.Error, TypeError, ValueError):
                return f"{str(v)[:40]!r} is not base64 text"
            return None
        if t in ("dict",):
            return None if isinstance(v, dict) else f"{v!r} is not an object"
        raise UncheckableType(t)
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return None if v is None else c.check(v, args[0], b64)
        if head == "Union":
            reasons: list[str] = []
            unknown: UncheckableType | None = None
            for a in args:
                try:
                    why = c.check(v, a, b64)
                except UncheckableType as exc:  # another member may still accept the value
                    unknown = exc
                    continue
                if why is None:
                    return None
                reasons.append(why)
            if unknown is not None:
                raise unknown
            return " and ".join(reasons)
        if head in ("List", "list"):
            if not isinstance(v, list):
                return f"{v!r} is not a list"
            for i, item in enumerate(v):
                why = c.check(item, args[0], b64)
                if why is not None:
                    return f"item {i}: {why}"
            return None
        if head in ("Dict", "dict"):
            if not isinstance(v, dict):
                return f"{v!r} is not an object"
            for key, item in v.items():
                why = c.check(key, args[0]) or c.check(item, args[1], b64)
                if why is not None:
                    return f"key {key!r}: {why}"
            return None
        if head == "Literal":
            allowed = [ast.literal_eval(a) for a in args]
            return None if v in allowed else f"{v!r} is not one of {allowed}"
        if head == "Annotated":
            marks = {ast.unparse(a) for a in args[1:]}
            return c.check(v, args[0], b64 or "Base64Bytes()" in marks)
        raise UncheckableType(head)
    raise UncheckableType(ast.unparse(node))


def dump(data: Any, depth: int = 0) -> str:
    """JSON with one line per route, field and flag (readable diffs, a small file)."""
    if not isinstance(data, dict) or depth >= 3 or not data:
        return json.dumps(data)
    pad = " " * (depth + 1)
    items = ",\n".join(f"{pad}{json.dumps(k)}: {dump(v, depth + 1)}" for k, v in data.items())
    return "{\n" + items + "\n" + " " * depth + "}"


def main(argv: list[str]) -> int:
    """``--write``: regenerate the data file from the installed SGLang; ``--check``: compare."""
    if installed_version() != PINNED_VERSION:
        print(f"install sglang=={PINNED_VERSION} first (found {installed_version()})")
        return 2
    data = extract(installed_root())
    if "--write" in argv:
        DATA_FILE.write_text(dump(data) + "\n", encoding="utf-8")
        print(f"wrote {DATA_FILE}")
        return 0
    return 0 if data == load_reference() else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
