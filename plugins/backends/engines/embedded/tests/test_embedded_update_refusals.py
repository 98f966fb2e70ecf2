"""A live embedded engine refuses what must not become its weights, with nothing changed.

A request body that would run a command (or read a file) is a 400 and runs nothing; an update
with a wrong dtype (by tensor and by a real gloo broadcast), NaN or infinite values, no weight,
non-tensor entries or a version the protocol does not allow is a 400, and the engine's greedy
output and reported ``weight_version`` stay what they were.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from miles_transport_common.payload import serialize, shared_cpu_buffer

PROMPT = [10, 20, 30, 40]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
WEIGHT = "model.norm.weight"
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    """One engine of this module (LoRA enabled, so the adapter endpoint reads its body)."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    opts = EmbeddedEngineConfig(
        max_running_requests=4,
        context_length=64,
        num_threads=1,
        startup_timeout_s=120,
        enable_lora=True,
        max_lora_rank=8,
    )
    launcher = build(opts)
    url = launcher.launch(str(tiny_model), index=0)
    try:
        yield url
    finally:
        launcher.shutdown()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def state(url: str) -> tuple[list[int], list[float], str | None]:
    """(greedy output ids, their log-probs, the reported weight version)."""
    from miles_engine_client import EngineClient

    async def main() -> tuple[list[int], list[float], str | None]:
        async with EngineClient(url, timeout_s=60) as c:
            r = await c.generate(PROMPT, GREEDY)
            return list(r.output_ids), list(r.logprobs), await c.get_weight_version()

    return asyncio.run(main())


def update(url: str, named: Any, version: str | None = "7") -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"serialized_named_tensors": [serialize(named)]}
    if version is not None:
        body["weight_version"] = version
    return post(url, "/update_weights_from_tensor", body)


