"""The weight payload reader runs no code and opens no file: an exact allow-list of globals
(no dotted name resolved through an allowed module, no file-backed constructor), torch's own
shared-memory names only, and malformed flattened-bucket metadata refused as a
:class:`BucketRejected` (a 400), never an unexpected error (a 500)."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from miles_transport_common.bucketing import Manifest
from miles_transport_common.errors import BucketRejected
from miles_transport_common.payload import (
    deserialize,
    read_bucket,
    reconstruct,
    serialize,
    shared_cpu_buffer,
)


def _text(s: str) -> bytes:
    # pickle's protocol-0 unicode literal (raw-unicode-escape, one line)
    assert "\n" not in s
    return b"V" + s.encode("raw-unicode-escape") + b"\n"


def call_pickle(module: str, name: str, *args: str) -> str:
    """A protocol-4 pickle that calls ``module``/``name`` with string arguments, as base64
    (what an attacker posts in ``serialized_named_tensors``); a dotted ``name`` is resolved
    attribute by attribute by a plain unpickler."""
    body = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n("
    body += b"".join(_text(a) for a in args)
    return base64.b64encode(body + b"tR.").decode()


def rce_payloads(marker: Path) -> dict[str, str]:
    """The three command-running pickles of the attack, each writing ``marker``."""
    cmd = f"touch {marker}"
    return {
        "torch.os.system": call_pickle("torch", "os.system", cmd),
        "multiprocessing.reduction.os.system": call_pickle(
            "multiprocessing.reduction", "os.system", cmd
        ),
        "torch.utils.cpp_extension.subprocess.getoutput": call_pickle(
            "torch.utils.cpp_extension", "subprocess.getoutput", cmd
        ),
    }


@pytest.mark.parametrize(
    "which",
    [
        "torch.os.system",
        "multiprocessing.reduction.os.system",
        "torch.utils.cpp_extension.subprocess.getoutput",
    ],
)
def test_command_running_pickles_are_refused_and_run_nothing(tmp_path: Path, which: str) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        deserialize(rce_payloads(marker)[which])
    assert not marker.exists()


def test_a_dotted_module_path_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        deserialize(call_pickle("torch.multiprocessing.reductions", "os.system", f"touch {marker}"))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [("torch", "from_file"), ("torch", "load"), ("numpy", "load"), ("builtins", "open")],
)
def test_file_reading_globals_are_refused(tmp_path: Path, module: str, name: str) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a weight")
    with pytest.raises(pickle.UnpicklingError, match=f"refused to unpickle {module}.{name}"):
        deserialize(call_pickle(module, name, str(secret)))


class _SharedMemoryByName:
    """Pickles as torch's rebuild of a CPU storage from shared memory named ``handle``."""

    def __init__(self, manager: bytes, handle: bytes, size: int) -> None:
        self.args = (torch.UntypedStorage, manager, handle, size)

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.multiprocessing.reductions import rebuild_storage_filename

        return (rebuild_storage_filename, self.args)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="host: no /dev/shm (POSIX shared memory)")
def test_shared_memory_outside_torchs_names_is_refused() -> None:
    # a real torch manager socket, so only the name decides
    manager = shared_cpu_buffer(64).untyped_storage()._share_filename_cpu_()[0]
    name = f"/miles_not_torch_{os.getpid()}"
    path = Path("/dev/shm" + name)
    path.write_bytes(b"another process's memory")
    try:
        item = base64.b64encode(pickle.dumps(_SharedMemoryByName(manager, name.encode(), 8)))
        with pytest.raises(pickle.UnpicklingError, match="only torch's own"):
            deserialize(item.decode())
    finally:
        path.unlink()


def test_shared_memory_smaller_than_claimed_is_refused() -> None:
    buf = shared_cpu_buffer(64)
    manager, handle, size = buf.untyped_storage()._share_filename_cpu_()
    item = base64.b64encode(pickle.dumps(_SharedMemoryByName(manager, handle, size * 1000)))
    with pytest.raises(pickle.UnpicklingError, match="holds"):
        deserialize(item.decode())


def test_real_payloads_still_round_trip() -> None:
    """What this repository sends (shared CPU memory by name, empty storages, parameters,
    flattened buckets with SimpleNamespace metadata, plain ``pickle.dumps`` of tensors) still
    reads back exactly."""
    named = [
        ("w", torch.randn(3, 4)),
        ("b", torch.zeros(2, dtype=torch.bfloat16)),
        ("e", torch.empty(0)),
        ("p", torch.nn.Parameter(torch.ones(2))),
        ("t", torch.randn(4, 3).t()),
    ]
    for item in (serialize(named), base64.b64encode(pickle.dumps(named)).decode()):
        back = deserialize(item)
        assert [n for n, _ in back] == [n for n, _ in named]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named, strict=True))
    flat = shared_cpu_buffer(16)
    flat.copy_(torch.arange(16, dtype=torch.uint8))
    meta = [
        SimpleNamespace(
            name="x", shape=torch.Size([2, 2]), dtype=torch.float32, start_idx=0, end_idx=16
        )
    ]
    got_flat, got_meta, header = read_bucket(
        deserialize(serialize({"flattened_tensor": flat, "metadata": meta, "miles": {"op": "x"}}))
    )
    assert torch.equal(got_flat, flat) and header == {"op": "x"}
    assert torch.equal(reconstruct(got_flat, got_meta)[0][1], flat.view(torch.float32).view(2, 2))


def _meta(**over: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "name": "w",
        "shape": torch.Size([4]),
        "dtype": torch.float32,
        "start_idx": 0,
        "end_idx": 16,
    }
    fields.update(over)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    "meta",
    [
        _meta(shape=torch.Size([10]), end_idx=40),  # shape larger than the bucket's bytes
        _meta(shape=torch.Size([10])),  # shape larger than start..end
        _meta(start_idx=-8, end_idx=8, shape=torch.Size([4])),  # negative start
        _meta(start_idx=8, end_idx=24),  # runs past the end
        _meta(start_idx=12, end_idx=4),  # start after end
        _meta(dtype="float32"),  # not a dtype
        _meta(name=7),
        _meta(shape=[-1]),
        SimpleNamespace(name="w"),  # fields missing
    ],
)
def test_malformed_bucket_metadata_is_a_bucket_rejected(meta: SimpleNamespace) -> None:
    flat = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(BucketRejected):
        reconstruct(flat, [meta])


@pytest.mark.parametrize(
    "pieces",
    [
        [["w", "float32", [4], 0, 32, 0, 32]],  # piece past the bucket's end
        [["w", "float32", [4], -4, 16, 0, 16]],  # negative offset
        [["w", "float32", [4], 0, 16, 8, 16]],  # piece runs past its tensor's end
        [["w", "float32", [4], 0, 16, 0, 8]],  # total not the shape's bytes
        [["w", "nodtype", [4], 0, 16, 0, 16]],
        [["w", "float32", [4], 0, 16]],
    ],
)
def test_malformed_manifest_is_a_value_error(pieces: list[Any]) -> None:
    with pytest.raises(ValueError, match="manifest"):
        Manifest.from_json({"seq": 0, "nbytes": 16, "checksum": "", "pieces": pieces})
