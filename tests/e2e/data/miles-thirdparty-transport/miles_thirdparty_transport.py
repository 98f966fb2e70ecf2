"""``disk``, a Miles weight transport in one module, built on an endpoint every engine serves.

An update writes the trainer's weights as one safetensors file into a new folder (beside the
model's ``config.json``, read once from the folder the engine reports at ``GET
/get_model_info``), renames the folder into place so no engine ever sees half a checkpoint, and
asks each engine to load it with SGLang's ``POST /update_weights_from_disk``, naming the
version. An engine that fails to load it keeps its previous weights and version (the
endpoint's contract), and the update raises. The folder must be readable by every engine: one
machine, or a shared file system.

It needs no engine capability beyond SGLang's base API, so its record declares none, and it
cannot publish an adapter alone (``adapter_capabilities`` left ``None``: a run with an adapter
is refused at start). Only ``miles_core``'s public API is used, with torch, safetensors and
httpx; importing the module imports none of them.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from miles_core import Transport, hookimpl

if TYPE_CHECKING:
    from torch import Tensor

    from miles_core.contracts import AdapterSync

#: the files of the model's folder, besides its weights, that a checkpoint folder needs
MODEL_FILES = ("config.json", "generation_config.json")


class DiskOptions(BaseModel):
    """The options of ``transport: {name: disk, ...}`` in a run config."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error naming it

    directory: str | None = Field(
        None,
        description="folder the updates are written to, readable by every engine; "
        "null: a temporary folder, removed when the run ends",
    )
    keep: int = Field(1, ge=1, description="how many of the latest updates stay on disk")
    timeout_s: float = Field(120.0, gt=0, description="per engine call, in seconds")


class DiskSender:
    """The trainer side (``miles_core.contracts.WeightTransport``)."""

    def __init__(self, options: DiskOptions) -> None:
        import httpx

        self.options = options
        self._temporary = options.directory is None
        root = options.directory or tempfile.mkdtemp(prefix="miles-disk-weights-")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # trust_env=False: the engines are addressed directly, never through a proxy that the
        # environment may name for other traffic.
        self.http = httpx.Client(timeout=options.timeout_s, trust_env=False)
        self.model_files: dict[str, bytes] | None = None
        self.written: list[Path] = []

    def _call(self, method: str, url: str, path: str, body: Any = None) -> dict[str, Any]:
        response = self.http.request(method, url + path, json=body)
        answer: dict[str, Any] = response.json()
        if response.status_code != 200 or answer.get("success") is False:
            raise RuntimeError(
                f"disk transport: {url}{path} answered {response.status_code}: "
                f"{answer.get('message', answer)}"
            )
        return answer

    def _model_files(self, url: str) -> dict[str, bytes]:
        """The model's own files (its config), read once from the folder an engine serves."""
        if self.model_files is None:
            folder = Path(self._call("GET", url, "/get_model_info")["model_path"])
            self.model_files = {
                name: (folder / name).read_bytes()
                for name in MODEL_FILES
                if (folder / name).is_file()
            }
            if "config.json" not in self.model_files:
                raise RuntimeError(f"disk transport: no config.json in the engine's {folder}")
        return self.model_files

    def _write(self, weights: Iterable[tuple[str, Tensor]], version: int, url: str) -> Path:
        from safetensors.torch import save_file

        # A copy of each tensor: safetensors refuses tensors that share memory (tied
        # embeddings) and the trainer may reuse its export buffers after the update.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in weights}
        if not tensors:
            raise ValueError("disk transport: the update holds no weight")
        final = self.root / f"v{version}"
        partial = self.root / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        for name, data in self._model_files(url).items():
            (partial / name).write_bytes(data)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)  # in place whole, or not at all
        return final

    def send(
        self,
        weights: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        engines: Sequence[str],
        adapter: AdapterSync | None = None,
    ) -> dict[str, float]:
        """Write ``weights`` as ``version`` and have every engine at ``engines`` load it;
        returns metrics, ``sync/disk/engine_version`` the lowest version the engines report."""
        if adapter is not None:  # the record declares no adapter_capabilities: refused at start
            raise ValueError("disk transport: publishing an adapter alone is not supported")
        urls = [u.rstrip("/") for u in engines]
        if not urls:
            raise ValueError("disk transport: send needs at least one engine URL")
        t0 = time.perf_counter()
        folder = self._write(weights, version, urls[0])
        t_written = time.perf_counter()
        body = {
            "model_path": str(folder),
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": True,
        }
        reported = [self._call("POST", u, "/update_weights_from_disk", body) for u in urls]
        versions = [str(r.get("weight_version")) for r in reported]
        if any(v != str(version) for v in versions):
            raise RuntimeError(f"disk transport: sent version {version}, engines hold {versions}")
        self.written.append(folder)
        while len(self.written) > self.options.keep:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)
        t1 = time.perf_counter()
        return {
            "sync/seconds": t1 - t0,
            "sync/send_seconds": t_written - t0,
            "sync/bytes": float((folder / "model.safetensors").stat().st_size),
            "sync/disk/engine_version": float(min(int(v) for v in versions)),
        }

    def close(self) -> None:
        """Close the HTTP client; remove the folder when it was a temporary one."""
        self.http.close()
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)


def build(options: DiskOptions) -> DiskSender:
    """The record's factory: the sending side, called with the validated options."""
    return DiskSender(options)


@hookimpl
def miles_register_transports(register: Callable[[Transport], None]) -> None:
    """Register ``disk`` with Miles."""
    register(
        Transport(
            name="disk",
            factory="miles_thirdparty_transport:build",
            config=DiskOptions,
            description="safetensors in a folder, loaded by each engine's "
            "/update_weights_from_disk",
        )
    )
