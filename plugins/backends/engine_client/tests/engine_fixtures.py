"""Shared helpers for the router and supervisor tests: tiny checkpoints and a set of real
embedded engine server processes started through the embedded engine's launcher."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VOCAB = 96


def make_tiny_model(path: Path, *, seed: int) -> Path:
    """Save a tiny random Llama (hidden 32, 1 layer) to ``path``; ``seed`` picks the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    # Peaked distributions: two seeds then give clearly different greedy continuations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


class EngineCluster:
    """Engine servers over one checkpoint, started by ``miles_engine_embedded.launcher``."""

    def __init__(self, model_path: Path) -> None:
        from miles_engine_embedded.launcher import build
        from miles_engine_embedded.plugin import EmbeddedEngineConfig

        self.model_path = str(model_path)
        self.launcher = build(
            EmbeddedEngineConfig(
                max_running_requests=4, context_length=128, num_threads=1, startup_timeout_s=120
            )
        )

    def launch(self, index: int) -> str:
        """Start engine ``index`` (blocking until ``/health`` answers); returns its URL."""
        return self.launcher.launch(self.model_path, index=index)

    def start(self, n: int) -> list[str]:
        """Start engines ``0..n-1`` concurrently; returns their URLs in order."""
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(self.launch, range(n)))

    def process(self, index: int) -> subprocess.Popen[bytes] | None:
        """The live process handle of engine ``index`` (the supervisor watches it)."""
        return self.launcher.processes.get(index)

    def pid(self, index: int) -> int:
        """Process id of engine ``index``."""
        proc = self.process(index)
        assert proc is not None
        return proc.pid

    def shutdown(self) -> None:
        """Stop every engine, a stopped (SIGSTOP) one included."""
        for proc in self.launcher.processes.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        self.launcher.shutdown()


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``cond`` every 20 ms; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.02)
