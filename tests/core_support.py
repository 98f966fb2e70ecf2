"""Shared helpers of the core's tests and the end-to-end tests.

``write_dist`` (and the ``make_dist`` fixture over it) writes a real installed distribution (a
module plus a ``.dist-info`` folder with entry points in the ``miles`` group) into a folder that
subprocesses put on ``PYTHONPATH``, so the plugin manager discovers it through
``importlib.metadata`` exactly as it finds a plugin installed with pip. ``run_miles`` and
``train`` run the command line in a subprocess; ``save_tiny_qwen3`` builds the random tiny
model the end-to-end runs train, ``write_prompts`` their data, ``diversity_site`` their reward;
``assert_ran`` and ``metric_rows`` read what a run did; ``lora_engine`` and ``generate`` start
a live embedded engine that serves LoRA adapters and ask it for completions.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles_core import RewardFunction, hookimpl

REPO = Path(__file__).resolve().parents[1]
MILES = [sys.executable, "-m", "miles_core.cli"]

# A plugin providing one component of every kind the config selects, with options to validate.
TESTPLUGIN = """
from typing import Literal
from pydantic import BaseModel, ConfigDict, Field
from miles_core import (hookimpl, TrainerBackend, RolloutEngine, Algorithm, Transport,
                        ModelFamily)

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

class BackendOptions(Strict):
    micro_batch_tokens: int = Field(4096, ge=1)
    precision: Literal["fp32", "bf16"] = "fp32"

class AlgoOptions(Strict):
    clip_low: float = Field(0.2, ge=0)
    estimator: Literal["grpo", "dr_grpo"] = "grpo"

class TransportOptions(Strict):
    bucket_size_mb: int = Field(512, ge=1)
    timeout_s: float = Field(60.0, gt=0)

def build(options):
    return options

def async_needs_correction(config):
    if config.run.mode == "async" and config.algorithm.options.estimator == "grpo":
        return "algorithm.estimator 'grpo' needs an off-policy correction when run.mode is async"
    return None

@hookimpl
def miles_register_trainer_backends(register):
    register(TrainerBackend(name="tbackend", factory=build, config=BackendOptions))

@hookimpl
def miles_register_rollout_engines(register):
    register(RolloutEngine(name="tengine", factory=build))

@hookimpl
def miles_register_algorithms(register):
    register(Algorithm(name="talgo", factory=build, config=AlgoOptions,
                       check=async_needs_correction, importance_ratios=True))

@hookimpl
def miles_register_transports(register):
    register(Transport(name="tcolocated", factory=build, config=TransportOptions,
                       requires={"placement": ["colocated"]}))
    register(Transport(name="tbroadcast", factory=build, config=TransportOptions,
                       excludes={"placement": ["colocated"]}))

@hookimpl
def miles_register_model_families(register):
    register(ModelFamily(name="tfamily", factory=build))
"""

#: a reward plugin ("diversity") that scores a sample by its tokens: varied rewards in every
#: group, so GRPO has advantages to train on whatever a tiny random model writes
DIVERSITY = """
from miles_core import RewardFunction, hookimpl

def build(options):
    return lambda sample, prompt: (sum(sample.response_ids) % 1000) / 1000

@hookimpl
def miles_register_reward_functions(register):
    register(RewardFunction(name="diversity", factory=build))
"""


class IdleEngineClient:
    """An engine client that answers the fleet's control calls (health, pause, continue,
    close) and does nothing else: the base of the fake engines of the fleet's tests."""

    def __init__(self, url: str) -> None:
        self.base_url = url

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass

    async def pause_generation(self, mode: str) -> None:
        pass

    async def continue_generation(self) -> None:
        pass


class Diversity:
    """The ``diversity`` reward as an in-process plugin (registered with
    ``pm.register_plugin``): it differs between samples even for a random model, so every
    step trains."""

    @hookimpl
    def miles_register_reward_functions(self, register: Any) -> None:
        register(
            RewardFunction(
                name="diversity",
                factory=lambda options: lambda s, p: (sum(s.response_ids) % 1000) / 1000,
            )
        )


