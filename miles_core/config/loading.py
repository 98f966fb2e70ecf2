"""Reading a run config: YAML with a bound on alias expansion, and ``--set`` overrides."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from miles_core.errors import ConfigError, MilesUserError

#: The most nodes a YAML document may expand to through its aliases (``*name``). A run config
#: has a few hundred; the bound stops an alias bomb (each alias repeating the one before) before
#: it is built in memory.
MAX_YAML_NODES = 100_000


class YamlExpansionError(yaml.YAMLError):
    """A YAML document whose aliases expand past :data:`MAX_YAML_NODES`, or refer to
    themselves."""


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for once every alias is expanded, counted on the
    composed graph (each shared node once per use, memoized: linear in the document), and
    stopped as soon as it passes the bound."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise YamlExpansionError("an alias refers to the node that contains it")
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise YamlExpansionError(
                    f"its aliases (*name) expand it to more than {MAX_YAML_NODES} values"
                )
        on_path.discard(key)
        sizes[key] = total
        return total

    return size(root)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that measures the composed document before building it."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return self.construct_document(node)


def load_yaml(text: str) -> Any:
    """Parse ``text`` like ``yaml.safe_load``, refusing (:class:`YamlExpansionError`) a
    document whose aliases expand it past :data:`MAX_YAML_NODES` values."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a YAML run config and apply ``path.to.key=value`` overrides (values parsed as YAML)."""
    p = Path(path)
    if not p.is_file():
        raise MilesUserError(f"config file {str(p)!r} does not exist")
    try:
        raw = load_yaml(p.read_text()) or {}
    except YamlExpansionError as exc:
        raise ConfigError([f"refused: {exc}"], source=str(p)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source=str(p)) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            [f"the top level must be a mapping of sections, got {type(raw).__name__}"],
            source=str(p),
        )
    return apply_overrides(raw, overrides)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``a.b.c=value`` applied."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise MilesUserError(f"--set {item!r}: expected path.to.key=value")
        try:
            value = load_yaml(text)
        except YamlExpansionError as exc:
            raise MilesUserError(f"--set {item!r}: refused: {exc}") from None
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if isinstance(child, str) and i == 0:  # `algorithm: grpo` shorthand
                child = {"name": child}
            if child is None:
                child = {}
            if not isinstance(child, dict):
                raise MilesUserError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out
