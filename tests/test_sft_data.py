"""The SFT data path in the core: the ``conversations`` source (JSON Lines and Parquet) skips
and counts conversations without an assistant turn, refuses malformed rows naming the row and
the field, and resumes; the ``sft`` rollout renders a conversation into one sample without an
engine; and the config resolves the rollout functions SFT runs with."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Any

import pytest

from miles_core import Algorithm, ModelFamily, RolloutEngine, TrainerBackend, Transport, hookimpl
from miles_core.builtins.conversations import ConversationsOptions, ConversationsSource
from miles_core.builtins.sft import Sft, SftOptions
from miles_core.components import Kind
from miles_core.config import eval_rollout_function, validate_config
from miles_core.data import Group, Sample
from miles_core.errors import ConfigError, IncompatibleError, MilesUserError
from miles_core.testing.contracts import check_component


def _chat(i: int, answer: bool = True) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{i} + {i}?"}]
    if answer:
        messages.append({"role": "assistant", "content": str(2 * i)})
    return {"messages": messages, "id": i}


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_conversations_source_skips_and_counts_rows_without_an_assistant_turn(
    miles_registry: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [_chat(0), _chat(1, answer=False), _chat(2), "", _chat(3, answer=False), _chat(4)]
    path = _write_jsonl(tmp_path / "chats.jsonl", rows)
    component = miles_registry().get(Kind.DATA_SOURCE, "conversations")
    options = ConversationsOptions(path=str(path), shuffle=False)
    source = check_component(component, options=options)  # yields, and resumes from its state
    assert source.skipped == 2 and len(source) == 3
    warning = capsys.readouterr().err
    assert "skipped 2 conversations without an assistant turn" in warning
    assert "line 2" in warning
    fresh = ConversationsSource(options)
    records = [r for _, r in zip(range(3), fresh, strict=False)]
    assert [r["id"] for r in records] == [0, 2, 4]
    assert records[1]["source_row"] == f"line 3 of {path}"
    assert records[1]["messages"][1] == {"role": "assistant", "content": "4"}
    refused = ConversationsOptions(path=str(path), on_no_assistant="error")
    with pytest.raises(MilesUserError, match="line 2: the conversation has no assistant turn"):
        ConversationsSource(refused)
    only_questions = _write_jsonl(tmp_path / "q.jsonl", [_chat(1, answer=False)])
    with pytest.raises(MilesUserError, match="no conversation to train on"):
        ConversationsSource(ConversationsOptions(path=str(only_questions)))


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("{not json", "line 2: not valid JSON"),
        ([1, 2], "line 2: expected a JSON object with 'messages', got list"),
        ({"prompt": "hi"}, "line 2: no 'messages' field (fields: prompt)"),
        ({"messages": "hi"}, "line 2: messages: expected a non-empty list of messages, got str"),
        ({"messages": []}, "line 2: messages: expected a non-empty list"),
        ({"messages": [{"content": "x"}]}, "line 2: messages[0].role: expected a non-empty"),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "line 2: messages[0].content: expected text, null or a list of content parts",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
            "line 2: messages[1]: an assistant message needs content, tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
                ]
            },
            "line 2: messages[1].tool_calls[0].function.name: expected a non-empty string",
        ),
        ({**_chat(1), "tools": {"name": "x"}}, "line 2: tools: expected a list of tool schemas"),
    ],
)
def test_conversations_source_names_the_row_and_field_of_a_malformed_row(
    tmp_path: Path, row: Any, field: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [_chat(0), row, _chat(2)])
    with pytest.raises(MilesUserError) as info:
        ConversationsSource(ConversationsOptions(path=str(path)))
    assert str(path) in str(info.value) and field in str(info.value), str(info.value)


def test_conversations_source_reads_parquet_with_tools(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    rows = [
        {
            "messages": [
                {"role": "user", "content": "1 + 1?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "2"},
                {"role": "assistant", "content": "2"},
            ],
            "tools": json.dumps(tools),  # schemas kept as JSON text, as Parquet sets often do
        },
        {"messages": [{"role": "user", "content": "no answer"}], "tools": None},
        {
            "messages": [
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
    ]
    path = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    source = ConversationsSource(ConversationsOptions(path=str(path), shuffle=False))
    assert source.skipped == 1 and len(source) == 2
    first, second = source.row(0), source.row(1)
    assert first["tools"] == tools and "tools" not in second
    # Arrow fills the keys other rows' messages have with null: they are dropped again
    assert first["messages"][0] == {"role": "user", "content": "1 + 1?"}
    assert first["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert first["source_row"] == f"row 1 of {path}" and second["source_row"].startswith("row 3")


class CharFamily:
    """One token per character (id = code point); a turn is ``<role>text|``, ``|`` the stop
    token, and the template writes a newline after it."""

    name = "chars"
    stop_token_ids = (ord("|"),)

    def render(self, messages, *, tools=None, add_generation_prompt=False):  # type: ignore[no-untyped-def]
        text = "".join(f"<{m['role']}>{m.get('content') or ''}|\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_sft_rollout_renders_one_sample_with_the_loss_on_assistant_turns() -> None:
    family = CharFamily()
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "left out"},
        ],
        "source_row": "line 7 of chats.jsonl",
    }

    def run(options: SftOptions, prompt: dict[str, Any]) -> Group:
        fn = Sft(options)
        return asyncio.run(fn(prompt, group_size=1, engine=None, reward=None, family=family))

    group = run(SftOptions(), record)
    (sample,) = group.samples
    assert family.decode(sample.prompt_ids) == "<user>hi|\n<assistant>"
    text = family.decode(sample.response_ids)
    assert text == "yo|\n<user>2+2|\n<assistant>4|"
    trained = "".join(c for c, m in zip(text, sample.loss_mask, strict=True) if m)
    assert trained == "yo|4|"  # each turn through its stop token; the newline after it is not
    assert sample.logprobs == [0.0] * len(text) and sample.versions == [-1] * len(text)
    assert sample.oldest_version is None and group.staleness(7) == 0  # never stale
    assert sample.reward == 0.0 and sample.finish_reason == "stop"
    assert sample.metadata["source_row"] == "line 7 of chats.jsonl"
    cut = run(SftOptions(max_tokens=len(sample.prompt_ids) + 3), record).samples[0]
    assert family.decode(cut.response_ids) == "yo|" and cut.finish_reason == "length"
    assert sum(cut.loss_mask) == 3
    with pytest.raises(MilesUserError, match=r"line 7 of chats\.jsonl: the conversation has no"):
        run(SftOptions(), {**record, "messages": record["messages"][:1]})
    with pytest.raises(MilesUserError, match="needs records with 'messages'"):
        run(SftOptions(), {"prompt": "hi"})


# --- the config -------------------------------------------------------------------------------


def _plugin() -> types.ModuleType:
    def build(options: Any) -> Any:
        return options

    @hookimpl
    def miles_register_trainer_backends(register):  # type: ignore[no-untyped-def]
        register(TrainerBackend(name="tb", factory=build))

    @hookimpl
    def miles_register_rollout_engines(register):  # type: ignore[no-untyped-def]
        register(RolloutEngine(name="te", factory=build))

    @hookimpl
    def miles_register_transports(register):  # type: ignore[no-untyped-def]
        register(Transport(name="tt", factory=build))

    @hookimpl
    def miles_register_model_families(register):  # type: ignore[no-untyped-def]
        register(ModelFamily(name="tf", factory=build))

    @hookimpl
    def miles_register_algorithms(register):  # type: ignore[no-untyped-def]
        register(Algorithm(name="tsft", factory=build, default_rollout_function="sft"))
        register(Algorithm(name="trl", factory=build))

    module = types.ModuleType("sft_test_plugin")
    for key, value in list(locals().items()):
        if key.startswith("miles_"):
            setattr(module, key, value)
    return module


def _raw(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"path": "/m", "family": "tf"},
        "backend": "tb",
        "engine": "te",
        "transport": "tt",
        "algorithm": "tsft",
        "reward": "last_number",
        "data": {"name": "conversations", "path": "train.jsonl"},
        "rollout": {"group_size": 1},
    }
    raw.update(over)
    return raw


def test_config_resolves_the_rollout_functions_of_an_sft_run(
    miles_register: Any, miles_registry: Any
) -> None:
    miles_register(_plugin())
    reg = miles_registry()
    prompts = {"name": "jsonl", "path": "p.jsonl"}
    config = validate_config(_raw(eval={"data": prompts}), reg)
    # the algorithm's default rollout function; the evaluation generates with the modality's
    assert config.rollout_function is not None and config.rollout_function.name == "sft"
    assert config.to_plain()["rollout_function"] == {"name": "sft", "max_tokens": None}
    chosen = eval_rollout_function(config, reg)
    assert chosen is not None and chosen.name == "single_turn"
    # a config naming its rollout function keeps it (SFT on the policy's own samples)
    own = validate_config(_raw(rollout_function="single_turn"), reg)
    assert own.rollout_function is not None and own.rollout_function.name == "single_turn"
    rl = validate_config(_raw(algorithm="trl", rollout={"group_size": 4}), reg)
    assert rl.rollout_function is None
    held = {"name": "conversations", "path": "held.jsonl"}
    with_loss = validate_config(_raw(eval={"data": prompts, "loss_data": held}), reg)
    assert with_loss.eval.loss_data is not None
    assert with_loss.to_plain()["eval"]["loss_data"]["path"] == "held.jsonl"

    with pytest.raises(IncompatibleError, match=r"set rollout.group_size: 1 \(the config has 4\)"):
        validate_config(_raw(rollout={"group_size": 4}), reg)
    with pytest.raises(IncompatibleError, match=r"eval\.rollout_function 'sft' does not generate"):
        validate_config(_raw(eval={"data": prompts, "rollout_function": "sft"}), reg)
    with pytest.raises(IncompatibleError, match=r"eval\.loss_data: .* 'single_turn' generates"):
        validate_config(
            _raw(algorithm="trl", rollout={"group_size": 4}, eval={"loss_data": held}), reg
        )
    with pytest.raises(ConfigError, match=r"eval\.loss_data\.name"):
        validate_config(_raw(eval={"loss_data": {"name": "nope"}}), reg)


def test_sample_versions_from_data_are_never_stale() -> None:
    s = Sample(prompt_ids=[1], response_ids=[2, 3, 4], loss_mask=[1, 0, 1])
    s.logprobs, s.versions = [0.0] * 3, [-1] * 3
    assert s.oldest_version is None
    s.append([5], logprobs=[-0.1], version=4)  # a generated token after them counts
    assert s.oldest_version == 4 and Group(samples=[s]).staleness(6) == 2
