#!/usr/bin/env bash
# Builds every distribution of the repo as a wheel, then installs each plugin alone with the
# core (and the repo libraries it depends on) into a clean venv, imports it and checks that it
# registers through the plugin manager. torch comes from one shared folder (a .pth file) so the
# clean venvs do not each unpack a 900 MB wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${MILES_DIST_CHECK_DIR:-}" ]; then
  work=$MILES_DIST_CHECK_DIR  # kept: a later check reuses its torch folder
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT  # its clean venvs and torch: about 4.7 GB
fi
mkdir -p "$work/wheels"
quiet() { grep -v "is ignored: it is neither" || true; }
# One pip for every distribution (a pip a distribution spent as long starting as building).
# shellcheck disable=SC2046  # one folder a word
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" \
  . $(bash scripts/plugin_dirs.sh) 2>&1 | quiet
ls "$work/wheels"
if [ ! -d "$work/torch-site/torch" ]; then
  .venv/bin/python -m pip install -q --no-compile --target "$work/torch-site" -c constraints.txt \
    torch==2.13.0 2>&1 | quiet
fi
# One clean venv per plugin, three at a time (pip is mostly waiting on the disk): each check
# writes its lines to its own log, printed in order once all ended.
check_one() {
  local d=$1 name venv
  name=$(.venv/bin/python -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['project']['name'])" "$d/pyproject.toml")
  venv="$work/venv-$name"
  rm -rf "$venv"
  # No pip of its own (installing pip into each venv cost 5 s of CPU): .venv's pip installs
  # into it through --python, without byte-compiling (half of an install's time; the check
  # imports few of the modules, once).
  python3 -m venv --without-pip "$venv"
  echo "$work/torch-site" > "$(echo "$venv"/lib/python3*/site-packages)/miles-torch.pth"
  if ! .venv/bin/python -m pip --python "$venv/bin/python" install -q --no-compile \
    -c constraints.txt --find-links "$work/wheels" "$name" 2>&1 | quiet; then
    echo "FAIL $name: install"; return 1
  fi
  if MILES_PLUGINS="$name" "$venv/bin/python" - "$name" <<'PY'
import json, sys
from miles_core.plugins import load_plugins
name = sys.argv[1]
plugins = load_plugins()
mine = [i for i in plugins.pm.infos.values() if i.distribution == name]
assert mine and any(i.registers or i.hooks for i in mine), (
    f"{name} registered nothing and implements no hook"
)
others = {i.distribution for i in plugins.pm.infos.values()} - {name, "miles-core"}
assert not others, f"unexpected plugins loaded: {others}"
print(f"ok {name}: " + json.dumps({k: v for i in mine for k, v in i.registers.items()}))
PY
  then :; else echo "FAIL $name: import/registration"; return 1; fi
}
mkdir -p "$work/logs"
pids=() logs=() status=0
for d in $(bash scripts/plugin_dirs.sh); do
  grep -q '^\[project.entry-points.miles\]' "$d/pyproject.toml" || continue
  log="$work/logs/$(echo "$d" | tr / _).log"
  check_one "$d" > "$log" 2>&1 &
  pids+=($!) logs+=("$log")
  if [ "${#pids[@]}" -ge 3 ]; then
    wait "${pids[0]}" || status=1
    cat "${logs[0]}"
    pids=("${pids[@]:1}") logs=("${logs[@]:1}")
  fi
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  cat "${logs[$i]}"
done
exit $status
