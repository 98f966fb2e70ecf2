"""Bucketing, checksums, staging and deadlines of the shared transport machinery (in-process:
these are the pure parts; each transport's tests run them between real processes)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from miles_transport_common.bucketing import ALIGN, BucketPacker, Manifest
from miles_transport_common.checksum import bucket_checksum, weights_hash
from miles_transport_common.deadline import Deadline, poll_until
from miles_transport_common.errors import BucketRejected, TransportError, TransportTimeout
from miles_transport_common.options import TransportOptions
from miles_transport_common.staging import ReceiverState, UpdateStager, as_loader


def odd_stream() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 257, generator=g)  # ~300 KB: spans several 64 KiB buckets
    return [
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("bf16", torch.randn(33, 7, generator=g).to(torch.bfloat16)),
        ("ints", torch.randint(-5, 5, (1000,), generator=g)),
        ("mask", torch.rand(77, generator=g) > 0.5),
        ("big", big),
        ("transposed", torch.randn(40, 30, generator=g).t()),  # not contiguous
        ("half", torch.randn(5, 3, generator=g).half()),
    ]


def roundtrip(stream, bucket_bytes: int, mode: str = "full"):
    packer = BucketPacker(bucket_bytes)
    target = {n: torch.zeros_like(t) for n, t in stream}
    state = ReceiverState()
    stager = UpdateStager(as_loader(target), state, mode=mode, hash_weights=True)
    stager.begin(7)
    count = 0
    for bucket in packer.pack(stream):
        # what the wire carries: the manifest as JSON and a copy of the bytes
        manifest = Manifest.from_json(bucket.manifest.to_json())
        assert manifest.nbytes <= bucket_bytes
        stager.add_bucket(manifest, bucket.data.clone(), owned=True)
        count += 1
    stager.finish(count, weights_hash(stream))
    assert stager.commit() == 7 and state.version == 7
    return target, packer, count


@pytest.mark.parametrize("mode", ["full", "bucket"])
def test_roundtrip_of_odd_tensors_through_small_buckets(mode: str) -> None:
    stream = odd_stream()
    target, _, count = roundtrip(stream, 64 << 10, mode)
    assert count >= 5
    for name, t in stream:
        assert target[name].dtype == t.dtype and target[name].shape == t.shape
        assert torch.equal(target[name], t), name
    assert weights_hash(target.items()) == weights_hash(stream)


def test_packer_memory_is_bounded_by_its_buffers() -> None:
    huge = [("w", torch.randn(1 << 20))]  # 4 MiB through 64 KiB buckets
    _, packer, count = roundtrip(huge, 64 << 10)
    assert count >= 64
    assert packer.allocated_bytes == 2 * (64 << 10)
    assert len(packer.buffers) == 2


def test_tensors_start_aligned_and_split_at_element_boundaries() -> None:
    packer = BucketPacker(1000)
    for bucket in packer.pack([("a", torch.randn(3)), ("b", torch.randn(700).double())]):
        for p in bucket.manifest.pieces:
            if p.start == 0:
                assert p.offset % ALIGN == 0
            assert p.nbytes % 8 == 0 or p.name == "a"


def test_flipped_byte_is_rejected_and_target_untouched() -> None:
    stream = odd_stream()
    target = {n: torch.zeros_like(t) for n, t in stream}
    before = {n: t.clone() for n, t in target.items()}
    state = ReceiverState(version=3)
    stager = UpdateStager(as_loader(target), state)
    stager.begin(4)
    buckets = list(BucketPacker(64 << 10, num_buffers=64).pack(stream))
    stager.add_bucket(buckets[0].manifest, buckets[0].data)
    bad = buckets[1].data.clone()
    bad[10] ^= 1
    with pytest.raises(BucketRejected, match="checksum"):
        stager.add_bucket(buckets[1].manifest, bad)
    stager.abort()
    assert state.version == 3 and state.consistent
    assert all(torch.equal(target[n], before[n]) for n in target)


def test_missing_bucket_and_wrong_hash_are_rejected() -> None:
    stream = odd_stream()
    stager = UpdateStager(as_loader({}), ReceiverState(), hash_weights=True)
    stager.begin(1)
    buckets = list(BucketPacker(64 << 10, num_buffers=64).pack(stream))
    with pytest.raises(BucketRejected, match="expected 0"):
        stager.add_bucket(buckets[1].manifest, buckets[1].data)
    for b in buckets[:-1]:
        stager.add_bucket(b.manifest, b.data)
    with pytest.raises(BucketRejected, match="buckets arrived"):
        stager.finish(len(buckets))
    stager.add_bucket(buckets[-1].manifest, buckets[-1].data)
    with pytest.raises(BucketRejected, match="weights hash"):
        stager.finish(len(buckets), weights_hash(stream[1:]))


def test_mapping_loader_checks_everything_before_copying() -> None:
    target = {"a": torch.zeros(3), "b": torch.zeros(2)}
    load = as_loader(target)
    with pytest.raises(TransportError, match="has no tensor named 'c'"):
        load([("a", torch.ones(3)), ("c", torch.ones(1))])
    with pytest.raises(TransportError, match=r"received torch.float32 \(4,\)"):
        load([("a", torch.ones(3)), ("b", torch.ones(4))])
    assert not target["a"].any()  # nothing copied by a refused batch


def test_bucket_mode_marks_partial_update_inconsistent() -> None:
    stream = odd_stream()
    target = {n: torch.zeros_like(t) for n, t in stream}
    state = ReceiverState(version=5)
    stager = UpdateStager(as_loader(target), state, mode="bucket")
    stager.begin(6)
    buckets = list(BucketPacker(64 << 10, num_buffers=64).pack(stream))
    stager.add_bucket(buckets[0].manifest, buckets[0].data)
    stager.abort()
    assert state.version == 5 and not state.consistent


def test_weights_hash_is_order_free_and_sensitive() -> None:
    stream = odd_stream()
    assert weights_hash(stream) == weights_hash(list(reversed(stream)))
    changed = [(n, t.clone()) for n, t in stream]
    changed[0][1].add_(1)
    assert weights_hash(changed) != weights_hash(stream)
    renamed = [("x" + n, t) for n, t in stream]
    assert weights_hash(renamed) != weights_hash(stream)


def test_checksum_sees_a_single_bit() -> None:
    a = torch.randint(0, 255, (4097,), dtype=torch.uint8)
    b = a.clone()
    b[4096] ^= 1
    assert bucket_checksum(a) != bucket_checksum(b)


def test_deadline_error_names_the_wait() -> None:
    d = Deadline(0.05, "the receiver to ack bucket 3")
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"timed out after 0.05 s waiting for the receiver"):
        poll_until(lambda: False, d)
    assert time.monotonic() - t0 < 1


def test_options_validate_with_clear_messages() -> None:
    assert TransportOptions().bucket_bytes == 512 << 20
    with pytest.raises(ValueError, match="staging"):
        TransportOptions.model_validate({"staging": "maybe"})
    with pytest.raises(ValueError, match="extra"):
        TransportOptions.model_validate({"bucket_size": 1})


def test_zero_copy_layout_matches_packing_and_its_checksums() -> None:
    # the same stream laid out without copying gives the same manifests (offsets, checksums
    # over the pieces' bytes) as packing; what lands at those offsets verifies on the receiver
    stream = odd_stream()
    packed = [b.manifest for b in BucketPacker(64 << 10).pack(stream)]
    laid = list(BucketPacker(64 << 10, zero_copy=True).pack(stream))
    assert [m.to_json() for m in packed] == [b.manifest.to_json() for b in laid]
    for b in laid:
        region = torch.full((b.manifest.nbytes,), 0xAB, dtype=torch.uint8)  # gaps: garbage
        for piece, src in zip(b.manifest.pieces, b.sources, strict=True):
            region[piece.offset : piece.offset + piece.nbytes].copy_(src)
        assert bucket_checksum(region, b.manifest.pieces) == b.manifest.checksum
    assert not BucketPacker(64 << 10, zero_copy=True).buffers  # nothing allocated


def test_inline_hashing_gives_the_checksums_of_a_separate_pass(monkeypatch) -> None:
    # chunks smaller than the pieces, so a piece is copied and hashed in several chunks
    import miles_transport_common.bucketing as bucketing

    monkeypatch.setattr(bucketing, "INLINE_CHUNK", 4096)
    stream = [*odd_stream(), ("long", torch.randn(20_000))]
    plain = [(b.manifest.to_json(), b.data.clone()) for b in BucketPacker(96 << 10).pack(stream)]
    inline = list(BucketPacker(96 << 10, num_buffers=None, hash_inline=True).pack(stream))
    assert [m for m, _ in plain] == [b.manifest.to_json() for b in inline]
    for (_, data), b in zip(plain, inline, strict=True):
        for p in b.manifest.pieces:  # the same bytes (alignment gaps are not part of it)
            span = slice(p.offset, p.offset + p.nbytes)
            assert torch.equal(data[span], b.data[span]), p.name
        assert bucket_checksum(b.data, b.manifest.pieces) == b.manifest.checksum


def test_a_tensor_that_fits_a_bucket_is_never_split() -> None:
    stream = [(f"t{i}", torch.randn(5000)) for i in range(10)]  # 20 KB each, 64 KiB buckets
    for bucket in BucketPacker(64 << 10).pack(stream):
        assert all(p.whole for p in bucket.manifest.pieces)


def test_adopting_commits_alternate_staging_sets_and_verify_off_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from miles_transport_common.staging import NamedWeights, StagingPool, adopter_of

    stream = odd_stream()
    model = NamedWeights({n: torch.zeros_like(t.contiguous()) for n, t in stream})
    state, pool = ReceiverState(), StagingPool()
    verifier = ThreadPoolExecutor(1)
    served: list[dict[str, int]] = []
    for version in (1, 2, 3):
        stager = UpdateStager(
            as_loader(model), state, pool=pool, adopt=adopter_of(model), verifier=verifier
        )
        stager.begin(version)
        n = 0
        for bucket in BucketPacker(64 << 10).pack(stream):
            buf = pool.bucket((stager.parity, n), bucket.manifest.nbytes).copy_(bucket.data)
            stager.add_bucket(Manifest.from_json(bucket.manifest.to_json()), buf, owned=True)
            n += 1
        stager.finish(n)
        assert stager.commit() == version
        assert all(torch.equal(model.tensors[k], t) for k, t in stream)
        served.append({k: t.data_ptr() for k, t in model.tensors.items()})
    # updates 1 and 3 serve from the same set, update 2 from the other: no model-sized copy
    sized = [k for k, t in model.tensors.items() if t.numel()]
    assert served[0] == served[2] and all(served[1][k] != served[0][k] for k in sized)
    # a corrupted bucket is caught by the verifier thread at finish(); nothing is committed
    stager = UpdateStager(
        as_loader(model), state, pool=pool, adopt=adopter_of(model), verifier=verifier
    )
    stager.begin(4)
    n = 0
    for bucket in BucketPacker(64 << 10).pack(stream):
        buf = pool.bucket((stager.parity, n), bucket.manifest.nbytes).copy_(bucket.data)
        if n == 1:
            buf[0] ^= 1
        stager.add_bucket(Manifest.from_json(bucket.manifest.to_json()), buf, owned=True)
        n += 1
    with pytest.raises(BucketRejected, match="bucket 1 of update 4"):
        stager.finish(n)
    stager.abort()
    assert state.version == 3
    assert {k: t.data_ptr() for k, t in model.tensors.items()} == served[2]
    assert all(torch.equal(model.tensors[k], t) for k, t in stream)
    verifier.shutdown()


def _reference_device_hash(buf: torch.Tensor) -> str:
    # The device hash's definition in one pass (int64 arithmetic wraps the same way in chunks).
    n = buf.numel() - buf.numel() % 4
    words = buf[:n].clone().view(torch.int32).to(torch.int64)
    weights = (torch.arange(words.numel(), dtype=torch.int64) * 2654435761 + 97) | 1
    acc = int((words * weights).sum().item())
    return format(acc & (2**64 - 1), "016x") + bytes(buf[n:].tolist()).hex()


def test_device_hash_takes_any_alignment_in_bounded_chunks(monkeypatch) -> None:
    from miles_transport_common import checksum

    monkeypatch.setattr(checksum, "DEVICE_HASH_WORDS", 5)  # many chunks, one of them short
    data = torch.randint(0, 256, (203,), dtype=torch.uint8)
    for skip in range(4):
        # a piece of a bf16 tensor cut at an odd element starts 2 bytes past a word boundary
        view = data[skip:]
        assert view.storage_offset() % 4 == skip
        assert checksum._device_hash(view) == _reference_device_hash(view.clone())
    flipped = data.clone()
    flipped[101] ^= 4
    assert checksum._device_hash(flipped) != checksum._device_hash(data)


def test_unsplit_tight_packing_is_sglangs_flattened_layout() -> None:
    # split=False, align=1: whole tensors back to back, the layout SGLang computes from names,
    # dtypes and shapes; a tensor larger than a bucket travels alone in a bucket of its size
    from miles_transport_common.engine_side import tight_pieces

    stream = odd_stream()
    packer = BucketPacker(64 << 10, num_buffers=None, align=1, split=False)
    seen = {}
    for bucket in packer.pack(stream):
        pieces = bucket.manifest.pieces
        assert all(p.whole for p in pieces)
        want = tight_pieces(
            [p.name for p in pieces], [p.dtype for p in pieces], [p.shape for p in pieces]
        )
        assert [(p.offset, p.nbytes) for p in pieces] == [(w.offset, w.nbytes) for w in want]
        if len(pieces) > 1:
            assert bucket.manifest.nbytes <= 64 << 10
        for p in pieces:
            seen[p.name] = bucket.data[p.offset : p.offset + p.nbytes].clone()
    big = dict(stream)["big"]
    assert seen["big"].numel() == big.numel() * 4 > 64 << 10
    for name, t in stream:
        assert torch.equal(seen[name], t.contiguous().reshape(-1).view(torch.uint8)), name


def test_a_tensor_alone_travels_from_its_own_memory_with_the_same_checksums() -> None:
    """``alone_in_place``: a tensor larger than a bucket is its bucket's data (no copy, the
    packer's buffers stay one bucket long), with the checksum the copying packer gives it;
    the smaller tensors are packed as before, and the buckets come in the same order."""
    stream = odd_stream()
    kw: dict[str, Any] = dict(num_buffers=2, align=1, split=False, hash_inline=True)
    copied = [
        (b.manifest.seq, b.manifest.checksum, [p.name for p in b.manifest.pieces])
        for b in BucketPacker(64 << 10, **kw).pack(stream)
    ]
    packer = BucketPacker(64 << 10, alone_in_place=True, **kw)
    freed: list[int] = []
    in_place = []
    for b in packer.pack(stream, before_fill=freed.append):
        b.ready()
        in_place.append((b.manifest.seq, b.manifest.checksum, [p.name for p in b.manifest.pieces]))
        if [p.name for p in b.manifest.pieces] == ["big"]:
            big = dict(stream)["big"]
            assert b.data.data_ptr() == big.data_ptr() and b.data.numel() == big.numel() * 4
    assert in_place == copied
    assert len(freed) == len(copied)  # every bucket waited for its slot, the in-place one too
    assert max(buf.numel() for buf in packer.buffers) == 64 << 10


@pytest.mark.parametrize("answer", [b"", b'HTTP/1.1 200 OK\r\nContent-Length: 47\r\n\r\n{"su'])
def test_an_answer_cut_short_is_a_transport_error_naming_the_engine(answer: bytes) -> None:
    """An engine killed while it answers: the connection closes before or in the middle of
    the body. Both are a :class:`TransportError` naming the URL, never a bare http error."""
    import socket
    import threading

    from miles_transport_common.http import call

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer_and_die() -> None:
        conn, _ = srv.accept()
        request = b""
        while not request.endswith(b"}"):  # the whole request, body included
            request += conn.recv(65536)
        conn.sendall(answer)
        conn.close()

    t = threading.Thread(target=answer_and_die, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:\d+/update.*did the engine die"):
        call(url, "/update", {"x": 1}, timeout_s=5)
    t.join(5)
    srv.close()
