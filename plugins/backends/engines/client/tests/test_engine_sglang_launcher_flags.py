"""The SGLang launcher (``miles_engine_sglang``) starts servers with flags SGLang 0.5.23
defines: every flag its command line can hold is a ``sglang.launch_server`` flag (a
``ServerArgs`` field's flag or one ``add_cli_args`` registers), none is deprecated, switches
are given without a value and valued flags with one of SGLang's choices where it lists them.
The command built from options that set everything is parsed by a parser made of SGLang's
flag list, as ``launch_server`` would parse it."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

miles_engine_sglang = pytest.importorskip("miles_engine_sglang")
from miles_engine_sglang.command import (  # noqa: E402
    ATTN_DP_FLAG,
    SWITCH_FLAGS,
    VALUE_FLAGS,
    build_command,
)
from miles_engine_sglang.options import (  # noqa: E402
    RESERVED_FLAGS,
    SGLangEngineConfig,
    reserved_flag,
)

sys.path.insert(0, str(Path(__file__).parent))
import sglang_api_reference as ref  # noqa: E402

REFERENCE = ref.load_reference()
FLAGS: dict[str, dict[str, Any]] = REFERENCE["server_args"]["flags"]
WHERE = f"SGLang {REFERENCE['sglang_version']} ServerArgs"

#: The fixed flags ``build_command`` writes itself (not from the option tables).
FIXED_VALUE_FLAGS = ("--model-path", "--host", "--port", "--base-gpu-id", "--gpu-id-step",
                     "--nccl-port", "--random-seed")  # fmt: skip


def everything_set() -> list[SGLangEngineConfig]:
    """Options that together make the launcher emit every flag it can."""
    on = {name: True for name in SWITCH_FLAGS}
    values: dict[str, Any] = {
        "kv_cache_dtype": "fp8_e4m3", "context_length": 4096, "mem_fraction_static": 0.7,
        "max_running_requests": 64, "max_total_tokens": 100000, "chunked_prefill_size": 4096,
        "attention_backend": "fa3", "load_format": "safetensors", "tokenizer_path": "/tok",
        "rl_on_policy_target": "fsdp", "served_model_name": "policy", "watchdog_timeout": 600.0,
        "dist_timeout": 1800, "nccl_port": 29501, "random_seed": 7, "dtype": "bfloat16",
        "log_level_http": "info", "enable_memory_saver": True,
        "max_lora_rank": 16, "max_loras_per_batch": 4, "max_loaded_loras": 8,
        "lora_paths": ["policy=/ckpt/adapter"], "lora_target_modules": ["q_proj", "v_proj"],
    }  # fmt: skip
    plain = SGLangEngineConfig(**{**on, **values, "tp_size": 2, "dp_size": 2, "pp_size": 2})
    attn_dp = SGLangEngineConfig(tp_size=4, dp_size=2, enable_dp_attention=True)
    return [plain, attn_dp]


def emitted_flags() -> set[str]:
    """Every flag the launcher's command line can hold: the option tables plus every
    ``--`` word of the commands built from :func:`everything_set`."""
    flags = set(VALUE_FLAGS.values()) | set(SWITCH_FLAGS.values()) | {ATTN_DP_FLAG}
    flags |= set(FIXED_VALUE_FLAGS)
    for opts in everything_set():
        flags |= {w for w in build_command("/m", 1, opts) if w.startswith("--")}
    return flags


def test_the_option_tables_are_emitted() -> None:
    cmds = [build_command("/m", 1, o) for o in everything_set()]
    words = {w for cmd in cmds for w in cmd}
    missing = (set(VALUE_FLAGS.values()) | set(SWITCH_FLAGS.values()) | {ATTN_DP_FLAG}) - words
    assert not missing, f"everything_set() does not exercise {sorted(missing)}"


def test_every_flag_is_an_sglang_flag() -> None:
    unknown = sorted(f for f in emitted_flags() if f not in FLAGS)
    assert not unknown, f"{WHERE} has no flag {unknown}"


def test_no_flag_is_deprecated() -> None:
    old = sorted(f for f in emitted_flags() if FLAGS.get(f, {}).get("deprecated"))
    assert not old, f"{WHERE} deprecates {old}"


def test_switches_and_valued_flags_are_of_their_kind() -> None:
    for flag in SWITCH_FLAGS.values():
        assert FLAGS[flag]["kind"] == "switch", f"{flag} takes a value in {WHERE}"
    for flag in [*VALUE_FLAGS.values(), ATTN_DP_FLAG, *FIXED_VALUE_FLAGS]:
        assert FLAGS[flag]["kind"] == "value", f"{flag} is a switch in {WHERE}"


def literal_values(hint: Any) -> list[Any]:
    """The values of a ``Literal[...]`` annotation (also inside ``Optional``)."""
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    return [v for arg in typing.get_args(hint) for v in literal_values(arg)]


def test_literal_options_are_within_sglangs_choices() -> None:
    hints = typing.get_type_hints(SGLangEngineConfig)
    checked = []
    for name, flag in VALUE_FLAGS.items():
        choices, allowed = FLAGS[flag]["choices"], literal_values(hints[name])
        if choices is None or not allowed:
            continue
        checked.append(name)
        outside = [v for v in allowed if v not in choices]
        assert not outside, f"option {name}: {outside} are not {WHERE} choices of {flag}"
    assert {"dtype", "rl_on_policy_target"} <= set(checked)


#: Flags SGLang 0.5.23 declares with ``nargs="*"`` (``sglang/srt/arg_groups/fields/lora.py``:
#: ``lora_target_modules`` by ``Arg(nargs="*")``, ``lora_paths`` through ``LoRAPathAction``
#: with ``nargs="*"``); the stored reference records their kind, not their arity.
LIST_VALUED = {"--lora-target-modules", "--lora-paths"}


def sglang_parser() -> argparse.ArgumentParser:
    """A parser of SGLang's flags: switches take no value, valued flags one (with SGLang's
    choices where they are fixed). Abbreviations are refused, as the launcher never uses
    them."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False, add_help=False)
    for flag, spec in FLAGS.items():
        if flag in LIST_VALUED:
            parser.add_argument(flag, dest=flag, nargs="*")
        elif spec["kind"] == "switch":
            parser.add_argument(flag, action="store_true", dest=flag)
        else:
            parser.add_argument(flag, dest=flag, choices=spec["choices"])
    return parser


