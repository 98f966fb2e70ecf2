"""Shared helpers of the core's tests.

``make_dist`` writes a real installed distribution (a module plus a ``.dist-info`` folder with
entry points in the ``miles`` group) into a folder that subprocesses put on ``PYTHONPATH``, so
the plugin manager discovers it through ``importlib.metadata`` exactly as it finds a plugin
installed with pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
) -> subprocess.CompletedProcess[str]:
    """Run the ``miles`` command line in a subprocess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    full_env.update(env or {})
    return subprocess.run(
        [*MILES, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120
    )
