"""Registration through the real plugin manager and entry point (requires
``pip install -e plugins/modelfamilies --no-deps``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from miles_core import Kind
from miles_core.plugins import collect_registry, create_plugin_manager
from miles_core.testing.contracts import check_component


@pytest.fixture(scope="module")
def registry():  # type: ignore[no-untyped-def]
    pm = create_plugin_manager(autoload=True, allow=["miles-modelfamilies"], trace=False)
    assert pm.infos["modelfamilies"].distribution == "miles-modelfamilies"
    return collect_registry(pm)


def test_families_registered_through_the_entry_point(registry) -> None:  # type: ignore[no-untyped-def]
    assert {"smollm2", "qwen3"} <= set(registry.names(Kind.MODEL_FAMILY))
    owner = registry.owner(Kind.MODEL_FAMILY, "qwen3")
    assert owner.distribution == "miles-modelfamilies"
    assert owner.registers["model_family"] == [
        "smollm2",
        "qwen3",
        "qwen3_5",
        "qwen3_thinking_2507",
        "deepseek_v4",
    ]


@pytest.mark.parametrize(
    "name", ["smollm2", "qwen3", "qwen3_5", "qwen3_thinking_2507", "deepseek_v4"]
)
def test_registered_families_pass_the_component_contract(registry, name: str) -> None:  # type: ignore[no-untyped-def]
    family = check_component(registry.get(Kind.MODEL_FAMILY, name))
    assert family.name == name


def test_qwen3_options_are_validated(registry) -> None:  # type: ignore[no-untyped-def]
    config = registry.get(Kind.MODEL_FAMILY, "qwen3").config
    assert config is not None
    with pytest.raises(ValidationError, match="keep-reasoning"):
        config.model_validate({"template": "latest"})
    with pytest.raises(ValidationError, match="enable_thinkng"):
        config.model_validate({"enable_thinkng": False})
    built = registry.get(Kind.MODEL_FAMILY, "qwen3").build(config(enable_thinking=False))
    assert built.template_args == {"enable_thinking": False, "clear_thinking": False}
    assert built.thinking is False


def test_listing_the_plugin_imports_no_template_or_tokenizer_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from miles_core.plugins import create_plugin_manager, collect_registry\n"
        "collect_registry(create_plugin_manager(allow=['miles-modelfamilies'], trace=False))\n"
        "heavy = ('jinja2', 'tokenizers', 'tiktoken', 'transformers', 'torch', 'gguf')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