@pytest.mark.parametrize("opts", everything_set(), ids=["plain", "attn_dp"])
def test_the_full_command_parses_as_sglang_would(opts: SGLangEngineConfig) -> None:
    argv = build_command("/m", 1, opts)[3:]  # past `python -m sglang.launch_server`
    args, rest = sglang_parser().parse_known_args(argv)
    assert rest == [], f"{WHERE} does not take {rest}"
    assert getattr(args, "--model-path") == "/m"


def test_parser_refuses_what_sglang_refuses() -> None:
    with pytest.raises(argparse.ArgumentError):
        sglang_parser().parse_known_args(["--dtype", "fp8"])
    _, rest = sglang_parser().parse_known_args(["--no-such-flag", "1"])
    assert rest == ["--no-such-flag", "1"]


def test_reserved_flags_are_sglang_flags() -> None:
    unknown = sorted(RESERVED_FLAGS - set(FLAGS))
    assert not unknown, f"{WHERE} has no flag {unknown}"


def test_no_free_sglang_flag_is_taken_for_an_abbreviation() -> None:
    # extra_args refuses abbreviations of reserved flags; a real flag that merely is such a
    # prefix would be refused by mistake.
    wrong = sorted(f for f in FLAGS if f not in RESERVED_FLAGS and reserved_flag(f))
    assert not wrong, wrong
