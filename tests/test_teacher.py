"""The distillation teacher in the core: scoring finished groups through its engines'
clients, restarting a dead engine and scoring again, dropping a group whose samples it
refuses; and the tokenizer check that refuses a teacher of another vocabulary."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from miles_core.data import Group, Sample
from miles_core.errors import MilesUserError
from miles_core.ledger import DropReason
from miles_core.runtime.judge import failure_reason
from miles_core.runtime.teacher import Teacher, check_teacher_tokenizer


class Server:
    """One launched teacher server: its log-probs are ``-token / 100``; ``dead`` servers do not
    answer, ``refuse`` ones answer every request with an error."""

    def __init__(self) -> None:
        self.dead = False
        self.refuse = False
        self.requests = 0


class Client:
    def __init__(self, server: Server, url: str) -> None:
        self.server, self.base_url = server, url

    async def input_logprobs(self, input_ids: Sequence[int], *, start: int) -> list[float]:
        self.server.requests += 1
        if self.server.dead:
            raise ConnectionError("connection refused")
        if self.server.refuse:
            raise ValueError("400: logprob_start_len past the context")
        return [-t / 100 for t in input_ids[start:]]

    async def health(self) -> bool:
        return not self.server.dead

    async def close(self) -> None:
        pass


class Launcher:
    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.servers: dict[str, Server] = {}
        self.launches = 0

    def launch(self, model_path: str, *, index: int) -> str:
        self.launches += 1
        url = f"http://teacher-{index}-{self.launches}"
        self.servers[url] = Server()
        return url

    def client(self, url: str) -> Client:
        return Client(self.servers[url], url)

    def stop(self, index: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _group() -> Group:
    samples = []
    for k in range(3):
        s = Sample(prompt_ids=[1, 2, 3])
        s.append([10 + k, 20 + k], logprobs=[-1.0, -1.0], version=0)
        samples.append(s)
    samples.append(Sample(prompt_ids=[1, 2, 3]))  # nothing generated: nothing to score
    return Group(samples=samples)


def test_teacher_scores_restarts_and_refuses() -> None:
    async def go() -> None:
        launcher = Launcher(num_engines=2)
        teacher = Teacher(launcher, "teacher-path", log=lambda _: None)
        await teacher.start()
        group = _group()
        await teacher.score(group)
        assert [s.teacher_logprobs for s in group.samples] == [
            [-0.10, -0.20],
            [-0.11, -0.21],
            [-0.12, -0.22],
            [],
        ]
        assert sorted(s.requests for s in launcher.servers.values()) == [1, 2]  # spread
        assert failure_reason(group) is None and teacher.scored_tokens == 6

        # Both servers die: they are restarted from the teacher's checkpoint, and the group
        # is scored again on the new ones (which serve at once: fixed weights).
        for server in launcher.servers.values():
            server.dead = True
        group = _group()
        await teacher.score(group)
        assert group.samples[0].teacher_logprobs == [-0.10, -0.20]
        assert launcher.launches == 4 and teacher.fleet.restarts == 2
        assert teacher.metrics()["teacher/restarts"] == 2.0

        # A server that answers with an error: scoring again would not help; the group is
        # dropped as teacher_failed, counted.
        for server in launcher.servers.values():
            server.refuse = True
        group = _group()
        await teacher.score(group)
        assert "400" in group.samples[0].metadata["teacher_error"]
        assert failure_reason(group) is DropReason.TEACHER_FAILED
        assert teacher.metrics()["teacher/failed_groups"] == 1.0
        await teacher.close()

    asyncio.run(go())


def _tokenizer(folder: Path, vocab: dict[str, int], added: Sequence[tuple[int, str]] = ()) -> Path:
    folder.mkdir(parents=True)
    data = {
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "added_tokens": [{"id": i, "content": c} for i, c in added],
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_teacher_tokenizer_check(tmp_path: Path) -> None:
    vocab = {"a": 0, "b": 1, "c": 2}
    student = _tokenizer(tmp_path / "student", vocab, [(3, "<eos>")])
    check_teacher_tokenizer(str(student), str(_tokenizer(tmp_path / "same", vocab, [(3, "<eos>")])))
    other = _tokenizer(tmp_path / "other", {"a": 0, "b": 2, "c": 1}, [(3, "<eos>")])
    with pytest.raises(MilesUserError) as info:
        check_teacher_tokenizer(str(student), str(other))
    assert "another tokenizer" in str(info.value) and "'b': 1 vs 2" in str(info.value)
    added = _tokenizer(tmp_path / "added", vocab, [(3, "<|end|>")])
    with pytest.raises(MilesUserError, match="none in the vocabulary"):
        check_teacher_tokenizer(str(student), str(added))
    # Without tokenizer files (a model family tokenizes): the vocabulary sizes must agree.
    bare = [tmp_path / "bare1", tmp_path / "bare2", tmp_path / "bare3"]
    for folder, size in zip(bare, (100, 100, 101), strict=True):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"vocab_size": size}))
    check_teacher_tokenizer(str(bare[0]), str(bare[1]))
    with pytest.raises(MilesUserError, match="vocab_size 101"):
        check_teacher_tokenizer(str(bare[0]), str(bare[2]))
    with pytest.raises(MilesUserError, match="while the other has"):
        check_teacher_tokenizer(str(student), str(bare[0]))
