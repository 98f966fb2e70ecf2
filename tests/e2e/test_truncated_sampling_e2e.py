"""Truncated sampling kept on-policy: with top-p 0.9 and top-k 20 the embedded engine reports
each token's log-prob under the truncated distribution it drew from, and the trainer computes
the same from its own logits (``miles_trainer_common.truncation``), bitwise in true on-policy
mode; the kept sets of the two agree for random logits, ties, top-k only and top-p only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from core_support import DIVERSITY, assert_ran, save_tiny_qwen3, train, write_dist
from miles_engine_embedded.sampling import kept_tokens, sample
from miles_trainer_common.logprobs import logprobs_at
from miles_trainer_common.truncation import Truncation, kept_mask

#: single_turn (which records what the engine sampled each sample with, what the trainer
#: truncates to), with ``record: false`` forgetting it: the trainer without the truncation.
RECORDING = """
from pydantic import BaseModel, ConfigDict
from miles_core import RolloutFunction, hookimpl
from miles_core.builtins.rollouts import SingleTurn, SingleTurnOptions

class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    record: bool = True

class Recording:
    def __init__(self, options):
        self.inner = SingleTurn(SingleTurnOptions())
        self.record = options.record

    async def __call__(self, prompt, **kw):
        group = await self.inner(prompt, **kw)
        if not self.record:  # the trainer without the truncation
            for s in group.samples:
                s.sampling_params = None
        return group

@hookimpl
def miles_register_rollout_functions(register):
    register(RolloutFunction(name="recording", factory=Recording, config=Options))
"""


def _rows(logits: torch.Tensor, p: list[float], k: list[int], t: list[float]) -> torch.Tensor:
    """The trainer's kept set of each row of ``logits [B, V]`` (as ``[B, 1, V]``)."""
    trunc = Truncation(
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(p, dtype=torch.float32),
        torch.tensor(k, dtype=torch.long),
    )
    return kept_mask(logits[:, None, :], trunc)[:, 0]


@pytest.mark.parametrize(
    ("top_p", "top_k"), [(0.9, 20), (1.0, 20), (0.9, -1), (0.5, 3), (1e-6, -1), (0.999, 1)]
)
def test_kept_set_is_the_engines(top_p: float, top_k: int) -> None:
    """Random logits at several scales and temperatures, rows in batches of 1 to 37: the
    trainer keeps exactly the engine's tokens, and its log-probs are bitwise the engine's."""
    gen = torch.Generator().manual_seed(7)
    for scale, temp, rows in ((1.0, 1.0, 37), (4.0, 0.7, 5), (0.1, 1.3, 1), (8.0, 1.0, 16)):
        logits = torch.randn(rows, 151, generator=gen) * scale
        ps, ks, ts = [top_p] * rows, [top_k] * rows, [temp] * rows
        want = kept_tokens(logits / torch.tensor(ts)[:, None], top_ps=ps, top_ks=ks)
        assert torch.equal(_rows(logits, ps, ks, ts), want)
        # the same rows inside a batch of [b, t]: each position's set alone
        got = kept_mask(
            logits.view(1, rows, -1), Truncation(torch.tensor([temp]), torch.tensor([top_p]),
                                                 torch.tensor([top_k]))
        )[0]  # fmt: skip
        assert torch.equal(got, want)
        uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).tolist()
        tokens, lps = sample(logits, temperatures=ts, top_ps=ps, top_ks=ks, uniforms=uniforms)
        lp, _ = logprobs_at(
            logits[None], torch.zeros(1, dtype=torch.long), torch.arange(rows)[None],
            tokens[None], torch.ones(1, rows, dtype=torch.bool), entropy=False,
            truncation=Truncation(torch.tensor([temp]), torch.tensor([top_p]),
                                  torch.tensor([top_k])),
        )  # fmt: skip
        assert torch.equal(lp[0], lps)


def test_kept_set_ties_and_mixed_rows() -> None:
    """Ties at the k-th logit are all kept; equal probabilities at the nucleus' edge are taken
    in token order; rows of different parameters in one batch each keep their own set."""
    logits = torch.tensor(
        [
            [0.0, 2.0, 2.0, 2.0, 1.0, -1.0],
            [0.0, 2.0, 2.0, 2.0, 1.0, -1.0],
            [3.0, 1.0, 1.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
        ]
    )
    ps, ks, ts = [1.0, 0.5, 0.9, 0.4], [2, -1, 4, -1], [1.0, 1.0, 0.5, 1.0]
    want = kept_tokens(logits / torch.tensor(ts)[:, None], top_ps=ps, top_ks=ks)
    got = _rows(logits, ps, ks, ts)
    assert torch.equal(got, want)
    assert got[0].tolist() == [False, True, True, True, False, False]  # ties at the 2nd
    assert got[1].tolist() == [False, True, True, False, False, False]  # the first two tied
    assert got[3].tolist() == [True, True, True, False, False, False]  # token order


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny-qwen3", heads=4, kv_heads=2)


def _config(tmp_path: Path, model: Path, *, record: bool) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": "Add " + " and ".join(str(j) for j in range(i % 7 + 1)) + ".",
                        "answer": i})
            + "\n"
            for i in range(40)
        )
    )  # fmt: skip
    cfg = {
        "run": {"name": "trunc", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2, "micro_batch_tokens": 96},
        "engine": {"name": "embedded", "max_running_requests": 5},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {
            "group_size": 4,
            "groups_per_step": 3,
            "max_new_tokens": 12,
            "true_on_policy": True,
            "top_p": 0.9,
            "top_k": 20,
        },
    }
    if not record:  # the built-in single_turn otherwise
        cfg["rollout_function"] = {"name": "recording", "record": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _site(tmp_path: Path) -> Path:
    site = write_dist(tmp_path / "site", "miles-diversity", "miles_diversity", DIVERSITY)
    return write_dist(site, "miles-recording", "miles_recording", RECORDING)


@pytest.mark.slow
def test_top_p_and_top_k_bitwise_over_a_run(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Top-p 0.9 and top-k 20, true on-policy: at every step `mismatch/abs_max` is exactly 0
    and the first micro-step's ratio exactly 1."""
    out = train(_config(tmp_path, tiny_qwen3, record=True), site=_site(tmp_path))
    assert_ran(out)
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "trunc" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "train/loss" in r]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["train/mismatch/abs_max"] == 0.0 and s["train/mismatch/kl"] == 0.0
        assert s["train/ratio/max"] == 1.0 and s["train/ratio/min"] == 1.0


@pytest.mark.slow
def test_without_the_trainers_truncation_tokens_differ(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The same run whose samples do not say how they were sampled: the trainer computes the
    whole vocabulary's log-probs, and the first step fails on the tokens that differ."""
    out = train(_config(tmp_path, tiny_qwen3, record=False), site=_site(tmp_path))
    assert out.returncode != 0
    assert "true on-policy:" in out.stdout + out.stderr
    assert "trained tokens differ between the trainer and the engine" in out.stdout + out.stderr
