#!/usr/bin/env bash
# The test command's checks besides ruff and pytest: types, import layering, the docs site, and
# the wheel + clean-install check of every distribution. scripts/test.sh runs them beside pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== mypy (core)"
.venv/bin/mypy
echo "== import layering"
.venv/bin/lint-imports
echo "== docs"
.venv/bin/mkdocs build --strict --quiet --site-dir site
echo "== wheels and clean installs"
bash scripts/check_dists.sh