#: Ray's options of the asynchronous end-to-end runs: two CPUs, one for the trainer's actor.
RAY = "{num_cpus: 2, trainer_cpus: 1, object_store_mb: 80, ready_timeout_s: 60}"


VALID_CONFIG = """
run: {steps: 2}
model: {path: /models/tiny}
backend: {name: tbackend, precision: bf16}
engine: tengine
algorithm: {name: talgo, clip_low: 0.1, estimator: dr_grpo}
transport: {name: tcolocated}
reward: last_number
data: {name: jsonl, path: prompts.jsonl}
"""


def run_miles(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    pythonpath: Path | None = None,
    timeout: float = 120,
    python: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the ``miles`` command line in a subprocess (``MILES_*`` variables of this process
    are left out; ``env`` adds to the rest), with this interpreter or ``python`` (another
    virtual environment's)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    if pythonpath is not None:
        # Kept in front of an inherited PYTHONPATH (a worktree's packages put before the
        # editable installs), not in place of it.
        inherited = os.environ.get("PYTHONPATH")
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath), *([inherited] if inherited else [])]
        )
    full_env.update(env or {})
    command = [str(python), *MILES[1:]] if python is not None else MILES
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


def train(
    config: Path,
    *extra: str,
    site: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    python: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``miles train config [extra...]`` in a subprocess from the repository's root, with the
    plugins installed in ``site`` (see :func:`write_dist`) importable; ``python``: another
    virtual environment's interpreter."""
    return run_miles(
        "train",
        str(config),
        *extra,
        env=env,
        cwd=REPO,
        pythonpath=site,
        timeout=timeout,
        python=python,
    )


def write_dist(
    site: Path, dist: str, module: str, source: str, entry_name: str | None = None
) -> Path:
    """Write an installed distribution ``dist`` into ``site`` (created if missing): the module
    ``module`` with ``source``, and a ``.dist-info`` folder whose entry point in the ``miles``
    group names it. Returns ``site``, the folder to put on ``PYTHONPATH``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[miles]\n{entry_name or module} = {module}\n")
    return site


def diversity_site(tmp_path: Path) -> Path:
    """A site folder (for :func:`train`) with the ``diversity`` reward of :data:`DIVERSITY`."""
    return write_dist(tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY)


def write_prompts(path: Path, count: int) -> Path:
    """A JSONL data file of ``count`` prompts ``What is i + i?`` with their answers, in order."""
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n"
            for i in range(count)
        )
    )
    return path


def assert_ran(out: subprocess.CompletedProcess[str]) -> None:
    """The command exited 0; else the assertion shows the end of its output."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


def metric_rows(run: Path, *, evals: bool = False) -> list[dict[str, Any]]:
    """The rows of the run folder's ``metrics.jsonl``; without ``evals``, those of the
    evaluations (rows with ``eval/accuracy``) are left out."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows if evals else [r for r in rows if "eval/accuracy" not in r]


#: The broadcast transport's options in the asynchronous end-to-end runs.
BROADCAST = {"name": "broadcast", "bucket_size_mb": 4, "timeout_s": 60}


def place_on_ray(raw: dict[str, Any], *, max_staleness: int = 2) -> None:
    """Turn the config ``raw`` of an asynchronous run (``run.mode: async``) into one under Ray
    disaggregated placement: the engine in a Ray actor (one thread, one CPU) and a group buffer
    of four with ``max_staleness``."""
    raw["run"]["placement"] = "disaggregated"
    raw["engine"].update(num_threads=1, launch_in="ray_actor", ray_num_cpus=1)
    raw["buffer"] = {"capacity": 4, "max_staleness": max_staleness}


def async_ray_config(
    tmp_path: Path,
    model: Path,
    *,
    steps: int,
    name: str = "async",
    prompts: int = 400,
    max_running_requests: int = 4,
    group_size: int = 4,
    **buffer: Any,
) -> dict[str, Any]:
    """The config of a fully asynchronous run under Ray disaggregated placement: the FSDP2
    trainer, the embedded engine in a Ray actor, gloo broadcast weight sync, GRPO with the
    rollout log-probs as behaviour policy, the ``diversity`` reward, two groups a step of
    ``prompts`` addition prompts (written into ``tmp_path``); ``buffer`` is the group buffer's
    section."""
    data = write_prompts(tmp_path / "prompts.jsonl", prompts)
    return {
        "run": {
            "name": name,
            "output_dir": str(tmp_path / "runs"),
            "steps": steps,
            "mode": "async",
            "placement": "disaggregated",
        },
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "cpu_threads": 1},
        "engine": {
            "name": "embedded",
            "max_running_requests": max_running_requests,
            "num_threads": 1,
            "launch_in": "ray_actor",
            "ray_num_cpus": 1,
        },
        "algorithm": {"name": "grpo", "behaviour_policy": "rollout"},
        "transport": dict(BROADCAST),
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": group_size, "groups_per_step": 2, "max_new_tokens": 6},
        "buffer": buffer,
    }


#: The Qwen checkpoints' vocabulary size.
QWEN_VOCAB = 151936
#: Exactly the qwen3 family's tokens: every id such a model samples decodes.
QWEN3_TOKENS = 151669


def save_tiny_qwen3(
    path: Path,
    *,
    vocab_size: int = QWEN_VOCAB,
    heads: int = 2,
    kv_heads: int = 1,
    seed: int = 0,
) -> Path:
    """Save a random tiny Qwen3 (2 layers, hidden 32, tied embeddings, weights drawn with
    ``seed``) at ``path``, with a real Qwen vocabulary size so the qwen3 family's token ids are
    valid inputs."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@contextmanager
def lora_engine(model: Path, max_running_requests: int) -> Iterator[str]:
    """A live embedded engine process serving ``model`` with LoRA adapters enabled (rank up to
    8, a 64-token context, one CPU thread); yields its URL and shuts it down on exit."""
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=max_running_requests,
            context_length=64,
            num_threads=1,
            startup_timeout_s=120,
            enable_lora=True,
            max_lora_rank=8,
        )
    )
    try:
        yield launcher.launch(str(model), index=0)
    finally:
        launcher.shutdown()


