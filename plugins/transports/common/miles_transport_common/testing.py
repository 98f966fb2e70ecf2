"""Helpers for the transports' tests and benchmark: a tiny language model of a few MB and its
log-probabilities, so a test can check that a receiver computes exactly what the sender does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class TinyLM(nn.Module):
    """An embedding, two MLP blocks and an output head (about 1.3 M parameters, 5 MB fp32)."""

    def __init__(self, vocab: int = 512, dim: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of token ids [B, T]."""
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)  # type: ignore[no-any-return]


def tiny_lm(seed: int) -> TinyLM:
    """A :class:`TinyLM` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return TinyLM()


def logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token of ``ids`` under ``model`` ([B, T-1])."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    with torch.no_grad():
        logits = model(ids[:, :-1]).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0].cpu()


def fixed_input(vocab: int = 512) -> torch.Tensor:
    """A fixed batch of token ids for log-prob comparisons."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (2, 24), generator=g)


def named_stream(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers as (name, tensor), in the engine's naming."""
    return list(model.state_dict().items())


def report_line(model: nn.Module, *, ok: bool, version: int, error: str | None = None) -> str:
    """One JSON line a receiver test worker prints after each update attempt."""
    import json

    from miles_transport_common.checksum import weights_hash

    return json.dumps(
        {
            "ok": ok,
            "version": version,
            "hash": weights_hash(named_stream(model)),
            "logprobs": logprobs(model, fixed_input()).tolist(),
            "error": error,
        }
    )


def receiver_loop(
    receive: Callable[[nn.Module], int], version: Callable[[], int], updates: int
) -> None:
    """Body of a receiver test worker: a model with seed-1 weights takes part in ``updates``
    updates and prints a :func:`report_line` after each (failures included)."""
    import sys

    from miles_transport_common.errors import TransportError

    torch.set_num_threads(1)
    model = tiny_lm(1)
    print(report_line(model, ok=True, version=version()), flush=True)  # the "ready" line
    for _ in range(updates):
        try:
            v = receive(model)
        except TransportError as exc:
            print(report_line(model, ok=False, version=version(), error=str(exc)), flush=True)
            continue
        print(report_line(model, ok=True, version=v), flush=True)
    sys.stdout.flush()


Routes = dict[str, Callable[[dict[str, object], object], dict[str, object]]]


def spoiling_target(model: nn.Module, name: str) -> Any:
    """A target over ``model`` (see ``staging.module_target``) whose load and adopt change one
    byte of tensor ``name`` on its way into the model, after every bucket verified: a loader
    that corrupts what it serves, which only the check of the served weights can see."""
    from miles_transport_common.staging import ServedTarget, module_target

    inner = module_target(model)

    def spoil(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, t in named:
            if n == name:
                t = t.clone()
                t.reshape(-1).view(torch.uint8)[0] ^= 0xFF
            out.append((n, t))
        return out

    return ServedTarget(
        load=lambda named: inner.load(spoil(named)),
        read=lambda names: {n: inner.tensors[n] for n in names if n in inner.tensors},
        adopt=lambda named: inner.adopt(spoil(named)),
    )


class _StandIn:
    """What the engine stand-in answers: SGLang's weight-update endpoints over ``model`` with
    the engine side of :mod:`.engine_side`, and ``GET /miles_test/report``. With ``spoil``,
    the loads change one byte of that tensor (:func:`spoiling_target`)."""

    def __init__(self, model: nn.Module, routes: Routes | None, spoil: str | None = None) -> None:
        from miles_transport_common.engine_side import DistributedUpdates, TensorUpdates
        from miles_transport_common.staging import module_target

        device = next(model.parameters()).device.type
        self.model = model
        self.routes = routes
        self.tensors = TensorUpdates(device)
        self.distributed = DistributedUpdates(device)
        self.state: dict[str, str | None] = {"version": "0", "error": None}
        self.target = module_target(model) if spoil is None else spoiling_target(model, spoil)

    def set_version(self, v: str | None) -> None:
        """Stamp the version an update committed."""
        if v is not None:
            self.state["version"] = v

    def version(self) -> int:
        """The version served, as an int (-1 for a named one)."""
        return int(str(self.state["version"])) if str(self.state["version"]).isdigit() else -1

    def get(self, path: str) -> tuple[int, dict[str, object]]:
        """Status and body of ``GET path``."""
        import json

        if path == "/get_server_info":
            return 200, {"version": "miles-stand-in", "tp_size": 1}
        if path == "/get_weight_version":
            return 200, {"weight_version": self.state["version"]}
        if path == "/miles_test/timings":  # of the last update (any model: no forward)
            return 200, dict(self.tensors.last_timings)
        if path == "/miles_test/report":
            line = report_line(self.model, ok=self.state["error"] is None, version=self.version())
            out = json.loads(line)
            out["error"] = self.state["error"]
            out["timings"] = self.tensors.last_timings
            return 200, out
        return 404, {"error": {"message": f"no route {path}"}}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, object]]:
        """Status and body of ``POST path``: a refused update is a 400, any other failure a
        500, each recorded as the error the report shows until a version is committed."""
        from miles_transport_common.errors import BucketRejected, TransportError

        try:
            out = self._update(path, body)
        except BucketRejected as exc:
            self.state["error"] = str(exc)
            return 400, {"success": False, "message": str(exc)}
        except (TransportError, Exception) as exc:  # a broken group, a bug: a 500
            self.state["error"] = str(exc)
            return 500, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        if out is None:
            return 404, {"error": {"message": f"no route {path}"}}
        if body.get("weight_version") is not None:
            self.state["error"] = None
        return 200, out

    def _update(self, path: str, body: dict[str, Any]) -> dict[str, object] | None:
        """The answer of an update endpoint (None: no such route)."""
        if path == "/update_weights_from_tensor":
            return self.tensors.handle(
                body["serialized_named_tensors"],
                self.target,
                load_format=body.get("load_format"),
                weight_version=body.get("weight_version"),
                set_version=self.set_version,
            )
        if path == "/init_weights_update_group":
            self.distributed.init_group(
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=body.get("group_name", "weight_update_group"),
                backend=body.get("backend", "gloo"),
                timeout_s=float(body.get("timeout_s", 60)),
            )
            return {"success": True, "message": "Succeeded to init group."}
        if self.routes and path in self.routes:
            return self.routes[path](body, self.distributed)
        if path == "/update_weights_from_distributed":
            return self.distributed.handle(
                names=body["names"],
                dtypes=body["dtypes"],
                shapes=body["shapes"],
                group_name=body.get("group_name", "weight_update_group"),
                load_format=body.get("load_format"),
                weight_version=body.get("weight_version"),
                target=self.target,
                set_version=self.set_version,
            )
        return None


