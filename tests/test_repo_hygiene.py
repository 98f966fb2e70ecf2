"""The repo stays usable on any machine: no doc holds one machine's paths, and no test skips
in CI for a reason other than a missing GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = {".md", ".py", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".jinja"}
# Home and workspace folders of one machine ("/" + name + "/"), written in pieces so that this
# file does not match itself.
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])/(" + "|".join(["wo" + "rk", "ho" + "me", "ro" + "ot", "Us" + "ers"]) + r")/\w"
)


def _tracked_files() -> list[Path]:
    if shutil.which("git") and (REPO / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout.decode()
        return [REPO / p for p in out.split("\0") if p]
    skip = {".venv", ".git", "runs", "build", "node_modules"}
    return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.parts)]


def test_no_file_holds_a_path_of_one_machine():
    found = []
    for path in _tracked_files():
        if path.suffix not in TEXT or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not found, "paths of one machine (write them relative to the repo root):\n" + "\n".join(
        found
    )


def test_the_machine_path_check_catches_one(tmp_path):
    assert MACHINE_PATH.search("cd " + "/wo" + "rk/main && pytest")
    assert MACHINE_PATH.search("see /" + "home/alice/x")
    assert not MACHINE_PATH.search("~/.cache/miles/models and runs/x/work/y")


def test_strict_skips_fail_a_skip_that_is_not_about_a_gpu(tmp_path):
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_runs():\n    pass\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_gpu():\n    pass\n"
        "def test_missing_package():\n    pytest.importorskip('no_such_package_anywhere')\n"
        "@pytest.mark.skipif(True, reason='host: no cgroup can be made here')\n"
        "def test_host():\n    pass\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_xfail():\n    assert False\n"
    )

    def run(strict: str) -> str:
        env = {**os.environ, "MILES_STRICT_SKIPS": strict}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.stdout

    relaxed = run("0")
    assert "1 passed, 3 skipped, 1 xfailed" in relaxed, relaxed
    strict = run("1")
    assert "1 failed, 1 passed, 2 skipped, 1 xfailed" in strict, strict
    assert "FAILED test_some.py::test_missing_package" in strict, strict