def generate(
    url: str, prompts: list[list[int]], sampling: dict[str, Any], lora: str | None
) -> list[Any]:
    """The engine's results (token ids and log-probs) for each prompt in turn, with the adapter
    ``lora`` (``None``: the base model)."""
    from miles_engine_client import EngineClient

    async def go() -> list[Any]:
        client = EngineClient(url)
        try:
            return [
                await client.generate(p, sampling, return_logprob=True, lora_path=lora)
                for p in prompts
            ]
        finally:
            await client.close()

    return asyncio.run(go())


#: the source of ``_engines()``, for code a run loads (a test plugin): the pids of the engine
#: servers under the calling process, forks of its fork server or its children, oldest first
ENGINES_UNDER_ME = """
def _engines():
    # the engine servers under this process (forks of its fork server, or its children)
    me, parents, commands = os.getpid(), {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                commands[int(name)] = f.read()
        except OSError:
            continue
        parents[int(name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])

    def under_me(pid):
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == me:
                return True
        return False

    # `python -m miles_engine_embedded.server ...` (a fork's title has spaces, not NULs); the
    # fork servers above them name the module too, further on in their command lines
    return sorted(
        pid for pid, cmd in commands.items()
        if cmd.replace(b"\\0", b" ").split()[1:3] == [b"-m", b"miles_engine_embedded.server"]
        and under_me(pid)
    )
"""