def serve_engine_stand_in(
    model: nn.Module,
    host: str = "127.0.0.1",
    port: int = 0,
    routes: Routes | None = None,
    spoil: str | None = None,
) -> None:
    """Serve SGLang's weight-update endpoints over ``model`` with the engine side of
    :mod:`.engine_side` (what Miles's embedded engine serves), on a stdlib HTTP server, until
    killed. Prints ``{"url": ...}`` once listening. ``GET /miles_test/report`` answers a
    :func:`report_line` of the model as it is now. Used by the transports' tests and benchmark:
    a real process, real HTTP, real shared memory and gloo, without loading an LLM. ``routes``
    adds POST paths answered by ``fn(body, distributed_updates)`` (the benchmark's raw
    baselines); ``spoil`` names a tensor its loads corrupt (:func:`spoiling_target`)."""
    import json
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stand_in = _StandIn(model, routes, spoil)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: dict[str, object]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._answer(*stand_in.get(self.path))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            self._answer(*stand_in.post(self.path, body))

    server = ThreadingHTTPServer((host, port), Handler)
    print(json.dumps({"url": f"http://{host}:{server.server_address[1]}"}), flush=True)
    sys.stdout.flush()
    server.serve_forever()


def stand_in_main() -> None:
    """``python -m miles_transport_common.testing [SEED [SPOIL]]``: an engine stand-in serving
    a :class:`TinyLM` with weights drawn from ``SEED`` (default 1); its loads corrupt tensor
    ``SPOIL`` when one is named (:func:`spoiling_target`)."""
    import sys

    torch.set_num_threads(1)
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    serve_engine_stand_in(tiny_lm(seed), spoil=sys.argv[2] if len(sys.argv) > 2 else None)


def engine_report(url: str) -> dict[str, object]:
    """The stand-in's report of its model (``GET /miles_test/report``)."""
    from miles_transport_common.http import call

    return call(url, "/miles_test/report", None, timeout_s=60, method="GET")


class EngineStandIn:
    """A stand-in engine process (:func:`serve_engine_stand_in`) with its URL."""

    def __init__(self, seed: int = 1, spoil: str | None = None) -> None:
        args = [str(seed)] if spoil is None else [str(seed), spoil]
        self.worker = Worker("-m", "miles_transport_common.testing", *args)
        self.url = str(self.worker.report(timeout=120)["url"])

    def report(self) -> dict[str, object]:
        """The model's hash, log-probs and version as the engine serves them now."""
        return engine_report(self.url)

    def kill(self) -> None:
        """SIGKILL the process (a dead engine)."""
        import os
        import signal

        if self.worker.proc.poll() is None:
            os.kill(self.worker.proc.pid, signal.SIGKILL)
        self.worker.proc.wait(10)

    def stop(self) -> None:
        """Stop the process."""
        self.worker.stop()


class Worker:
    """A receiver test worker run as a real subprocess (``python script args``) whose JSON
    report lines are read with a timeout."""

    def __init__(self, script: str, *args: str) -> None:
        import os
        import queue
        import subprocess
        import sys
        import threading

        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []

        def pump_out() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("{"):
                    self._lines.put(line)
            self._lines.put(None)

        def pump_err() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr.append(line)

        threading.Thread(target=pump_out, daemon=True).start()
        threading.Thread(target=pump_err, daemon=True).start()

    def report(self, timeout: float = 60.0) -> dict[str, object]:
        """The next report line; raises if the worker exits or stays silent."""
        import json
        import queue

        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"worker silent for {timeout} s:\n{''.join(self.stderr)[-3000:]}"
            ) from None
        if line is None:
            self.proc.wait(5)
            raise AssertionError(
                f"worker exited ({self.proc.returncode}):\n{''.join(self.stderr)[-3000:]}"
            )
        out: dict[str, object] = json.loads(line)
        return out

    def stop(self) -> None:
        """Kill the worker if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


if __name__ == "__main__":
    stand_in_main()
