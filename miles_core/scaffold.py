"""``miles new plugin KIND NAME``: a ready-to-install plugin distribution with a passing
contract test. The generated component is small but works; its docstrings say what to change."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from miles_core.components import Kind
from miles_core.errors import MilesUserError


@dataclass(frozen=True)
class _Template:
    kind: Kind
    record: str  # component class in miles_core
    body: str  # the implementation: defines Options and Impl
    extra_import: str = ""


_OPTIONS = '''class Options(BaseModel):
    """Options of this {label}, validated from the run config."""

    model_config = ConfigDict(extra="forbid")
{fields}
'''

KINDS: dict[str, _Template] = {
    "reward": _Template(
        Kind.REWARD_FUNCTION,
        "RewardFunction",
        '''
class Impl:
    """Reward 1.0 when the response contains the prompt's answer, else 0.0."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, sample: Sample, prompt: Mapping[str, Any]) -> float:
        text = sample.metadata.get("response_text", "")
        return 1.0 if str(prompt.get(self.options.answer_key, "")) in text else 0.0
''',
        "from collections.abc import Mapping\nfrom typing import Any\n\n"
        "from miles_core import Sample",
    ),
    "group-filter": _Template(
        Kind.GROUP_FILTER,
        "GroupFilter",
        '''
class Impl:
    """Keeps groups with at least ``min_samples`` scored samples."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, group: Group) -> bool:
        scored = [r for r in group.rewards if r is not None]
        return len(scored) >= self.options.min_samples
''',
        "from miles_core import Group\n",
    ),
    "sample-filter": _Template(
        Kind.SAMPLE_FILTER,
        "SampleFilter",
        '''
class Impl:
    """Keeps samples with at most ``max_tokens`` response tokens."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def __call__(self, sample: Sample) -> bool:
        return len(sample.response_ids) <= self.options.max_tokens
''',
        "from miles_core import Sample\n",
    ),
    "data": _Template(
        Kind.DATA_SOURCE,
        "DataSource",
        '''
