"""The distillation teacher: a model served by engines of its own that scores the tokens the
policy samples (their log-probs under the teacher, through SGLang's prompt log-prob path on
``/generate``), group by group as the groups finish, so scoring overlaps the rollout of the
groups still generating. Its weights never change; an engine of it that dies is restarted like
any engine, from the teacher's checkpoint, and the group it was scoring is scored again."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.contracts import EngineLauncher
from miles_core.data import Group
from miles_core.errors import MilesUserError
from miles_core.runtime.fleet import EngineFleet

#: Tokenizer files compared byte for byte when a model folder has no ``tokenizer.json``.
_VOCAB_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "spiece.model")


def _tokenizer_identity(folder: Path) -> dict[str, Any] | None:
    """What makes a tokenizer map text to the same ids: the model (vocabulary and merges) and
    the added tokens of ``tokenizer.json``, else the hashes of the vocabulary files; ``None``
    when the folder has none of them."""
    fast = folder / "tokenizer.json"
    if fast.is_file():
        data = json.loads(fast.read_text())
        added = sorted((int(t["id"]), str(t["content"])) for t in data.get("added_tokens") or [])
        return {"model": data.get("model"), "added_tokens": added}
    files = {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in _VOCAB_FILES
        if (folder / name).is_file()
    }
    return files or None


def _vocab_size(folder: Path) -> int | None:
    try:
        size = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return size if isinstance(size, int) else None


def _vocab(identity: dict[str, Any]) -> dict[str, int]:
    model = identity.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    return vocab if isinstance(vocab, dict) else {}


def check_teacher(path: str, model_path: str) -> None:
    """Before any work: the teacher's checkpoint exists and shares the policy's tokenizer
    (``path`` as the config gives it; ``model_path`` the policy's, resolved)."""
    teacher = Path(path).expanduser()
    if not teacher.exists():
        raise MilesUserError(f"teacher.path {path!r} does not exist")
    check_teacher_tokenizer(model_path, str(teacher))


def check_teacher_tokenizer(student: str, teacher: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's: its log-probs would be of other
    tokens. Raises :class:`MilesUserError` naming what differs."""
    mine = _tokenizer_identity(Path(student))
    theirs = _tokenizer_identity(Path(teacher))
    if mine is None and theirs is None:
        # Neither ships a tokenizer (the model family's renders and tokenizes): the ids must
        # at least mean the same rows of the embedding.
        sizes = [_vocab_size(Path(folder)) for folder in (student, teacher)]
        if sizes[0] is None or sizes[0] != sizes[1]:
            raise MilesUserError(
                f"teacher.path {teacher!r} (vocab_size {sizes[1]}) and model.path {student!r} "
                f"(vocab_size {sizes[0]}) ship no tokenizer files and their config.json "
                "vocabulary sizes differ or are missing: the teacher cannot score the policy's "
                "token ids"
            )
        return
    for folder, identity, key in ((student, mine, "model.path"), (teacher, theirs, "teacher.path")):
        if identity is None:
            raise MilesUserError(
                f"{key} {folder!r} has no tokenizer files (tokenizer.json, or "
                f"{', '.join(_VOCAB_FILES)}) while the other has: the teacher's tokenizer "
                "cannot be checked against the policy's"
            )
    if mine == theirs:
        return
    assert mine is not None and theirs is not None
    a, b = _vocab(mine), _vocab(theirs)
    detail = ""
    if a and b:
        differ = sorted((t for t in set(a) | set(b) if a.get(t) != b.get(t)), key=str)[:3]
        shown = ", ".join(f"{t!r}: {a.get(t)} vs {b.get(t)}" for t in differ)
        detail = (
            f" (vocabularies of {len(a)} and {len(b)} tokens; first differences: "
            f"{shown or 'none in the vocabulary'})"
        )
    raise MilesUserError(
        f"teacher.path {teacher!r} has another tokenizer than model.path {student!r}{detail}: "
        "on-policy distillation scores the policy's token ids with the teacher, so both must "
        "share one tokenizer"
    )


class Teacher:
    """The teacher's engines and the scoring of finished groups (see the module docstring)."""

    #: times a group is scored again after the engine scoring it died and was restarted
    RETRIES = 2

    def __init__(
        self, launcher: EngineLauncher, model_path: str, log: Callable[[str], None] = print
    ) -> None:
        self.launcher = launcher
        self.log = log
        self.fleet = EngineFleet(launcher, None, model_path=model_path, weights=None, log=log)
        self.scored_tokens = 0
        self.seconds = 0.0
        self.failed_groups = 0
        self._next = 0

    async def start(self) -> None:
        """Launch the teacher's engines."""
        await self.fleet.start(0)

    async def close(self) -> None:
        """Close the clients, then stop the servers (whatever the clients did)."""
        try:
            await self.fleet.close()
        finally:
            await asyncio.to_thread(self.launcher.shutdown)

    async def score(self, group: Group) -> None:
        """Set every sample's ``teacher_logprobs``. A sample the teacher could not score gets
        ``metadata["teacher_error"]`` (the group is then dropped as ``teacher_failed``); an
        engine that died is restarted and the group scored again. Raises only when a dead
        engine cannot be started again (the run stops)."""
        todo = []
        for sample in group.samples:
            if sample.response_ids:
                todo.append(sample)
            else:
                sample.teacher_logprobs = []
        if not todo:
            return
        t0 = time.perf_counter()
        error: BaseException | None = None
        results: list[Any] = []
        for _ in range(1 + self.RETRIES):
            restarts = self.fleet.restarts
            engines = self.fleet.serving()
            if not engines:
                await self.fleet.restarts_done()
                engines = self.fleet.serving()
            first, self._next = self._next, self._next + len(todo)
            results = await asyncio.gather(
                *(
                    engines[(first + i) % len(engines)].client.input_logprobs(
                        s.prompt_ids + s.response_ids, start=len(s.prompt_ids)
                    )
                    for i, s in enumerate(todo)
                ),
                return_exceptions=True,
            )
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is None:
                break
            if isinstance(error, asyncio.CancelledError):
                raise error
            dead = await self.fleet.find_dead()
            if dead:
                self.log(f"teacher: engine(s) {[e.index for e in dead]} died while scoring")
            await self.fleet.restarts_done()
            # No engine died since this attempt began (here, or found by another group's
            # scoring): the engine answered and refused, and scoring again would not help.
            if self.fleet.restarts == restarts:
                break
        self.seconds += time.perf_counter() - t0
        if error is not None:
            self.failed_groups += 1
            for sample in todo:
                sample.metadata["teacher_error"] = repr(error)
            return
        for sample, logprobs in zip(todo, results, strict=True):
            sample.teacher_logprobs = [float(x) for x in logprobs]
            self.scored_tokens += len(logprobs)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters: tokens scored, seconds spent scoring (overlapping generation),
        groups the teacher failed, restarts of its engines."""
        return {
            "teacher/scored_tokens": float(self.scored_tokens),
            "teacher/score_s": self.seconds,
            "teacher/failed_groups": float(self.failed_groups),
            "teacher/restarts": float(self.fleet.restarts),
        }
