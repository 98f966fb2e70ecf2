"""The serialized items of SGLang's ``POST /update_weights_from_tensor``.

SGLang serializes each item with its ``MultiprocessingSerializer``: torch's ForkingPickler
reductions, base64 for HTTP. A CUDA tensor then travels as its CUDA IPC handle and a CPU tensor
whose storage is in shared memory as the name of that memory, so nothing but a handle crosses
the process boundary. This module produces and reads exactly that:

* :func:`serialize` pickles with torch's reductions; a CPU storage goes by its shared-memory
  *file name* (torch's ``file_system`` strategy, applied to these payloads only: the process's
  global sharing strategy is left alone, because the default strategy passes a file descriptor
  that only a process forked from the sender can receive);
* :func:`deserialize` unpickles with an exact allow-list of (module, name) pairs (torch's
  rebuild functions, dtypes, ``Size``, ``SimpleNamespace``, ``OrderedDict``): no name is
  resolved through a module, so a crafted body cannot run code, and a shared-memory storage is
  opened only under torch's own ``/torch_<digits>_...`` names, so it cannot read other files;
* :func:`bucket_payload` builds the ``load_format="flattened_bucket"`` item of one bucket:
  ``{"flattened_tensor": uint8 tensor, "metadata": [objects with name, shape, dtype, start_idx,
  end_idx, numel]}`` (byte offsets, SGLang's ``FlattenedTensorBucket`` layout, metadata as
  ``types.SimpleNamespace`` so the engine needs none of our classes), plus a ``"miles"`` entry
  that SGLang ignores and Miles's embedded engine reads: the update's version, the bucket's
  sequence number and checksum, and the protocol step (see :mod:`.engine_side`).
"""

from __future__ import annotations

import base64
import collections
import io
import os
import pickle
import re
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


#: torch's own shared-memory names (``/torch_<pid>_<random>_<counter>``, libshm's naming): a
#: request may open only memory that torch created for sharing, never another /dev/shm file.
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
#: torch's shared-memory manager socket (``<tmp>/torch-shm-dir-<random>/manager.sock``).
_SHM_MANAGER = re.compile(rb"/[^\0]*/torch-shm-dir-[A-Za-z0-9_]+/manager\.sock")


def _rebuild_storage_filename(
    cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None
) -> Any:
    """torch's ``rebuild_storage_filename`` with its arguments checked first: the memory is
    torch's own shared memory (by name and manager socket), of at least ``size`` bytes."""
    from torch.multiprocessing import reductions as r

    if cls is not torch.UntypedStorage and not (
        isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage)
    ):
        raise pickle.UnpicklingError(f"rebuild_storage_filename: storage class {cls!r} refused")
    if not isinstance(handle, bytes) or not _SHM_NAME.fullmatch(handle):
        raise pickle.UnpicklingError(
            f"shared memory name {handle!r} refused: only torch's own /torch_<digits>_... names"
        )
    if not isinstance(manager, bytes) or not _SHM_MANAGER.fullmatch(manager):
        raise pickle.UnpicklingError(f"shared memory manager {manager!r} refused")
    if type(size) is not int or size <= 0:
        raise pickle.UnpicklingError(f"shared memory size {size!r} refused: a positive int")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"shared memory dtype {dtype!r} refused")
    nbytes = size * (torch.empty(0, dtype=dtype).element_size() if dtype is not None else 1)
    path = "/dev/shm" + handle.decode()
    if os.path.isdir("/dev/shm"):
        # Mapping more bytes than the memory holds would crash the server on first touch.
        try:
            have = os.stat(path).st_size
        except OSError:
            raise pickle.UnpicklingError(f"no shared memory named {handle.decode()!r}") from None
        if nbytes > have:
            raise pickle.UnpicklingError(
                f"shared memory {handle.decode()!r} holds {have} bytes, the payload says {nbytes}"
            )
    return r.rebuild_storage_filename(cls, manager, handle, size, dtype)  # type: ignore[no-untyped-call]


def _load_storage_bytes(data: Any) -> Any:
    """torch's ``torch.storage._load_from_bytes`` (how a plain ``pickle.dumps`` of a tensor
    carries its storage) with torch's weights-only loader: the original runs a full unpickler
    on the nested bytes, which would let them name any global."""
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError("a pickled storage must be bytes")
    return torch.load(io.BytesIO(data), weights_only=True)


