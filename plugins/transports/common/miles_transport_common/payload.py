"""The serialized items of SGLang's ``POST /update_weights_from_tensor``.

SGLang serializes each item with its ``MultiprocessingSerializer``: torch's ForkingPickler
reductions, base64 for HTTP. A CUDA tensor then travels as its CUDA IPC handle and a CPU tensor
whose storage is in shared memory as the name of that memory, so nothing but a handle crosses
the process boundary. This module produces and reads exactly that:

* :func:`serialize` pickles with torch's reductions; a CPU storage goes by its shared-memory
  *file name* (torch's ``file_system`` strategy, applied to these payloads only: the process's
  global sharing strategy is left alone, because the default strategy passes a file descriptor
  that only a process forked from the sender can receive);
* :func:`deserialize` unpickles with an allow-list (builtins, ``types``, ``collections``, torch)
  like SGLang's own safe unpickler, so a crafted body cannot run arbitrary code;
* :func:`bucket_payload` builds the ``load_format="flattened_bucket"`` item of one bucket:
  ``{"flattened_tensor": uint8 tensor, "metadata": [objects with name, shape, dtype, start_idx,
  end_idx, numel]}`` (byte offsets, SGLang's ``FlattenedTensorBucket`` layout, metadata as
  ``types.SimpleNamespace`` so the engine needs none of our classes), plus a ``"miles"`` entry
  that SGLang ignores and Miles's embedded engine reads: the update's version, the bucket's
  sequence number and checksum, and the protocol step (see :mod:`.engine_side`).
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch

from miles_transport_common.bucketing import Manifest, dtype_from_name
from miles_transport_common.errors import BucketRejected

#: The key of Miles's header in a flattened-bucket item (ignored by SGLang).
HEADER = "miles"


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> Any:
    # torch's ``file_system`` branch of ``reduce_storage``: the receiver opens the shared memory
    # by name (``rebuild_storage_filename``), whatever process it is.
    from torch.multiprocessing import reductions as r

    if storage.device.type != "cpu":
        return r.reduce_storage(storage)
    if storage.size() == 0:
        return (r.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    r.shared_cache[metadata[1]] = r.StorageWeakRef(storage)
    return (r.rebuild_storage_filename, (type(storage), *metadata))


class _Pickler(ForkingPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        import torch.multiprocessing

        self.dispatch_table = dict(self.dispatch_table)
        self.dispatch_table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
        self.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU tensor in shared memory that :func:`serialize` passes by name."""
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)  # type: ignore[attr-defined]
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def serialize(obj: Any) -> str:
    """``obj`` pickled with torch's reductions, as base64 text (one item of
    ``serialized_named_tensors``)."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


_ALLOWED = ("builtins", "collections", "copyreg", "types", "torch", "multiprocessing.reduction")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in {m.split(".")[0] for m in _ALLOWED} and any(
            module == m or module.startswith(m + ".") for m in _ALLOWED
        ):
            if module == "builtins" and name in {"eval", "exec", "compile", "open", "getattr"}:
                raise pickle.UnpicklingError(f"refused to unpickle builtins.{name}")
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to unpickle {module}.{name}: not a weight payload")


def deserialize(item: str | bytes) -> Any:
    """Inverse of :func:`serialize` (also reads SGLang's own items); refuses any class outside
    builtins, ``types``, ``collections`` and torch."""
    import torch.multiprocessing  # noqa: F401  (the rebuild functions)

    data = base64.b64decode(item, validate=True) if isinstance(item, str) else item
    return _SafeUnpickler(io.BytesIO(data)).load()


def bucket_payload(
    data: torch.Tensor, manifest: Manifest, header: dict[str, Any]
) -> dict[str, Any]:
    """The ``flattened_bucket`` item of one packed bucket: ``data`` (the bucket's bytes, a view
    of a shared buffer) with SGLang's metadata for each whole tensor in it, and Miles's header."""
    meta = []
    for p in manifest.pieces:
        if not p.whole:
            raise ValueError(f"tensor {p.name!r} is split across buckets: SGLang loads whole ones")
        dtype = dtype_from_name(p.dtype)
        meta.append(
            SimpleNamespace(
                name=p.name,
                shape=torch.Size(p.shape),
                dtype=dtype,
                start_idx=p.offset,
                end_idx=p.offset + p.nbytes,
                numel=p.nbytes // max(1, torch.empty(0, dtype=dtype).element_size()),
            )
        )
    return {"flattened_tensor": data, "metadata": meta, HEADER: header}


def control_payload(header: dict[str, Any]) -> dict[str, Any]:
    """A bucket with no tensor (an SGLang engine loads nothing) that carries only a step of the
    update protocol in its header (end, commit, abort)."""
    return {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": [], HEADER: header}


def read_bucket(item: Any) -> tuple[torch.Tensor, list[Any], dict[str, Any] | None]:
    """(flat tensor, metadata, Miles header or None) of a deserialized flattened-bucket item;
    a malformed item is a :class:`BucketRejected` naming what is wrong."""
    if not isinstance(item, dict) or "flattened_tensor" not in item or "metadata" not in item:
        raise BucketRejected(
            "a flattened_bucket item must be a dict with flattened_tensor and metadata"
        )
    flat = item["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise BucketRejected("flattened_tensor must be a flat uint8 tensor")
    header = item.get(HEADER)
    if header is not None and not isinstance(header, dict):
        raise BucketRejected(f"the {HEADER!r} header must be a dict")
    return flat, list(item["metadata"]), header


def reconstruct(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors``: each tensor a view of ``flat``
    (copied only when its start is not aligned to its element size)."""
    out = []
    for m in metadata:
        chunk = flat[int(m.start_idx) : int(m.end_idx)]
        if chunk.numel() != int(m.end_idx) - int(m.start_idx):
            raise BucketRejected(f"tensor {m.name!r} runs past the end of its bucket")
        size = torch.empty(0, dtype=m.dtype).element_size()
        if chunk.storage_offset() % size:
            chunk = chunk.clone()
        out.append((str(m.name), chunk.view(m.dtype).reshape(m.shape)))
    return out
