"""The Parquet and generator data sources, and the skip-and-count policy of every file source:
real files (Parquet written by the datasets library), real imported user functions."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.builtins.data_sources import GeneratorOptions, JsonlOptions, ParquetOptions
from miles_core.components import Kind
from miles_core.errors import MilesUserError
from miles_core.testing.contracts import check_component


def _parquet(path: Path, rows: list[dict[str, object]]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _take(source: object, n: int) -> list[dict[str, object]]:
    return list(itertools.islice(iter(source), n))  # type: ignore[call-overload]


def test_parquet_source_skips_counts_and_resumes(miles_registry, tmp_path, capsys):
    rows: list[dict[str, object]] = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]
    rows.insert(2, {"prompt": None, "answer": "x"})
    rows.insert(5, {"prompt": "", "answer": "y"})  # empty text is a prompt; kept
    path = _parquet(tmp_path / "prompts.parquet", rows)
    component = miles_registry().get(Kind.DATA_SOURCE, "parquet")
    src = check_component(component, options=ParquetOptions(path=str(path), seed=5))
    assert src.skipped == 1 and len(src) == 7
    err = capsys.readouterr().err
    assert f"data file {str(path)!r}: skipped 1 malformed row (first at row 3)" in err

    fresh = component.build(ParquetOptions(path=str(path), seed=5))
    it = iter(fresh)
    first_epoch = [next(it)["prompt"] for _ in range(7)]
    assert sorted(first_epoch) == sorted(["", *(f"q{i}" for i in range(6))])
    assert next(it)["answer"] is not None  # the next epoch has begun
    state = json.loads(json.dumps(fresh.state_dict()))  # as a checkpoint stores it
    upcoming = [next(it)["prompt"] for _ in range(4)]
    resumed = component.build(ParquetOptions(path=str(path), seed=5))
    resumed.load_state_dict(state)
    assert [r["prompt"] for r in _take(resumed, 4)] == upcoming
    other_seed = component.build(ParquetOptions(path=str(path), seed=6))
    assert [r["prompt"] for r in _take(other_seed, 7)] != first_epoch


def test_parquet_source_refuses_unusable_files(miles_registry, tmp_path):
    component = miles_registry().get(Kind.DATA_SOURCE, "parquet")
    bad = _parquet(tmp_path / "bad.parquet", [{"prompt": None}, {"prompt": None}])
    with pytest.raises(MilesUserError, match=r"no usable rows \(2 malformed, the first at row 1\)"):
        component.build(ParquetOptions(path=str(bad)))
    other = _parquet(tmp_path / "other.parquet", [{"question": "q"}])
    with pytest.raises(MilesUserError, match=r"no column 'prompt' \(columns: question\)"):
        component.build(ParquetOptions(path=str(other)))
    mixed = _parquet(tmp_path / "mixed.parquet", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(MilesUserError, match="row 2"):
        component.build(ParquetOptions(path=str(mixed), on_bad_row="error"))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(MilesUserError, match="cannot be read as Parquet"):
        component.build(ParquetOptions(path=str(not_parquet)))
    with pytest.raises(MilesUserError, match="does not exist"):
        component.build(ParquetOptions(path=str(tmp_path / "nope.parquet")))


def test_jsonl_source_warns_with_the_first_bad_line_and_refuses_a_file_with_none(
    miles_registry, tmp_path, capsys
):
    component = miles_registry().get(Kind.DATA_SOURCE, "jsonl")
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "q"})
    path.write_text("\n".join([good, "", good, "{oops", '{"prompt": 3}', good]) + "\n")
    src = component.build(JsonlOptions(path=str(path)))
    assert src.skipped == 2 and len(src.rows) == 3 and src.state_dict()["skipped"] == 2
    assert "skipped 2 malformed rows (first at line 4)" in capsys.readouterr().err
    path.write_text("{oops\n[1]\n")
    with pytest.raises(
        MilesUserError, match=r"no usable rows \(2 malformed, the first at line 1\)"
    ):
        component.build(JsonlOptions(path=str(path)))
    path.write_text("\n")
    with pytest.raises(MilesUserError, match=r"no usable rows \(it is empty\)"):
        component.build(JsonlOptions(path=str(path)))


TASKS = """
import random