class Impl:
    """Yields ``count`` addition problems, resumable from its position."""

    #: malformed rows skipped (a generated set has none)
    skipped = 0

    def __init__(self, options: Options) -> None:
        self.options = options
        self.index = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.index < self.options.count:
            a, b = divmod(self.index * 7919 % 10_000, 100)
            self.index += 1
            yield {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
''',
        "from collections.abc import Iterator\nfrom typing import Any\n",
    ),
    "metrics": _Template(
        Kind.METRIC_SINK,
        "MetricSink",
        '''
class Impl:
    """Writes metrics as tab-separated lines into the run folder."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.path: Path | None = None

    def open(self, run_dir: str) -> None:
        self.path = Path(run_dir) / self.options.filename

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.path is not None, "open() first"
        with self.path.open("a") as fh:
            fh.write("\\t".join([str(step), *(f"{k}={v}" for k, v in sorted(metrics.items()))]))
            fh.write("\\n")

    def close(self) -> None:
        pass
''',
        "from collections.abc import Mapping\nfrom pathlib import Path\n",
    ),
}

_FIELDS = {
    "reward": '    answer_key: str = Field("answer", description="prompt field with the answer")',
    "group-filter": "    min_samples: int = Field(2, ge=1)",
    "sample-filter": "    max_tokens: int = Field(1024, ge=1)",
    "data": "    count: int = Field(100, ge=1)",
    "metrics": '    filename: str = "metrics.tsv"',
}

# Kinds whose working object needs a model, an engine or devices: the scaffold gives the full
# contract to fill in; the contract test checks the registration and the options schema.
_PROTOCOL_KINDS = {
    "backend": (Kind.TRAINER_BACKEND, "TrainerBackend", "Trainer"),
    "engine": (Kind.ROLLOUT_ENGINE, "RolloutEngine", "EngineLauncher"),
    "algorithm": (Kind.ALGORITHM, "Algorithm", "AlgorithmImpl"),
    "transport": (Kind.TRANSPORT, "Transport", "WeightTransport"),
    "family": (Kind.MODEL_FAMILY, "ModelFamily", "Family"),
    "modality": (Kind.MODALITY, "Modality", None),
    "rollout": (Kind.ROLLOUT_FUNCTION, "RolloutFunction", "RolloutFn"),
    "loss": (Kind.LOSS_FUNCTION, "LossFunction", "LossFn"),
}
for _word, (_kind, _record, _proto) in _PROTOCOL_KINDS.items():
    _FIELDS[_word] = '    note: str = Field("", description="replace with your options")'
    KINDS[_word] = _Template(
        _kind,
        _record,
        f'''
class Impl:
    """Your {_kind.label}. Implement the methods of ``miles_core.contracts.{_proto or "-"}``
    (see CONTRIBUTING.md, "The hook reference")."""

    def __init__(self, options: Options) -> None:
        self.options = options
''',
    )

_PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A Miles {label} plugin: {name}"
requires-python = ">=3.10"
dependencies = ["miles-core"]

[project.entry-points.miles]
{name} = "{package}"
"""

_MODULE = '''"""{dist}: the {label} ``{name}`` for Miles."""

from __future__ import annotations

{extra_import}
from pydantic import BaseModel, ConfigDict, Field  # noqa: F401

from miles_core import {record}, hookimpl


{options}
{body}

@hookimpl
def {hook}(register):
    register({record}(name="{name}", factory=Impl, config=Options,
                      description="{label} scaffolded by miles new plugin"))
'''

_TEST = '''"""Contract test of {dist}: it registers and meets its contract."""

import {package}
from miles_core.components import Kind
from miles_core.testing.contracts import check_component


def test_{name}_registers_and_meets_contract(miles_register, miles_registry):
    miles_register({package}, name="{name}")
    component = miles_registry().get(Kind("{kind}"), "{name}")
    check_component(component, build={build})
'''

_README = """# {dist}

A Miles {label} plugin providing `{name}`.

    pip install -e .
    pytest

Select it in a run config:

    {section}

`miles plugins` lists it once installed.
"""

_SECTION = {
    Kind.REWARD_FUNCTION: "reward: {{name: {name}}}",
    Kind.GROUP_FILTER: "filters: {{group: [{name}]}}",
    Kind.SAMPLE_FILTER: "filters: {{sample: [{name}]}}",
    Kind.DATA_SOURCE: "data: {{name: {name}}}",
    Kind.METRIC_SINK: "metrics: {{sinks: [{name}]}}",
    Kind.TRAINER_BACKEND: "backend: {{name: {name}}}",
    Kind.ROLLOUT_ENGINE: "engine: {{name: {name}}}",
    Kind.ALGORITHM: "algorithm: {{name: {name}}}",
    Kind.TRANSPORT: "transport: {{name: {name}}}",
    Kind.MODEL_FAMILY: "model: {{path: ..., family: {name}}}",
    Kind.MODALITY: "modality: {{name: {name}}}",
    Kind.ROLLOUT_FUNCTION: "rollout_function: {{name: {name}}}",
    Kind.LOSS_FUNCTION: "loss: {{name: {name}}}",
}


#: The family scaffold's chat template when none is given: ChatML whose assistant turns are
#: ``<think>\n{reasoning}\n</think>\n\n{content}`` (``{content}`` without reasoning), tool calls
#: ``<tool_call>{json}</tool_call>`` blocks (what ``TemplateFamily``'s default parsers read).
#: Every earlier turn renders as it was generated, so it only ever appends.
FAMILY_TEMPLATE = r"""{%- if tools or messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
    {%- if tools %}
        {{- '\n\n# Tools\n\nCall a function by writing <tool_call>\n' }}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n<tools>' }}
        {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
        {{- '\n</tools>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content %}
        {%- set reasoning = reasoning.strip('\n') if reasoning is string else '' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif %}
        {{- content.lstrip('\n') }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function or call %}
            {%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson %}
            {{- '\n' if (content or not loop.first) else '' }}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + args }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_FAMILY_MODULE = '''"""{dist}: the model family ``{name}`` for Miles.

The chat template is ``chat_template.jinja`` and the tokenizer ``tokenizer.json`` (a Hugging
Face tokenizer file), both beside this module and shipped as package data. Change the
constants below to what your template writes, then run ``miles family verify {name}``.
Certificates in ``certificates/`` beside this module ship too: verify with
``MILES_CERT_DIR`` set to that folder, and a user of this package needs no gate run of their
own while the family is the one you verified.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from miles_core import ModelFamily, hookimpl

HERE = Path(__file__).resolve().parent
#: Strings that end an assistant turn; each must be one token of the tokenizer.
STOP_TOKENS = ("<|im_end|>",)
#: Whether assistant turns carry reasoning (``<think>...</think>``, parsed back).
THINKING = True


class Options(BaseModel):
    """Options of this family, validated from the run config (none yet)."""

    model_config = ConfigDict(extra="forbid")


def build(options: Options | None = None) -> Any:
    """The family: template, tokenizer, parsers and stop tokens."""
    from miles_modelfamilies.family import TemplateFamily
    from miles_modelfamilies.parsers import ThinkReasoningParser
    from miles_modelfamilies.tokenizer import JsonTokenizer

    return TemplateFamily(
        name="{name}",
        description="{name}: chat_template.jinja with tokenizer.json",
        template=(HERE / "chat_template.jinja").read_text(encoding="utf-8"),
        tokenizer=JsonTokenizer(HERE / "tokenizer.json"),
        stop_tokens=STOP_TOKENS,
        thinking=THINKING,
        reasoning_parser=ThinkReasoningParser() if THINKING else None,
    )


@hookimpl
def miles_register_model_families(register):
    register(ModelFamily(name="{name}", factory="{package}:build", config=Options,
                         description="model family scaffolded by miles new plugin"))
'''

_FAMILY_PYPROJECT_EXTRA = """
[tool.setuptools.package-data]
{package} = ["chat_template.jinja", "tokenizer.json", "certificates/*.json"]
"""


def _family_files(
    root: Path, values: dict[str, str], template: Path | None, tokenizer: Path | None
) -> None:
    """The family scaffold: a module building a ``TemplateFamily`` from the template and the
    tokenizer file it ships (copied from ``template`` and ``tokenizer`` when given)."""
    package = root / values["package"]
    text = template.read_text(encoding="utf-8") if template else FAMILY_TEMPLATE
    (package / "chat_template.jinja").write_text(text, encoding="utf-8")
    if tokenizer is not None:
        (package / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (package / "__init__.py").write_text(_FAMILY_MODULE.format(**values))
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text().replace(
        'dependencies = ["miles-core"]', 'dependencies = ["miles-core", "miles-modelfamilies"]'
    )
    pyproject.write_text(text + _FAMILY_PYPROJECT_EXTRA.format(**values))


def _check_family_files(kind: str, template: Path | None, tokenizer: Path | None) -> None:
    """Refuse ``--template`` / ``--tokenizer`` that the scaffold cannot ship, before anything
    is written: given for another kind, missing, a template that is not UTF-8 text, a
    tokenizer file that is not JSON."""
    if kind != "family":
        if template is not None or tokenizer is not None:
            raise MilesUserError(
                f"--template and --tokenizer are options of the family scaffold, not of {kind!r}"
            )
        return
    for path, what in ((template, "template"), (tokenizer, "tokenizer")):
        if path is not None and not path.is_file():
            raise MilesUserError(f"--{what} {path}: no such file")
    if template is not None:
        try:
            template.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise MilesUserError(f"--template {template}: not UTF-8 text ({exc})") from None
    if tokenizer is not None:
        try:
            json.loads(tokenizer.read_bytes())
        except ValueError as exc:
            raise MilesUserError(
                f"--tokenizer {tokenizer}: not a Hugging Face tokenizer.json (JSON): {exc}"
            ) from None


def scaffold_plugin(
    kind: str,
    name: str,
    output: Path,
    *,
    template: Path | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Write a plugin distribution ``miles-<name>`` of ``kind`` under ``output``.

    For ``kind="family"``: a family built from ``chat_template.jinja`` (a copy of ``template``,
    or :data:`FAMILY_TEMPLATE`) and ``tokenizer.json`` (a copy of ``tokenizer``; without it,
    put the tokenizer file there before building the family)."""
    if kind not in KINDS:
        raise MilesUserError(f"no plugin kind {kind!r}; kinds: {', '.join(sorted(KINDS))}")
    if not re.match(r"^[a-z][a-z0-9_]*$", name):
        raise MilesUserError(
            f"plugin name {name!r} is invalid: use lowercase letters, digits and '_', "
            "starting with a letter"
        )
    t = KINDS[kind]
    dist = f"miles-{name.replace('_', '-')}"
    package = f"miles_{name}"
    root = output / dist
    if root.exists():
        raise MilesUserError(f"{root} already exists")
    _check_family_files(kind, template, tokenizer)
    label = t.kind.label
    values = {
        "dist": dist,
        "package": package,
        "name": name,
        "label": label,
        "record": t.record,
        "hook": t.kind.hook,
        "kind": t.kind.value,
        "extra_import": t.extra_import,
        "body": t.body,
        "options": _OPTIONS.format(label=label, fields=_FIELDS[kind]),
        "build": str(kind not in _PROTOCOL_KINDS),
        "section": _SECTION[t.kind].format(name=name),
    }
    (root / package).mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(_PYPROJECT.format(**values))
    (root / package / "__init__.py").write_text(_MODULE.format(**values))
    if kind == "family":
        # the contract test builds the family once its tokenizer file is there
        values["build"] = str(tokenizer is not None)
        _family_files(root, values, template, tokenizer)
    (root / "tests" / f"test_{name}_contract.py").write_text(_TEST.format(**values))
    (root / "README.md").write_text(_README.format(**values))
    return root
