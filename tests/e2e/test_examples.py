"""Every run config under ``examples/`` validates against the installed plugins, as
``miles config validate`` does (no model is needed to validate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core.config import read_config, validate_config
from miles_core.plugins import collect_registry, create_plugin_manager

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def registry():
    return collect_registry(create_plugin_manager())


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_validates(path: Path, registry) -> None:
    config = validate_config(read_config(path), registry, source=str(path))
    assert config.run.steps >= 1


def test_the_distillation_example_names_a_teacher(registry) -> None:
    config = validate_config(read_config(EXAMPLES[0].with_name("opd.yaml")), registry)
    assert config.algorithm.name == "on_policy_distillation"
    assert config.teacher is not None and config.teacher.engine is None
