"""Write ``tests/durations.json``: seconds each test file took, read from a pytest JUnit XML
report, for the order in which the test command starts the files (``conftest.py``).

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/t.xml [-m slow]
    .venv/bin/python scripts/test_durations.py /tmp/t.xml

Files the report holds replace their entries; the others keep theirs. A file with no entry is
estimated from its tests' markers."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def test_file(classname: str) -> str:
    """The file of a test whose JUnit class name is ``classname``: its path with dots for
    slashes (``--import-mode=importlib``), followed by the test's class, if any."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if (OUT.parents[1] / path).is_file():
            return path
    raise SystemExit(f"no test file for {classname!r}")


def main(report: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[test_file(case.get("classname", ""))] += float(case.get("time", 0))
    old = json.loads(OUT.read_text()) if OUT.is_file() else {}
    old.update({f: round(s, 1) for f, s in seconds.items()})
    OUT.write_text(json.dumps(dict(sorted(old.items())), indent=1) + "\n")
    print(f"{OUT}: {len(seconds)} files from {report}, {len(old)} in all")


if __name__ == "__main__":
    main(sys.argv[1])
