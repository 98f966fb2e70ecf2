"""JSON schema of a run config given the installed components (``miles config schema``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import create_model

from miles_core.components import Kind
from miles_core.config.schema import _PLAIN_SECTIONS, _SECTION_SELECTIONS, SELECTIONS, _Strict
from miles_core.registry import Registry


def _selection_schema_model(kind: Kind, registry: Registry) -> Any:
    variants = []
    for component in registry.all(kind):
        base = component.config or _Strict
        variants.append(
            create_model(
                f"{kind.value}__{component.name}".replace("-", "_").replace(".", "_"),
                __base__=base,
                name=(Literal[component.name], ...),  # type: ignore[valid-type,arg-type]
            )
        )
    if not variants:
        return dict[str, Any]
    union: Any = variants[0]
    for v in variants[1:]:
        union = union | v
    return union


def json_schema(registry: Registry) -> dict[str, Any]:
    """JSON schema of a run config given the installed components."""
    fields: dict[str, Any] = {}
    for key, model in _PLAIN_SECTIONS.items():
        fields[key] = (model, None)
    family = _selection_schema_model(Kind.MODEL_FAMILY, registry)
    fields["model"] = (
        create_model(
            "model",
            __base__=_Strict,
            path=(str, ...),
            family=(family | None, None),
            accept_unverified_family=(bool, False),
        ),
        ...,
    )
    data = _selection_schema_model(Kind.DATA_SOURCE, registry)
    fields["eval"] = (
        create_model(
            "eval",
            __base__=_Strict,
            data=(data | None, None),
            loss_data=(data | None, None),
            rollout_function=(
                _selection_schema_model(Kind.ROLLOUT_FUNCTION, registry) | None,
                None,
            ),
            limit=(int, 100),
            every=(int, 0),
            max_new_tokens=(int | None, None),
        ),
        None,
    )
    fields["teacher"] = (
        create_model(
            "teacher",
            __base__=_Strict,
            path=(str, ...),
            engine=(_selection_schema_model(Kind.ROLLOUT_ENGINE, registry) | None, None),
        )
        | None,
        None,
    )
    for spec in SELECTIONS:
        if spec.key in _SECTION_SELECTIONS or spec.many:
            continue
        sel = _selection_schema_model(spec.kind, registry)
        fields[spec.key] = (sel, ...) if spec.required else (sel | None, None)
    for key in ("filters", "metrics"):
        subs = {
            s.sub: (list[_selection_schema_model(s.kind, registry)], None)  # type: ignore[misc]
            for s in SELECTIONS
            if s.key == key and s.sub
        }
        fields[key] = (create_model(key, __base__=_Strict, **subs), None)  # type: ignore[call-overload]
    adapters_entry: Any = create_model(
        "adapters_entry",
        __base__=_Strict,
        name=(str, ...),
        options=(dict[str, Any] | None, None),
        data=(data | None, None),
        reward=(_selection_schema_model(Kind.REWARD_FUNCTION, registry) | None, None),
        eval_data=(data | None, None),
        output_dir=(str | None, None),
    )
    fields["adapters"] = (list[adapters_entry] | None, None)
    model = create_model("MilesRunConfig", __base__=_Strict, **fields)
    schema = model.model_json_schema()
    schema["title"] = "Miles run config"
    return schema
