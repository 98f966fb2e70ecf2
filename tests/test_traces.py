"""Per-rollout traces: the writer's format and bounds (read back with pandas), the config's
``traces`` section, and a real ``miles train`` whose trace file holds, per token, the engine's
and the trainer's log-probs and their difference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from core_support import VALID_CONFIG, assert_ran, metric_rows, train, write_prompts

from miles_core.config import TracesSection
from miles_core.data import Group, Sample
from miles_core.runtime.traces import FILE_NAME, Traces


def _sample(n: int, *, text: str = "ok", trained: bool = True) -> Sample:
    s = Sample(prompt_ids=[1, 2, 3])
    s.append(list(range(10, 10 + n)), logprobs=[-0.5 - i / 1000 for i in range(n)], version=3)
    if not trained:  # an environment turn appended after the generated tokens
        s.append([7, 8], trained=False)
    s.trainer_logprobs = [-0.5 - i / 1000 + 1e-3 for i in range(len(s.response_ids))]
    s.reward = 0.25
    s.metadata["response_text"] = text
    return s


def _groups(count: int, samples: int, n: int, text: str = "ok") -> list[Group]:
    return [
        Group(samples=[_sample(n, text=text) for _ in range(samples)], prompt={"prompt": "p"})
        for _ in range(count)
    ]


def _write(tmp_path: Path, step: int, groups: list[Group], **options: Any) -> dict[str, float]:
    tmp_path.mkdir(exist_ok=True)
    logged: list[str] = []
    out = Traces(TracesSection(**options), tmp_path).write(step, groups, None, logged.append)
    assert not logged
    return out


def _lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / FILE_NAME).read_text().splitlines()]


def test_format_per_token_and_pandas(tmp_path: Path) -> None:
    groups = _groups(3, 2, 5)
    groups[0].samples[1] = _sample(5, trained=False)  # two environment tokens at its end
    out = _write(tmp_path, 4, groups, groups_per_step=2, max_tokens_per_sample=6)
    assert out["traces/samples"] == 4 and out["traces/dropped"] == 0
    assert out["traces/bytes"] == (tmp_path / FILE_NAME).stat().st_size
    frame = pd.read_json(tmp_path / FILE_NAME, lines=True)
    assert len(frame) == 4
    assert list(frame["group"]) == [g.group_id for g in groups[:2] for _ in range(2)]
    assert list(frame["sample"]) == [0, 1, 0, 1] and set(frame["step"]) == {4}
    first = frame.iloc[0]
    assert first["prompt"] == "p" and first["response"] == "ok" and first["reward"] == 0.25
    assert first["finish"] == "stop" and first["n"] == 5 and first["ver"] == [3] * 5
    assert first["ids"] == [10, 11, 12, 13, 14]
    assert first["lp_e"][1] == -0.501 and first["lp_t"][1] == -0.5
    assert first["lp_d"] == [0.001] * 5  # trainer minus engine, 6 digits
    assert first["cut"] == {"tokens": 0, "chars": 0}
    env = frame.iloc[1]  # 7 tokens, 6 kept: the last environment token cut
    assert env["n"] == 7 and env["mask"] == [1, 1, 1, 1, 1, 0]
    assert env["lp_d"][-1] is None and env["ver"][-1] == -1
    assert env["cut"] == {"tokens": 1, "chars": 0}


def test_step_bytes_bounded_tokens_cut_then_samples_dropped(tmp_path: Path) -> None:
    cap = 4096
    for step in range(1, 6):
        out = _write(
            tmp_path,
            step,
            _groups(4, 4, 2000, text="x" * 20000),
            groups_per_step=4,
            max_tokens_per_sample=2000,
            max_bytes_per_step=cap,
        )
        assert 0 < out["traces/bytes"] <= cap
    lines = _lines(tmp_path)
    for step in range(1, 6):
        mine = [x for x in lines if x["step"] == step]
        size = sum(len(json.dumps(x, separators=(",", ":")).encode()) + 1 for x in mine)
        assert size <= cap
        assert mine and all(x["dropped"] == 16 - len(mine) for x in mine)
        assert len(mine) < 16  # samples had to go after the tokens and texts were cut
        for x in mine:
            assert x["cut"]["tokens"] == 2000 - len(x["ids"]) and x["cut"]["tokens"] > 0
            assert x["cut"]["chars"] == 20000 - len(x["response"])  # the prompt "p" kept
    assert (tmp_path / FILE_NAME).stat().st_size <= 5 * cap
    # a cap that holds them all cuts nothing
    big = _write(tmp_path / "big", 1, _groups(1, 2, 8), max_bytes_per_step=1 << 20)
    assert big["traces/dropped"] == 0


def test_cap_keeps_the_most_tokens_that_fit(tmp_path: Path) -> None:
    groups = _groups(1, 2, 400)
    out = _write(tmp_path / "cut", 1, groups, max_tokens_per_sample=400, max_bytes_per_step=8000)
    lines = _lines(tmp_path / "cut")
    kept = len(lines[0]["ids"])
    assert out["traces/dropped"] == 0 and 0 < kept < 400 and out["traces/bytes"] <= 8000
    assert all(x["dropped"] == 0 for x in lines)
    assert all(x["cut"]["tokens"] == 400 - kept for x in lines)
    # one token more each would not have fitted
    more = _write(tmp_path / "more", 1, groups, max_tokens_per_sample=kept + 1)
    assert more["traces/bytes"] > 8000


def test_expert_agreement_per_token_and_its_cut(tmp_path: Path) -> None:
    """A routed run's samples carry their per-token expert agreement: ``agree`` holds it
    rounded, ``null`` where a token had no record, cut with the other per-token lists, and
    the byte cap still keeps the most tokens that fit; a sample without it has no ``agree``."""
    groups = _groups(1, 2, 300)
    for s in groups[0].samples:
        s.trainer_expert_agreement = [None if i == 1 else (i % 3) / 3 for i in range(300)]
    plain = _groups(1, 1, 300)[0].samples[0]
    groups[0].samples.append(plain)
    _write(tmp_path / "all", 1, groups, max_tokens_per_sample=4)
    first, _, bare = _lines(tmp_path / "all")
    assert first["agree"] == [0.0, None, 0.666667, 0.0]
    assert len(first["agree"]) == len(first["ids"]) == 4 and first["cut"]["tokens"] == 296
    assert "agree" not in bare
    frame = pd.read_json(tmp_path / "all" / FILE_NAME, lines=True)
    assert frame.iloc[0]["agree"][2] == 0.666667
    out = _write(tmp_path / "cut", 1, groups, max_tokens_per_sample=300, max_bytes_per_step=9000)
    lines = _lines(tmp_path / "cut")
    kept = len(lines[0]["ids"])
    assert out["traces/dropped"] == 0 and 0 < kept < 300 and out["traces/bytes"] <= 9000
    assert all(len(x["agree"]) == kept for x in lines[:2])
    assert lines[0]["agree"] == first["agree"] + [round((i % 3) / 3, 6) for i in range(4, kept)]
    # the agreement takes bytes of the cap: one token more each would not have fitted
    more = _write(tmp_path / "more", 1, groups, max_tokens_per_sample=kept + 1)
    assert more["traces/bytes"] > 9000
    without = _groups(1, 3, 300)
    alone = _write(tmp_path / "alone", 1, without, max_tokens_per_sample=kept + 1)
    assert alone["traces/bytes"] <= 9000


def test_every_and_off(tmp_path: Path) -> None:
    assert _write(tmp_path, 1, _groups(1, 1, 2), every=2) == {}
    assert _write(tmp_path, 2, _groups(1, 1, 2), every=2)["traces/samples"] == 1
    assert _write(tmp_path, 2, _groups(1, 1, 2), every=0) == {}
    assert _write(tmp_path, 2, _groups(1, 1, 2), groups_per_step=0) == {}
    assert [x["step"] for x in _lines(tmp_path)] == [2]


def test_agent_episode_turns_and_tool_calls(tmp_path: Path) -> None:
    s = _sample(3, trained=False)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    s.metadata.update(
        turns=[0, 1],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
    )
    s.trainer_logprobs = None  # a backend that does not report them
    s.turn_rewards = [0.5]  # one generated turn: the environment's tokens end the sample
    _write(tmp_path, 1, [Group(samples=[s])])
    (line,) = _lines(tmp_path)
    assert line["turns"] == [0, 1] and line["lp_t"] is None and line["lp_d"] is None
    assert line["turn_rewards"] == [0.5]
    assert [m["role"] for m in line["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(line["messages"][1]["tool_calls"]) == [call]


def test_unwritable_file_reported_once(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).mkdir()  # a folder where the file should be
    traces = Traces(TracesSection(), tmp_path)
    logged: list[str] = []
    assert traces.write(1, _groups(1, 1, 2), None, logged.append) == {}
    assert traces.write(2, _groups(1, 1, 2), None, logged.append) == {}
    assert len(logged) == 1 and "traces" in logged[0]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("groups_per_step", -1, "traces.groups_per_step"),
        ("max_bytes_per_step", 10, "traces.max_bytes_per_step"),
        ("sample_rate", 1, "traces.sample_rate: unknown key"),
    ],
)
def test_config_errors_name_the_option(key: str, value: int, message: str) -> None:
    from miles_core.config import validate_config
    from miles_core.errors import ConfigError
    from miles_core.plugins import load_plugins

    raw = yaml.safe_load(VALID_CONFIG)
    raw["traces"] = {key: value}
    with pytest.raises(ConfigError, match=message):
        validate_config(raw, load_plugins().registry)


# --- a real run ------------------------------------------------------------------------------


def _config(tmp_path: Path, model: Path, **extra: Any) -> Path:
    data = write_prompts(tmp_path / "prompts.jsonl", 20)
    cfg = {
        "run": {"name": "traced", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(model), "family": "qwen3", "accept_unverified_family": True},
        "backend": {"name": "fsdp2", "lr": 1e-2},
        "engine": {"name": "embedded", "max_running_requests": 8},
        "algorithm": {"name": "grpo"},
        "transport": {"name": "colocated", "bucket_size_mb": 4},
        "reward": "diversity",
        "data": {"name": "jsonl", "path": str(data), "shuffle": False},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_new_tokens": 6},
        "eval": {"limit": 1},
        "traces": {"groups_per_step": 1},
        **extra,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_two_step_run_traces_engine_and_trainer_logprobs(
    tiny_qwen3_full_vocab: Path, reward_site: Path, tmp_path: Path
) -> None:
    out = train(_config(tmp_path, tiny_qwen3_full_vocab), site=reward_site)
    assert_ran(out)
    run = tmp_path / "runs" / "traced"
    frame = pd.read_json(run / FILE_NAME, lines=True)
    assert sorted(frame["step"]) == [1, 1, 2, 2]  # one group of two samples per step
    for _, line in frame.iterrows():
        assert line["prompt"] and "What is" in line["prompt"]
        assert len(line["ids"]) == line["n"] > 0
        assert len(line["lp_e"]) == len(line["lp_t"]) == len(line["lp_d"]) == line["n"]
        for e, t, d in zip(line["lp_e"], line["lp_t"], line["lp_d"], strict=True):
            assert e < 0 and t < 0 and d == pytest.approx(t - e, abs=2e-6)
            # the engine sampled with the trainer's weights: the two agree closely
            assert abs(d) < 1e-3
        assert set(line["ver"]) == {line["step"] - 1}
    rows = metric_rows(run)
    sizes = [r["traces/bytes"] for r in rows]
    assert len(sizes) == 2 and all(0 < b <= 65536 for b in sizes)
    assert sum(sizes) == (run / FILE_NAME).stat().st_size


@pytest.mark.slow
def test_agent_run_on_two_trainer_ranks_traces_its_turns(
    tiny_qwen3_full_vocab: Path, reward_site: Path, tmp_path: Path
) -> None:
    pytest.importorskip("miles_sessions")
    config = _config(
        tmp_path,
        tiny_qwen3_full_vocab,
        backend={"name": "fsdp2", "lr": 1e-2, "world_size": 2},
        rollout_function={"name": "session", "max_turns": 2, "max_new_tokens": 6},
    )
    out = train(config, site=reward_site)
    assert_ran(out)
    lines = [
        json.loads(x) for x in (tmp_path / "runs/traced" / FILE_NAME).read_text().split("\n")[:-1]
    ]
    assert sorted(x["step"] for x in lines) == [1, 1, 2, 2]
    for line in lines:
        # an episode of the session server: its turns and the chat it drove
        assert line["turns"] and line["messages"][0] == {
            "role": "user",
            "content": line["messages"][0]["content"],
        }
        assert "What is" in line["messages"][0]["content"]
        assert [m["role"] for m in line["messages"]][1] == "assistant"
        # the trainer's log-probs came back from rank 0 of the two processes
        assert line["lp_t"] is not None and len(line["lp_t"]) == len(line["ids"]) == line["n"]
        trained = [d for d, m in zip(line["lp_d"], line["mask"], strict=True) if m]
        assert trained and all(abs(d) < 1e-3 for d in trained)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_train_step_sets_the_trainer_logprobs_before_its_update(
    backend: str, tmp_path: Path
) -> None:
    """Both trainer backends (their shared rank code) give every trained sample the log-probs
    the step computed before its update: those of the weights it started from."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_trainer_common.testing import llama_config, make_groups, save_random

    if backend == "fsdp2":
        from miles_backend_fsdp2.options import FSDP2Options as Options
        from miles_backend_fsdp2.trainer import build
    else:
        pytest.importorskip("megatron.core")
        from miles_backend_megatron.options import MegatronOptions as Options
        from miles_backend_megatron.trainer import build
    path = save_random(llama_config(tie_word_embeddings=False), tmp_path / "llama", 0)
    trainer = build(Options(lr=1e-2, cpu_threads=1, micro_batch_tokens=40))
    trainer.setup(path)
    try:
        groups = make_groups(2, 3, seed=3)
        before, _ = trainer.compute_logprobs(groups)
        assert all(s.trainer_logprobs is None for g in groups for s in g.samples)
        trainer.train_step(groups, build_policy_gradient(GRPOOptions()))
        after, _ = trainer.compute_logprobs(groups)
    finally:
        trainer.close()
    rows = [s for g in groups for s in g.samples]
    for row, s in enumerate(rows):
        n = len(s.response_ids)
        assert s.trainer_logprobs is not None and len(s.trainer_logprobs) == n
        assert s.trainer_logprobs == pytest.approx(before[row, :n].tolist(), abs=1e-5)
    assert (after - before).abs().max() > 1e-4  # the step changed the weights after them