def call_pickle(module: str, name: str, *args: str) -> str:
    body = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n("
    for a in args:
        body += b"V" + a.encode("raw-unicode-escape") + b"\n"
    return base64.b64encode(body + b"tR.").decode()


RCE = [
    ("torch", "os.system"),
    ("multiprocessing.reduction", "os.system"),
    ("torch.utils.cpp_extension", "subprocess.getoutput"),
]


@pytest.mark.parametrize(
    "endpoint", ["/update_weights_from_tensor", "/load_lora_adapter_from_tensors"]
)
@pytest.mark.parametrize(("module", "name"), RCE)
def test_command_running_bodies_answer_400_and_run_nothing(
    engine: str, tmp_path: Path, endpoint: str, module: str, name: str
) -> None:
    marker = tmp_path / "ran"
    item = call_pickle(module, name, f"touch {marker}")
    body: dict[str, Any] = {"serialized_named_tensors": [item]}
    if endpoint == "/load_lora_adapter_from_tensors":
        body.update(lora_name="x", config_dict={"r": 2, "lora_alpha": 4})
    before = state(engine)
    status, answer = post(engine, endpoint, body)
    assert status == 400, answer
    assert "refused" in json.dumps(answer)
    assert not marker.exists()
    assert state(engine) == before


@pytest.mark.parametrize(
    "endpoint", ["/update_weights_from_tensor", "/load_lora_adapter_from_tensors"]
)
def test_a_file_named_in_the_body_is_not_loaded(engine: str, endpoint: str) -> None:
    body: dict[str, Any] = {
        "serialized_named_tensors": [call_pickle("torch", "from_file", "/etc/hostname")]
    }
    if endpoint == "/load_lora_adapter_from_tensors":
        body.update(lora_name="x", config_dict={"r": 2, "lora_alpha": 4})
    status, answer = post(engine, endpoint, body)
    assert status == 400 and "torch.from_file" in json.dumps(answer)


def _with(value: float) -> torch.Tensor:
    t = torch.ones(64)
    t[3] = value
    return t


BAD_UPDATES: dict[str, Any] = {
    **{
        f"dtype-{dt}": [(WEIGHT, torch.ones(64, dtype=getattr(torch, dt)))]
        for dt in ("int64", "bool", "complex64", "uint8", "float64", "bfloat16")
    },
    "nan": [(WEIGHT, _with(float("nan")))],
    "inf": [(WEIGHT, _with(float("inf")))],
    "-inf": [(WEIGHT, _with(float("-inf")))],
    "empty": [],
    "non-tensor": [(WEIGHT, [1.0] * 64)],
    "non-tensor-beside-a-tensor": [(WEIGHT, torch.ones(64)), ("model.x", 3)],
    "not-pairs": [WEIGHT],
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_a_bad_update_is_refused_with_nothing_changed(engine: str, case: str) -> None:
    before = state(engine)
    status, answer = update(engine, BAD_UPDATES[case], version="evil")
    assert status == 400, answer
    assert answer["success"] is False
    assert state(engine) == before


@pytest.mark.parametrize("version", ["forged version", "1\n2", "<script>", "", "x" * 65, "é", "-1"])
def test_a_version_the_protocol_does_not_allow_is_refused(engine: str, version: str) -> None:
    before = state(engine)
    status, answer = update(engine, [(WEIGHT, torch.full((64,), 0.5))], version=version)
    assert status == 400, answer
    assert state(engine) == before  # the (valid) weights were not loaded either
    status, answer = post(engine, "/update_weight_version", {"new_version": version})
    assert status == 400, answer
    assert state(engine) == before


def test_legitimate_versions_still_apply(engine: str) -> None:
    """A transport's integer versions and a named one still work (and are undone here)."""
    ids, logprobs, start = state(engine)
    assert start is not None
    for version in ("42", "named-v1.2"):
        status, answer = post(engine, "/update_weight_version", {"new_version": version})
        assert status == 200, answer
        assert state(engine)[2] == version
    post(engine, "/update_weight_version", {"new_version": start})
    assert state(engine) == (ids, logprobs, start)


def test_malformed_bucket_metadata_is_a_400(engine: str) -> None:
    flat = shared_cpu_buffer(16)
    meta = [
        SimpleNamespace(
            name=WEIGHT, shape=torch.Size([64]), dtype=torch.float32, start_idx=0, end_idx=16
        )
    ]
    before = state(engine)
    status, answer = post(
        engine,
        "/update_weights_from_tensor",
        {
            "serialized_named_tensors": [serialize({"flattened_tensor": flat, "metadata": meta})],
            "load_format": "flattened_bucket",
            "weight_version": "9",
        },
    )
    assert status == 400, answer
    assert state(engine) == before


@pytest.mark.parametrize("case", ["int64", "bool", "nan", "inf"])
def test_bad_lora_tensors_are_refused(engine: str, case: str) -> None:
    """A rank-2 adapter of q_proj, well formed but for the one bad lora_A (an adapter whose
    tensors are all good loads: the last case)."""
    a = {
        "int64": torch.ones(2, 64, dtype=torch.int64),
        "bool": torch.ones(2, 64, dtype=torch.bool),
        "nan": torch.full((2, 64), torch.nan),
        "inf": torch.full((2, 64), torch.inf),
    }[case]
    status, answer = post(
        engine,
        "/load_lora_adapter_from_tensors",
        {
            "lora_name": "bad",
            "config_dict": {"r": 2, "lora_alpha": 4},
            "serialized_named_tensors": [serialize([(LORA_A, a), (LORA_B, torch.ones(64, 2))])],
        },
    )
    assert status == 400, answer
    assert "bad" not in answer.get("loaded_adapters", {})


def test_a_good_lora_adapter_from_tensors_still_loads(engine: str) -> None:
    status, answer = post(
        engine,
        "/load_lora_adapter_from_tensors",
        {
            "lora_name": "good",
            "config_dict": {"r": 2, "lora_alpha": 4},
            "serialized_named_tensors": [
                serialize([(LORA_A, torch.ones(2, 64)), (LORA_B, torch.ones(64, 2))])
            ],
        },
    )
    assert status == 200, answer
    assert "good" in answer["loaded_adapters"]
    status, answer = post(engine, "/unload_lora_adapter", {"lora_name": "good"})
    assert status == 200, answer


@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_a_wrong_dtype_by_a_real_gloo_broadcast_is_refused(engine: str, dtype: str) -> None:
    """This process is rank 0 of a real gloo group and broadcasts the tensor it names."""
    import torch.distributed as dist
    from miles_engine_embedded.launcher import free_port
    from miles_transport_common.groups import join_update_group, leave_update_group

    port = free_port()
    group: dict[str, Any] = {}

    def trainer_side() -> None:
        group["pg"] = join_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="refusals",
            backend="gloo",
            timeout_s=60,
        )

    th = threading.Thread(target=trainer_side)
    th.start()
    status, answer = post(
        engine,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "refusals",
            "backend": "gloo",
        },
    )
    th.join()
    assert status == 200, answer
    before = state(engine)

    def send() -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group["pg"].broadcast([torch.ones(64, dtype=getattr(torch, dtype))], opts).wait()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        status, answer = post(
            engine,
            "/update_weights_from_distributed",
            {
                "names": [WEIGHT],
                "dtypes": [dtype],
                "shapes": [[64]],
                "group_name": "refusals",
                "weight_version": "forged",
            },
        )
    finally:
        sender.join(timeout=60)
        leave_update_group(group["pg"])
    assert status == 400, answer
    assert "dtype" in answer["message"]
    assert state(engine) == before


