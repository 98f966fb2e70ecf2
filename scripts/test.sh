#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, lint, types, tests (slow ones included), and the
# wheel + clean-install check of every distribution.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# One command a line: with `set -e`, a failure inside an `a && b` list other than its last
# command would not stop the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy (core)"
.venv/bin/mypy
echo "== import layering"
.venv/bin/lint-imports
echo "== docs"
.venv/bin/mkdocs build --strict --quiet --site-dir site
echo "== pytest"
set +e
# A test that skips for a reason other than a missing GPU or a host facility fails (conftest.py).
# Two workers, each taking whole files (their module fixtures are built once): most tests wait on
# a child process (an engine, a trainer rank, a `miles train`) for much of their time.
MILES_STRICT_SKIPS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
rc=$?
set -e
[ $rc -eq 0 ] || exit $rc
echo "== wheels and clean installs" && bash scripts/check_dists.sh
