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
# Types, import layering, the docs site and the wheels (scripts/checks.sh) run beside pytest, in
# a session of their own whose scheduling group has the lowest priority (the kernel shares the
# CPU between sessions first, and most of pytest's children run in sessions of their own), and
# at idle disk priority: pytest keeps both cores busy but for the moments its workers wait, and
# these fill those moments (run after it, they took five more minutes). Their output is printed
# once pytest has ended; a failure of either fails the command.
checks_log=$(mktemp)
setsid -w bash -c 'echo 19 > /proc/self/autogroup 2> /dev/null || true
  renice -n 19 -p $$ > /dev/null; ionice -c 3 -p $$ 2> /dev/null || true
  exec bash scripts/checks.sh' > "$checks_log" 2>&1 < /dev/null &
checks=$!
echo "== pytest"
set +e
# A test that skips for a reason other than a missing GPU or a host facility fails (conftest.py).
# Two workers, each taking whole files (their module fixtures are built once): most tests wait on
# a child process (an engine, a trainer rank, a `miles train`) for much of their time. The files
# go in the order conftest.py gives them (costliest first), not xdist's (most tests first).
MILES_STRICT_SKIPS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
wait "$checks"
checks_rc=$?
set -e
cat "$checks_log"
rm -f "$checks_log"
[ $rc -eq 0 ] || exit $rc
exit $checks_rc