def test_nonfinite_weights_are_accepted_only_when_allowed(tiny_model: Path) -> None:
    from miles_engine_embedded.weights import ModelHolder

    nan = [(WEIGHT, _with(float("nan")))]
    strict = ModelHolder(str(tiny_model), device="cpu", dtype="float32", weight_version="0")
    with pytest.raises(ValueError, match="allow_nonfinite_weights"):
        strict.load_named(nan)
    assert bool(torch.isfinite(strict.params[WEIGHT]).all())
    lax = ModelHolder(
        str(tiny_model),
        device="cpu",
        dtype="float32",
        weight_version="0",
        allow_nonfinite_weights=True,
    )
    lax.load_named(nan)
    assert bool(torch.isnan(lax.params[WEIGHT]).any())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("where", [0, 4099, -1])
def test_check_finite_finds_one_bad_value_anywhere(
    dtype: torch.dtype, bad: Any, where: int
) -> None:
    """The check reads extremes, not every element's flag: one NaN or infinity at the first,
    a middle or the last element is still found, in every float dtype, also beside huge finite
    values and in a strided view; a finite tensor (and an empty one) passes."""
    from miles_engine_embedded.weights import check_finite

    t = torch.randn(8192, dtype=torch.float64).to(dtype)
    t[1] = torch.finfo(torch.float16 if dtype == torch.float16 else torch.bfloat16).max
    if bad is None:
        check_finite("w", t)
        check_finite("w", t[::3])
        check_finite("w", t[:0])
        return
    t[where] = bad
    with pytest.raises(ValueError, match="'w' holds NaN or infinite"):
        check_finite("w", t)
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_finite("w", t.view(2, 4096).t())  # not contiguous
    u = torch.randn(8192, dtype=torch.float64).to(dtype)
    u[7], u[where] = float("-inf"), bad  # the other infinity beside it
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_finite("w", u)


def test_plain_pickles_of_tensors_still_load(engine: str) -> None:
    """SGLang callers that ``pickle.dumps`` their tensors keep working (and this undoes
    itself)."""
    ids, logprobs, start = state(engine)
    assert start is not None
    keep = torch.ones(64)  # the tiny model's norm starts at ones (transformers' init)
    item = base64.b64encode(pickle.dumps([(WEIGHT, keep)])).decode()
    status, answer = post(
        engine,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [item], "weight_version": start},
    )
    assert status == 200, answer
    assert state(engine) == (ids, logprobs, start)
