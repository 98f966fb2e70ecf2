"""Config validation: every malformed config exits 2 naming the field and what is allowed."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from core_support import TESTPLUGIN, VALID_CONFIG, run_miles

from miles_core.config import apply_overrides
from miles_core.errors import MilesUserError


def _valid() -> dict[str, Any]:
    return yaml.safe_load(VALID_CONFIG)


def _set(path: str, value: Any):
    def mutate(cfg):
        node = cfg
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        return cfg

    return mutate


def _drop(key: str):
    def mutate(cfg):
        cfg.pop(key)
        return cfg

    return mutate


def _chain(*fns):
    def mutate(cfg):
        for f in fns:
            cfg = f(cfg)
        return cfg

    return mutate


# (id, mutation of the valid config or raw YAML text, substrings the error must contain)
MALFORMED = [
    (
        "unknown-section",
        _set("trainer", {"lr": 1}),
        ["unknown section 'trainer'", "allowed: run, rollout, buffer, plugins, model, backend"],
    ),
    (
        "unknown-key",
        _set("run.stepz", 3),
        ["run.stepz: unknown key 'stepz'", "allowed: name, output_dir, seed, steps, mode"],
    ),
    ("wrong-type", _set("run.steps", "many"), ["run.steps:", "valid integer", '"many"']),
    (
        "unknown-plugin",
        _set("transport", {"name": "tbroadcst"}),
        [
            "transport.name: no transport 'tbroadcst'",
            "installed: tcolocated, tbroadcast",
            "did you mean 'tbroadcast'",
        ],
    ),
    (
        "missing-section",
        _drop("algorithm"),
        ["algorithm: required section missing", "choose an algorithm (installed: talgo)"],
    ),
    (
        "async-colocated",
        _set("run.mode", "async"),
        ["run.mode 'async' cannot run with run.placement 'colocated'"],
    ),
    (
        "requires-placement",
        _chain(_set("run.placement", "disaggregated")),
        ["transport 'tcolocated' requires placement in {colocated}", "selects disaggregated"],
    ),
    (
        "excludes-placement",
        _set("transport", "tbroadcast"),
        ["transport 'tbroadcast' cannot run with placement colocated"],
    ),
    (
        "plugin-literal",
        _set("backend.precision", "fp8"),
        ["backend.precision:", "'fp32' or 'bf16'", '"fp8"'],
    ),
    (
        "plugin-unknown-option",
        _set("algorithm.clip_hi", 0.3),
        ["algorithm.clip_hi: unknown key 'clip_hi'", "allowed: clip_low, estimator"],
    ),
    (
        "plugin-bound",
        _set("transport.bucket_size_mb", -1),
        ["transport.bucket_size_mb:", "greater than or equal to 1"],
    ),
    ("missing-field", _set("model", {"family": "tfamily"}), ["model.path: required field missing"]),
    (
        "unknown-sink",
        _set("metrics", {"sinks": ["tensorbord"]}),
        ["metrics.sinks[0].name: no metric sink 'tensorbord'", "installed: jsonl, stdout"],
    ),
    (
        "plugin-check",
        _chain(
            _set("run.mode", "async"),
            _set("run.placement", "disaggregated"),
            _set("transport", "tbroadcast"),
            _set("algorithm.estimator", "grpo"),
        ),
        ["algorithm 'talgo': algorithm.estimator 'grpo' needs an off-policy correction"],
    ),
    (
        "unknown-family",
        _set("model.family", "nofamily"),
        ["model.family.name: no model family 'nofamily'", "installed: tfamily"],
    ),
    ("selection-type", _set("engine", 3), ["engine: expected a name or a mapping"]),
    ("bound-top-p", _set("rollout.top_p", 1.5), ["rollout.top_p:", "less than or equal to 1"]),
    ("top-level-list", "- a\n- b\n", ["the top level must be a mapping"]),
    ("not-yaml", "run: {steps: [1, 2\n", ["not valid YAML"]),
    (
        "options-on-optionless",
        _set("engine", {"name": "tengine", "port": 1}),
        ["engine: rollout engine 'tengine' takes no options (got port)"],
    ),
]


@pytest.fixture
def testplugin(make_dist):
    return make_dist("miles-testplugin", "miles_testplugin", TESTPLUGIN)


ENV = {"MILES_PLUGINS": "miles-testplugin"}


@pytest.mark.parametrize(("case", "mutation", "expected"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_config_exits_2_naming_field_and_allowed(
    case, mutation, expected, testplugin, tmp_path
):
    text = mutation if isinstance(mutation, str) else yaml.safe_dump(mutation(_valid()))
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    out = run_miles("config", "validate", str(path), pythonpath=testplugin, env=ENV)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    for needle in expected:
        assert needle in out.stderr, f"{needle!r} not in:\n{out.stderr}"


def test_valid_config_and_overrides(testplugin, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(VALID_CONFIG)
    out = run_miles(
        "config",
        "validate",
        str(path),
        "--json",
        "--set",
        "run.steps=7",
        "--set",
        "algorithm.clip_low=0.3",
        "--set",
        "engine.name=tengine",
        pythonpath=testplugin,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["run"]["steps"] == 7
    assert resolved["algorithm"] == {"name": "talgo", "clip_low": 0.3, "estimator": "dr_grpo"}
    assert resolved["backend"]["micro_batch_tokens"] == 4096  # plugin default filled in
    assert resolved["modality"] == {"name": "text"}
    assert resolved["metrics"]["sinks"] == [{"name": "jsonl", "filename": "metrics.jsonl"}]
    bad = run_miles(
        "config", "validate", str(path), "--set", "run.steps=-3", pythonpath=testplugin, env=ENV
    )
    assert bad.returncode == 2 and "run.steps" in bad.stderr


def test_override_syntax_errors():
    with pytest.raises(MilesUserError, match=r"expected path\.to\.key=value"):
        apply_overrides({}, ["nokey"])
    with pytest.raises(MilesUserError, match=r"run\.steps is not a section"):
        apply_overrides({"run": {"steps": 3}}, ["run.steps.x=1"])
    assert apply_overrides({"algorithm": "grpo"}, ["algorithm.eps=0.1"]) == {
        "algorithm": {"name": "grpo", "eps": 0.1}
    }


def test_schema_export_lists_installed_components(testplugin):
    out = run_miles("config", "schema", pythonpath=testplugin, env=ENV)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    text = json.dumps(schema)
    for name in ("tbackend", "talgo", "tcolocated", "tbroadcast", "exact_match", "jsonl"):
        assert f'"const": "{name}"' in text, name
    assert set(schema["required"]) >= {"model", "backend", "engine", "algorithm", "transport"}


def test_missing_config_file_is_a_user_error(tmp_path):
    out = run_miles("config", "validate", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_train_refuses_a_missing_model_path_before_any_work(testplugin, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(VALID_CONFIG)
    out = run_miles("train", str(path), pythonpath=testplugin, env=ENV)
    assert out.returncode == 2, out.stderr
    assert "model.path '/models/tiny' does not exist" in out.stderr
    assert "Traceback" not in out.stderr
