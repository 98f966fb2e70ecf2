"""Random bodies against the live server: never a 5xx, and the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)

token_lists = st.lists(st.integers(min_value=-3, max_value=140), max_size=24)

sampling_params = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats() | st.integers(-2, 5) | json_values,
        "top_p": st.floats() | json_values,
        "top_k": st.integers(-3, 300) | json_values,
        "max_new_tokens": st.integers(-3, 24) | st.sampled_from([2**31 - 1, 2**40]) | json_values,
        "stop_token_ids": token_lists | json_values,
        "ignore_eos": st.booleans() | json_values,
        "sampling_seed": st.integers(-2, 2**64) | json_values,
        "n": st.integers(0, 3),
        "min_p": st.floats(0, 1),
    },
)

generate_bodies = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": token_lists | st.lists(token_lists, max_size=3) | json_values,
        "text": st.text(max_size=10) | json_values,
        "sampling_params": sampling_params | st.lists(sampling_params, max_size=3) | json_values,
        "return_logprob": st.booleans() | json_values,
        "rid": st.text(max_size=8) | st.lists(st.text(max_size=4), max_size=3) | json_values,
        "stream": st.booleans(),
        "logprob_start_len": st.integers(-2, 5),
        "top_logprobs_num": st.integers(-1, 3),
        "unknown_field": json_values,
    },
)

# Control endpoints get bodies that can never be valid (an unknown key, or not an object):
# a valid random body could pause the server or release its memory for the rest of the test.
CONTROL = [
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
]
invalid_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4).map(
    lambda d: {**d, "\x00no-such-field": 1}
)
not_objects = json_values.filter(lambda v: not isinstance(v, dict))


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60, trust_env=False) as client:
        yield client


def _check(http: httpx.Client, resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        body = resp.json()  # every error is JSON with a message (flush_cache answers text)
        assert isinstance(body["error"]["message"], str)
    assert http.get("/health").status_code == 200


FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@pytest.mark.slow
@FUZZ
@given(body=generate_bodies)
def test_fuzz_generate_bodies(http: httpx.Client, body: dict[str, Any]) -> None:
    resp = http.post("/generate", content=json.dumps(body))
    _check(http, resp)


@pytest.mark.slow
@FUZZ
@given(raw=st.binary(max_size=80) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_generate_raw(http: httpx.Client, raw: bytes) -> None:
    resp = http.post("/generate", content=raw)
    _check(http, resp)


@pytest.mark.slow
@FUZZ
@given(endpoint=st.sampled_from(CONTROL), body=invalid_objects | not_objects)
def test_fuzz_control_endpoints(http: httpx.Client, endpoint: str, body: Any) -> None:
    resp = http.post(endpoint, content=json.dumps(body))
    assert 400 <= resp.status_code < 500, resp.text
    _check(http, resp)


def test_server_generates_after_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health_generate").status_code == 200
    resp = http.post(
        "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 2
