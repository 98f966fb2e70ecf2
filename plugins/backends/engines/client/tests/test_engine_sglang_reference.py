"""The stored SGLang API reference is SGLang 0.5.23's, read from its source, and its value
checker can say no.

Where ``sglang`` is installed (the bootstrap installs the pinned wheel without its
dependencies), its version must be the pinned one and re-reading its files must give exactly
the stored reference; elsewhere those two tests skip and the stored file stands in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sglang_api_reference as ref

REFERENCE = ref.load_reference()
INSTALLED = ref.installed_version()
needs_sglang = pytest.mark.skipif(INSTALLED is None, reason="sglang is not installed")


def test_reference_is_of_the_pinned_version() -> None:
    assert REFERENCE["sglang_version"] == ref.PINNED_VERSION
    assert REFERENCE["routes"]["file"] == ref.HTTP_SERVER
    assert REFERENCE["request_types"]["file"] == ref.IO_STRUCT
    assert ref.SERVER_ARGS in REFERENCE["server_args"]["files"]


@needs_sglang
def test_installed_sglang_is_the_pinned_version() -> None:
    assert INSTALLED == REFERENCE["sglang_version"], (
        f"sglang {INSTALLED} is installed but the API reference is of "
        f"{REFERENCE['sglang_version']}: pin it in constraints.txt or regenerate the reference"
    )


@needs_sglang
def test_reference_equals_the_installed_source() -> None:
    fresh = ref.extract(ref.installed_root())
    for part in ("routes", "request_types", "server_args", "contract"):
        assert fresh[part] == REFERENCE[part], f"{part} differs from the installed sglang's source"


def test_reference_holds_what_the_tests_rely_on() -> None:
    routes = REFERENCE["routes"]["items"]
    assert routes["/generate"]["body"] == "GenerateReqInput"
    assert routes["/update_weights_from_tensor"]["body"] == "UpdateWeightsFromTensorReqInput"
    assert routes["/model_info"]["methods"] == ["GET"]
    assert "/get_weight_version" not in routes
    fields = REFERENCE["request_types"]["items"]["AbortReq"]["fields"]
    assert {"rid", "abort_all"} <= set(fields)  # BaseReq's rid is inherited
    flags = REFERENCE["server_args"]["flags"]
    assert flags["--tp-size"]["kind"] == "value" and flags["--tensor-parallel-size"]
    assert flags["--skip-tokenizer-init"]["kind"] == "switch"
    assert flags["--enable-dp-attention"]["deprecated"] is True
    assert len(flags) > 500


CASES = [
    (3, "int", True),
    (True, "int", False),
    (3, "float", True),
    ("3", "float", False),
    (None, "Optional[str]", True),
    ([[1, 2], [3]], "Optional[Union[List[List[int]], List[int]]]", True),
    ([1, "2"], "Optional[Union[List[List[int]], List[int]]]", False),
    ({"a": 1.5}, "Dict[str, float]", True),
    ("retract", "Literal['abort', 'retract', 'in_place']", True),
    ("pause", "Literal['abort', 'retract', 'in_place']", False),
    (["QUJD"], "Annotated[List[bytes], Base64Bytes()]", True),
    (["not base64!"], "Annotated[List[bytes], Base64Bytes()]", False),
]


@pytest.mark.parametrize(("value", "annotation", "fits"), CASES, ids=str)
def test_value_checker(value: object, annotation: str, fits: bool) -> None:
    assert (ref.check_value(value, annotation) is None) == fits


def test_value_checker_refuses_to_guess() -> None:
    with pytest.raises(ref.UncheckableType):
        ref.check_value({}, "Optional[FinishReasonDict]")


def test_object_checker_names_every_problem() -> None:
    fields = REFERENCE["request_types"]["items"]["UpdateWeightVersionReqInput"]["fields"]
    problems = ref.check_object({"version": "3", "abort_all_requests": "yes"}, fields)
    assert any("'version' is not a field" in p for p in problems)
    assert any("'abort_all_requests'" in p and "not a boolean" in p for p in problems)
    assert any("required field 'new_version'" in p for p in problems)