def arithmetic(seed, limit=None, every_bad=0):
    rng = random.Random(seed)
    n = 0
    while limit is None or n < limit:
        n += 1
        if every_bad and n % every_bad == 0:
            yield {"question": "no prompt key"}
            continue
        a, b = rng.randrange(100), rng.randrange(100)
        yield {"prompt": f"{a} + {b} =", "answer": str(a + b), "n": n}

def not_iterable(seed):
    return 42

def only_bad(seed):
    while True:
        yield "not a dict"
"""


@pytest.fixture
def tasks_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "miles_test_tasks.py").write_text(textwrap.dedent(TASKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "miles_test_tasks"
    sys.modules.pop("miles_test_tasks", None)


def test_generator_source_is_seeded_and_resumes_by_skipping(miles_registry, tasks_module):
    component = miles_registry().get(Kind.DATA_SOURCE, "generator")
    options = GeneratorOptions(function=f"{tasks_module}:arithmetic", seed=1)
    check_component(component, options=options)
    src = component.build(options)
    it = iter(src)
    first = [next(it) for _ in range(5)]
    assert [r["n"] for r in first] == [1, 2, 3, 4, 5]
    again = component.build(GeneratorOptions(function=f"{tasks_module}:arithmetic", seed=1))
    assert _take(again, 5) == first
    other = component.build(GeneratorOptions(function=f"{tasks_module}:arithmetic", seed=2))
    assert _take(other, 5) != first
    state = json.loads(json.dumps(src.state_dict()))
    assert state == {"consumed": 5, "skipped": 0}
    upcoming = [next(it) for _ in range(3)]
    resumed = component.build(options)
    resumed.load_state_dict(state)
    assert _take(resumed, 3) == upcoming
    limited = component.build(
        GeneratorOptions(function=f"{tasks_module}:arithmetic", kwargs={"limit": 2})
    )
    assert len(list(limited)) == 2  # a finite generator ends the stream


def test_generator_source_skips_and_counts_bad_records(miles_registry, tasks_module, capsys):
    component = miles_registry().get(Kind.DATA_SOURCE, "generator")
    spec = f"{tasks_module}:arithmetic"
    src = component.build(GeneratorOptions(function=spec, kwargs={"every_bad": 3}))
    got = _take(src, 6)
    assert [r["n"] for r in got] == [1, 2, 4, 5, 7, 8]
    assert src.skipped == 2 and src.state_dict() == {"consumed": 8, "skipped": 2}
    assert "skipped 1 malformed row (first at record 3)" in capsys.readouterr().err
    resumed = component.build(GeneratorOptions(function=spec, kwargs={"every_bad": 3}))
    resumed.load_state_dict(src.state_dict())
    assert [r["n"] for r in _take(resumed, 2)] == [10, 11] and resumed.skipped == 3
    strict = component.build(
        GeneratorOptions(function=spec, kwargs={"every_bad": 3}, on_bad_row="error")
    )
    with pytest.raises(MilesUserError, match="record 3"):
        _take(strict, 5)
    hopeless = component.build(
        GeneratorOptions(function=f"{tasks_module}:only_bad", max_bad_in_a_row=50)
    )
    with pytest.raises(MilesUserError, match="50 malformed records in a row"):
        _take(hopeless, 1)
    with pytest.raises(MilesUserError, match="not an iterable"):
        _take(component.build(GeneratorOptions(function=f"{tasks_module}:not_iterable")), 1)


def test_generator_source_refuses_a_function_it_cannot_find(miles_registry, tasks_module):
    component = miles_registry().get(Kind.DATA_SOURCE, "generator")
    with pytest.raises(MilesUserError, match="cannot import 'no_such_module_xyz'"):
        component.build(GeneratorOptions(function="no_such_module_xyz:f"))
    with pytest.raises(MilesUserError, match="has no 'nope'"):
        component.build(GeneratorOptions(function=f"{tasks_module}:nope"))
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="function"):
        GeneratorOptions(function="no colon here")