def _no_hooks(hooks: Any) -> None:
    if hooks is not None and (not isinstance(hooks, dict) or hooks):
        raise pickle.UnpicklingError("a tensor of a weight payload cannot carry backward hooks")


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> Any:
    """``torch._utils._rebuild_tensor_v2`` without hooks or extra metadata."""
    _no_hooks(backward_hooks)
    if metadata:
        raise pickle.UnpicklingError("a tensor of a weight payload cannot carry metadata")
    return torch._utils._rebuild_tensor_v2(  # type: ignore[attr-defined,no-untyped-call]
        storage, storage_offset, size, stride, bool(requires_grad), collections.OrderedDict()
    )


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> Any:
    """``torch._utils._rebuild_parameter`` without hooks."""
    _no_hooks(backward_hooks)
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("a parameter's data must be a tensor")
    return torch.nn.Parameter(data, bool(requires_grad))


def _allowed() -> dict[tuple[str, str], Any]:
    """The exact (module, name) pairs a weight payload may name, each with what it resolves to.

    These are what :func:`serialize` and SGLang's ``MultiprocessingSerializer`` emit for named
    tensors and flattened buckets (CPU shared memory by name, empty storages, CUDA IPC handles,
    parameters, metadata as ``SimpleNamespace``), and what a plain ``pickle.dumps`` of tensors
    emits (``_rebuild_tensor_v2``, ``_rebuild_parameter`` and the storage bytes, read by
    torch's weights-only loader): nothing that opens a file by path, runs a command or
    resolves a further attribute. A file-descriptor storage
    (``rebuild_storage_fd``) is refused: it cannot cross an HTTP request anyway.
    """
    from torch.multiprocessing import reductions as r

    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("types", "SimpleNamespace"): SimpleNamespace,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): (
            _rebuild_storage_filename
        ),
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    }
    for name in (
        "rebuild_tensor",
        "rebuild_storage_empty",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_cuda_tensor",
        "rebuild_event",
    ):
        table[("torch.multiprocessing.reductions", name)] = getattr(r, name)
    # dtypes are pickled as module attributes of torch (``torch.float32``)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[("torch", name)] = value
    return table


_ALLOWED: dict[tuple[str, str], Any] | None = None


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _allowed()
        # An exact pair only: no dotted name resolved through an allowed module
        # (``torch.os.system``), no other member of an allowed module (``torch.from_file``).
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"refused to unpickle {module}.{name}: not part of a weight payload (allowed: "
                "torch's tensor and storage rebuilds, dtypes, Size, Parameter, SimpleNamespace, "
                "OrderedDict)"
            )
        return found


def deserialize(item: str | bytes) -> Any:
    """Inverse of :func:`serialize` (also reads SGLang's own items); refuses every global
    outside an exact allow-list of torch's rebuild functions and a few plain containers, so a
    crafted body cannot run code or open files."""
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


def _meta_int(m: Any, field: str) -> int:
    value = getattr(m, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BucketRejected(f"metadata {field} must be a non-negative int, got {value!r}")
    return value


def reconstruct(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors``: each tensor a view of ``flat``
    (copied only when its start is not aligned to its element size). Every entry is checked
    first (a string name, a torch dtype, a shape of non-negative ints whose bytes are exactly
    ``end_idx - start_idx``, and ``0 <= start_idx <= end_idx <= len(flat)``): a malformed one
    is a :class:`BucketRejected` naming it."""
    out = []
    for m in metadata:
        name = getattr(m, "name", None)
        if not isinstance(name, str):
            raise BucketRejected(f"metadata name must be a string, got {name!r}")
        dtype = getattr(m, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise BucketRejected(f"tensor {name!r}: metadata dtype {dtype!r} is not a torch dtype")
        shape = getattr(m, "shape", None)
        if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise BucketRejected(f"tensor {name!r}: shape {shape!r} must be non-negative ints")
        start, end = _meta_int(m, "start_idx"), _meta_int(m, "end_idx")
        if not start <= end <= flat.numel():
            raise BucketRejected(
                f"tensor {name!r}: bytes [{start}, {end}) are outside the bucket's "
                f"{flat.numel()} bytes"
            )
        size = torch.empty(0, dtype=dtype).element_size()
        if torch.Size(shape).numel() * size != end - start:
            raise BucketRejected(
                f"tensor {name!r}: shape {tuple(shape)} of {dtype} needs "
                f"{torch.Size(shape).numel() * size} bytes, the metadata gives {end - start}"
            )
        chunk = flat[start:end]
        if chunk.storage_offset() % size:
            chunk = chunk.clone()
        out.append((name, chunk.view(dtype).reshape(tuple(shape))))
    return out
