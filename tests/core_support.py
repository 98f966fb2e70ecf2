"""Shared helpers of the core's tests.

``write_dist`` (and the ``make_dist`` fixture over it) writes a real installed distribution (a
module plus a ``.dist-info`` folder with entry points in the ``miles`` group) into a folder that
subprocesses put on ``PYTHONPATH``, so the plugin manager discovers it through
``importlib.metadata`` exactly as it finds a plugin installed with pip. ``run_miles`` and
``train`` run the command line in a subprocess; ``save_tiny_qwen3`` builds the random tiny
model the end-to-end runs train.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
) -> subprocess.CompletedProcess[str]:
    """Run the ``miles`` command line in a subprocess (``MILES_*`` variables of this process
    are left out; ``env`` adds to the rest)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    if pythonpath is not None:
        # Kept in front of an inherited PYTHONPATH (a worktree's packages put before the
        # editable installs), not in place of it.
        inherited = os.environ.get("PYTHONPATH")
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath), *([inherited] if inherited else [])]
        )
    full_env.update(env or {})
    return subprocess.run(
        [*MILES, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout
    )


def train(
    config: Path,
    *extra: str,
    site: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``miles train config [extra...]`` in a subprocess from the repository's root, with the
    plugins installed in ``site`` (see :func:`write_dist`) importable."""
    return run_miles(
        "train", str(config), *extra, env=env, cwd=REPO, pythonpath=site, timeout=timeout
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
