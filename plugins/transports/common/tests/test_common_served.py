"""Per-tensor checksums: carried by every manifest, checked on arrival (naming the tensor) and
against what the target serves after the commit."""

from __future__ import annotations

import pytest
import torch
from miles_transport_common.bucketing import BucketPacker, Manifest
from miles_transport_common.checksum import _device_hash, part_checksum
from miles_transport_common.errors import BucketRejected, TransportError
from miles_transport_common.served import ServedMismatch, TensorSums, check_reported
from miles_transport_common.staging import (
    NamedWeights,
    ReceiverState,
    ServedTarget,
    UpdateStager,
)


def _stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(64, 64, generator=g)),
        ("big", torch.randn(40_000, generator=g)),  # 160 KB: split across 64 KiB buckets
        ("c", torch.randn(3, generator=g).to(torch.bfloat16)),
    ]


def _buckets(stream: list[tuple[str, torch.Tensor]], **kw: object) -> list:
    packer = BucketPacker(64 << 10, num_buffers=None, hash_inline=True, **kw)
    return [b.ready() for b in packer.pack(stream)]


def _receive(target: object, buckets: list, mode: str = "full", owned: bool = True) -> UpdateStager:
    stager = UpdateStager(
        target.load,  # type: ignore[attr-defined]
        ReceiverState(),
        mode=mode,
        adopt=target.adopt if mode == "full" else None,  # type: ignore[attr-defined]
        read_served=target.read,  # type: ignore[attr-defined]
    )
    stager.begin(1)
    for b in buckets:
        man = Manifest.from_json(b.manifest.to_json())
        stager.add_bucket(man, b.data.clone() if not owned else b.data, owned=owned)
    stager.finish(len(buckets))
    return stager


def _model(stream: list[tuple[str, torch.Tensor]]) -> NamedWeights:
    return NamedWeights({n: torch.zeros_like(t) for n, t in stream})


def _served(weights: NamedWeights, spoil: str | None = None) -> ServedTarget:
    def corrupt(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, t in named:
            if n == spoil:
                t = t.clone()
                t.reshape(-1).view(torch.uint8)[-1] ^= 1  # one bit of one element
            out.append((n, t))
        return out

    return ServedTarget(
        load=lambda named: weights.load(corrupt(named)),
        read=lambda names: {n: weights.tensors[n] for n in names if n in weights.tensors},
        adopt=lambda named: weights.adopt(corrupt(named)),
    )


def test_every_piece_carries_its_checksum_and_the_bucket_combines_them() -> None:
    buckets = _buckets(_stream())
    for b in buckets:
        assert len(b.manifest.sums) == len(b.manifest.pieces)
        assert Manifest.from_json(b.manifest.to_json()).sums == b.manifest.sums
    with pytest.raises(ValueError, match="sums"):
        Manifest.from_json({**buckets[0].manifest.to_json(), "sums": ["x", "y", "z", "w"]})
    with pytest.raises(ValueError, match="sums"):
        Manifest.from_json({**buckets[0].manifest.to_json(), "sums": [1]})


@pytest.mark.parametrize("mode", ["full", "bucket"])
@pytest.mark.parametrize("owned", [True, False])
def test_served_weights_checked_after_the_commit(mode: str, owned: bool) -> None:
    stream = _stream()
    weights = _model(stream)
    stager = _receive(_served(weights), _buckets(stream), mode=mode, owned=owned)
    assert stager.commit() == 1
    for n, t in stream:
        assert torch.equal(weights.tensors[n], t)
    sums = TensorSums()
    for b in _buckets(stream):
        sums.add_manifest(b.manifest)
    assert stager.served_checksum == sums.checksum()
    check_reported("engine 0", {"weights_checksum": stager.served_checksum}, sums, 1)


@pytest.mark.parametrize("mode", ["full", "bucket"])
@pytest.mark.parametrize("name", ["a", "big", "c"])
def test_a_tensor_served_unlike_the_one_sent_refuses_the_commit_naming_it(
    mode: str, name: str
) -> None:
    stream = _stream()
    weights = _model(stream)
    state_stager = _receive(_served(weights, spoil=name), _buckets(stream), mode=mode)
    with pytest.raises(ServedMismatch, match=rf"'{name}'.*served checksum"):
        state_stager.commit()
    assert state_stager.state.version == 0 and not state_stager.state.consistent


def test_a_tensor_the_target_does_not_serve_is_named() -> None:
    stream = _stream()
    weights = _model(stream)
    target = _served(weights)
    hide = ServedTarget(
        load=target.load,
        adopt=target.adopt,
        read=lambda names: {n: t for n, t in target.read(names).items() if n != "c"},
    )
    with pytest.raises(ServedMismatch, match="'c' is not served"):
        _receive(hide, _buckets(stream)).commit()


def test_a_byte_changed_on_the_way_names_its_tensor() -> None:
    stream = _stream()
    buckets = _buckets(stream)
    target = _served(_model(stream))
    stager = UpdateStager(target.load, ReceiverState(), adopt=target.adopt)
    stager.begin(1)
    first = buckets[0]
    data = first.data.clone()
    data[first.manifest.pieces[0].offset + 5] ^= 0x10
    with pytest.raises(BucketRejected, match=r"tensor 'a' \(bytes 0\.\.16384\): checksum"):
        stager.add_bucket(first.manifest, data)


def test_the_sender_names_an_engine_that_reports_another_checksum() -> None:
    sums = TensorSums()
    for b in _buckets(_stream()):
        sums.add_manifest(b.manifest)
    check_reported("http://127.0.0.1:1", {}, sums, 3)  # an engine that does not check
    with pytest.raises(TransportError, match=r"engine http://127\.0\.0\.1:1 serves update 3"):
        check_reported("http://127.0.0.1:1", {"weights_checksum": "0" * 16}, sums, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_any_one_element_change_changes_both_checksums(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(1001, generator=g) * 50).to(dtype)
    flat = t.reshape(-1).view(torch.uint8)
    cpu, dev = part_checksum(flat), _device_hash(flat)
    size = t.element_size()
    for i in (0, 1, 500, 1000):
        for bit in (0, 7):  # the lowest and the highest bit of the element's first byte
            u = flat.clone()
            u[i * size] ^= 1 << bit
            assert part_checksum(u) != cpu and _device_hash(u) != dev
