"""RNG states and tensor hashes, checkpoint files read safely, and the part of a trainer
rank's checkpoint every backend writes the same way (``trainer.pt``)."""

from __future__ import annotations

import os
import pickle
import random
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

try:  # the core's user error, when the core is installed: reported without a traceback
    from miles_core.errors import MilesUserError as _UserError
except ImportError:  # pragma: no cover
    _UserError = RuntimeError  # type: ignore[misc,assignment]

if TYPE_CHECKING:
    from miles_trainer_common.rank_state import RankState


class CheckpointFileRefused(_UserError):
    """A checkpoint file that holds more than tensors and plain values."""


def hash_tensor(h: Any, t: Tensor) -> None:
    """Feed ``t``'s dtype, element count and bytes (on CPU, contiguous) to the hash ``h``
    (a ``hashlib`` object): equal updates mean bitwise-equal tensors."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(f"{t.dtype}{t.numel()}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: ``python`` (``random``), ``torch`` (CPU), ``numpy`` (when
    numpy is installed) and, on a CUDA ``device``, that device's ``cuda`` state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        # As plain values (the key array as a tensor): a checkpoint loads with
        # ``weights_only=True``, which refuses numpy objects.
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (
            str(kind),
            torch.from_numpy(keys.copy()),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (the ``cuda`` state only on a CUDA
    ``device``)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        if isinstance(keys, Tensor):
            keys = keys.numpy()
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def load_checkpoint_file(path: str, *, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file with ``weights_only=True``: tensors and plain values
    only, so a file someone else wrote cannot run code when a run resumes from it. A file
    holding anything else (or written by an older version of miles, which pickled numpy
    objects) is refused with an error naming it. ``mmap``: the tensors are mapped from the
    file, read when used (a reader that needs a few tensors of several large files)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        raise CheckpointFileRefused(
            f"checkpoint file {path} holds objects other than tensors and plain values and is "
            f"refused (it was not written by this version of miles, or was changed): {first}"
        ) from None


#: What a torch.distributed.checkpoint ``.metadata`` file may name: its own dataclasses, paths,
#: sizes, dtypes and layouts. Anything else (``os.system``, ``builtins.exec``...) is refused.
_DCP_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        value = getattr(torch, name, None) if module == "torch" else None
        plain = isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
        if not plain and (module, name) not in _DCP_METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


def check_sharded_checkpoint(path: str) -> None:
    """Refuse a torch.distributed.checkpoint folder whose ``.metadata`` (a pickle that DCP
    loads with plain ``pickle``) names anything but DCP's own metadata types: read with an
    allow-list first, so a file someone else wrote cannot run code when DCP reads it."""
    import os

    for name in sorted(os.listdir(path)):
        if not name.endswith(".metadata"):
            continue
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
            raise CheckpointFileRefused(
                f"checkpoint file {file} holds more than torch.distributed.checkpoint "
                f"metadata and is refused: {exc}"
            ) from None


def plain_load_planner() -> Any:
    """A DCP load planner whose non-tensor values (DCP writes them with ``torch.save`` and
    reads them with ``weights_only=False``) must load with ``weights_only=True``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class PlainBytesLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointFileRefused(
                    f"checkpoint value {read_item.dest_index.fqn} holds objects other than "
                    f"tensors and plain values and is refused: {exc}"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return PlainBytesLoadPlanner()


def save_rank(rank: RankState, path: str, extra: dict[str, Any], weight_version: int) -> None:
    """Collective: the backend's state of every rank (:meth:`_save_state`), and on rank 0
    ``trainer.pt``: the schedules, step, weight version, the adapters' configs, the
    options and ``extra``."""
    rank._ready()
    os.makedirs(path, exist_ok=True)
    fields = rank._save_state(path)
    if rank.rank == 0:
        torch.save(
            {
                "step": rank.step,
                "weight_version": weight_version,
                # by adapter name ("" for the whole model)
                "schedulers": {k: s.state_dict() for k, s in rank.schedulers.items()},
                "extra": extra,
                "model_path": rank.model_path,
                "options": rank.options.model_dump(mode="json"),
                "adapters": rank._adapter_configs(),
                **fields,
            },
            os.path.join(path, "trainer.pt"),
        )
    dist.barrier()


def load_rank(rank: RankState, path: str) -> tuple[dict[str, Any], int]:
    """Collective: restore what :meth:`save` wrote; returns ``(extra, weight_version)``."""
    rank._ready()
    trainer_file = os.path.join(path, "trainer.pt")
    if not os.path.exists(trainer_file):
        raise FileNotFoundError(f"{path} holds no {rank.backend} checkpoint (no trainer.pt)")
    # Tensors and plain values only (``extra`` included): resuming a checkpoint someone
    # else wrote must not run their code.
    meta = load_checkpoint_file(trainer_file)
    rank._check_saved(path, meta)
    saved = rank._saved_adapters(meta)
    if saved != rank._adapter_configs():
        raise ValueError(
            f"{path} was saved by a {rank.backend} trainer with adapters {saved or 'none'}, "
            f"and this one has {rank._adapter_configs() or 'none'}: a checkpoint resumes "
            "only with the adapters (their served_name and adapter options) it was saved "
            "with"
        )
    if meta.get("critic") is None:
        # Saved before any critic existed: the next step that needs one builds it fresh,
        # as the saved trainer would have.
        rank.critic = rank.critic_optimizer = rank.critic_scheduler = None
    elif rank.critic is None:
        rank._build_critic()
    rank._load_state(path, meta)
    rank.step = int(meta["step"])
    dist.barrier()
    return dict(meta["extra"]), int(meta["weight_version"])
