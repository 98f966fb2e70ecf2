"""Helpers for the transports' tests and benchmark: a tiny language model of a few MB and its
log-probabilities, so a test can check that a receiver computes exactly what the sender does."""

from __future__ import annotations

from collections.abc import Callable

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


def serve_engine_stand_in(
    model: nn.Module,
    host: str = "127.0.0.1",
    port: int = 0,
    routes: dict[str, Callable[[dict[str, object], object], dict[str, object]]] | None = None,
) -> None:
    """Serve SGLang's weight-update endpoints over ``model`` with the engine side of
    :mod:`.engine_side` (what Miles's embedded engine serves), on a stdlib HTTP server, until
    killed. Prints ``{"url": ...}`` once listening. ``GET /miles_test/report`` answers a
    :func:`report_line` of the model as it is now. Used by the transports' tests and benchmark:
    a real process, real HTTP, real shared memory and gloo, without loading an LLM. ``routes``
    adds POST paths answered by ``fn(body, distributed_updates)`` (the benchmark's raw
    baselines)."""
    import json
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from miles_transport_common.engine_side import DistributedUpdates, TensorUpdates
    from miles_transport_common.errors import BucketRejected, TransportError
    from miles_transport_common.staging import module_target

    device = next(model.parameters()).device.type
    tensors = TensorUpdates(device)
    distributed = DistributedUpdates(device)
    state = {"version": "0", "error": None}
    target = module_target(model)

    def set_version(v: str | None) -> None:
        if v is not None:
            state["version"] = v

    def version() -> int:
        return int(state["version"]) if str(state["version"]).isdigit() else -1

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
            if self.path == "/get_server_info":
                self._answer(200, {"version": "miles-stand-in", "tp_size": 1})
            elif self.path == "/get_weight_version":
                self._answer(200, {"weight_version": state["version"]})
            elif self.path == "/miles_test/report":
                line = report_line(model, ok=state["error"] is None, version=version())
                out = json.loads(line)
                out["error"] = state["error"]
                out["timings"] = tensors.last_timings
                self._answer(200, out)
            else:
                self._answer(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                if self.path == "/update_weights_from_tensor":
                    out = tensors.handle(
                        body["serialized_named_tensors"],
                        target,
                        load_format=body.get("load_format"),
                        weight_version=body.get("weight_version"),
                        set_version=set_version,
                    )
                elif self.path == "/init_weights_update_group":
                    distributed.init_group(
                        master_address=body["master_address"],
                        master_port=int(body["master_port"]),
                        rank_offset=int(body["rank_offset"]),
                        world_size=int(body["world_size"]),
                        group_name=body.get("group_name", "weight_update_group"),
                        backend=body.get("backend", "gloo"),
                        timeout_s=float(body.get("timeout_s", 60)),
                    )
                    out = {"success": True, "message": "Succeeded to init group."}
                elif routes and self.path in routes:
                    out = routes[self.path](body, distributed)
                elif self.path == "/update_weights_from_distributed":
                    out = distributed.handle(
                        names=body["names"],
                        dtypes=body["dtypes"],
                        shapes=body["shapes"],
                        group_name=body.get("group_name", "weight_update_group"),
                        load_format=body.get("load_format"),
                        weight_version=body.get("weight_version"),
                        target=target,
                        set_version=set_version,
                    )
                else:
                    self._answer(404, {"error": {"message": f"no route {self.path}"}})
                    return
            except BucketRejected as exc:
                state["error"] = str(exc)
                self._answer(400, {"success": False, "message": str(exc)})
                return
            except (TransportError, Exception) as exc:  # a broken group, a bug: a 500
                state["error"] = str(exc)
                self._answer(500, {"success": False, "message": f"{type(exc).__name__}: {exc}"})
                return
            if body.get("weight_version") is not None:
                state["error"] = None
            self._answer(200, out)

    server = ThreadingHTTPServer((host, port), Handler)
    print(json.dumps({"url": f"http://{host}:{server.server_address[1]}"}), flush=True)
    sys.stdout.flush()
    server.serve_forever()


def stand_in_main() -> None:
    """``python -m miles_transport_common.testing [SEED]``: an engine stand-in serving a
    :class:`TinyLM` with weights drawn from ``SEED`` (default 1)."""
    import sys

    torch.set_num_threads(1)
    serve_engine_stand_in(tiny_lm(int(sys.argv[1]) if len(sys.argv) > 1 else 1))


def engine_report(url: str) -> dict[str, object]:
    """The stand-in's report of its model (``GET /miles_test/report``)."""
    from miles_transport_common.http import call

    return call(url, "/miles_test/report", None, timeout_s=60, method="GET")


class EngineStandIn:
    """A stand-in engine process (:func:`serve_engine_stand_in`) with its URL."""

    def __init__(self, seed: int = 1) -> None:
        self.worker = Worker("-m", "miles_transport_common.testing", str(seed))
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
