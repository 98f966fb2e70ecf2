"""Chat templates read from the package that ships them.

The PyPI package ``miles-tito-tokenizers`` (Apache-2.0) ships fixed chat templates in
``miles_tito_tokenizers/templates/``: Qwen templates with a ``clear_thinking`` switch whose
``false`` keeps every assistant turn's reasoning in the render (append-only). Families that use
one read it from the installed distribution when they are built, byte for byte, instead of
keeping a copy; the template text is part of the family's fingerprint, so a different release
of the package with a changed template makes the family's certificates ``stale``. The package
is a dependency of this distribution, pinned to :data:`PINNED_VERSION`.

The file is located through the distribution's metadata, not by importing the package: its
``__init__`` imports transformers, which building a family never needs.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

#: The distribution the templates come from.
DISTRIBUTION = "miles-tito-tokenizers"
#: The version this distribution pins (its pyproject says ``==`` this).
PINNED_VERSION = "0.1.1"
#: Where the templates lie inside the distribution.
TEMPLATE_FOLDER = "miles_tito_tokenizers/templates"


def _install_hint() -> str:
    return f"pip install '{DISTRIBUTION}=={PINNED_VERSION}'"


def template_text(name: str) -> str:
    """The text of template ``name`` (``qwen3_fixed.jinja``...) as the installed
    ``miles-tito-tokenizers`` ships it. Raises ``RuntimeError`` naming the package and the
    command that installs it when the package is missing, is another version than the pinned
    one, or does not ship ``name``."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the chat template {name} comes from the {DISTRIBUTION} package, which is not "
            f"installed: {_install_hint()}"
        ) from exc
    if dist.version != PINNED_VERSION:
        raise RuntimeError(
            f"the chat template {name} is read from {DISTRIBUTION} {PINNED_VERSION}, but "
            f"{dist.version} is installed: {_install_hint()}"
        )
    path = f"{TEMPLATE_FOLDER}/{name}"
    listed = {str(f) for f in dist.files or ()}
    if path not in listed:
        shipped = sorted(f.rsplit("/", 1)[1] for f in listed if f.startswith(TEMPLATE_FOLDER))
        raise RuntimeError(
            f"{DISTRIBUTION} {dist.version} ships no template {name!r}; it ships: "
            + ", ".join(shipped)
        )
    # decoded from the bytes, newlines untouched: the fingerprint hashes the file's own text
    return Path(str(dist.locate_file(path))).read_bytes().decode("utf-8")
