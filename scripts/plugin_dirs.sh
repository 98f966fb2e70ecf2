#!/usr/bin/env bash
# Prints every plugin distribution folder of the repo, libraries (no entry points) first, so
# that installing them in this order satisfies the local dependencies between them.
set -euo pipefail
cd "$(dirname "$0")/.."
libs=() plugins=()
while IFS= read -r f; do
  d=$(dirname "$f")
  if grep -q '^\[project.entry-points.miles\]' "$f"; then plugins+=("$d"); else libs+=("$d"); fi
done < <(find plugins -name pyproject.toml -not -path '*/.*' -not -path '*/build/*' | sort)
printf '%s\n' "${libs[@]}" "${plugins[@]}" | sed '/^$/d'
