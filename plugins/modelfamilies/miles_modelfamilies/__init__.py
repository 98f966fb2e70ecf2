"""Verified model families for Miles: chat template, tokenizer, tool-call and reasoning parsers,
stop tokens and roles, checked by the gates of :mod:`miles_core.families`."""

from __future__ import annotations

__version__ = "0.1.0"
