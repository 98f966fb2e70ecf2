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
    with torch.no_grad():
        logits = model(ids[:, :-1]).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


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
