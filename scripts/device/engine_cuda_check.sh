#!/usr/bin/env bash
# GPU check (one CUDA GPU, under 8 minutes): the core's engine contract suite against the
# embedded engine serving on `cuda` (plugins/backends/engines/embedded/tests/test_embedded_contract.py
# with MILES_TEST_ENGINE_DEVICE=cuda).
#
# Python: $PYTHON if set; else .venv/bin/python when its torch sees a GPU; else a venv
# ($MILES_CUDA_VENV, default /tmp/miles-venv-cuda) made with
# `python3 -m venv --system-site-packages` over the machine's python3
# (which must hold a CUDA torch, transformers, aiohttp, pydantic, pluggy, pyyaml, safetensors,
# pytest and pytest-timeout). Nothing is downloaded: miles-core, miles-engine-client and
# miles-engine-embedded are installed editable with --no-deps; packages the machine lacks can be
# put as wheels in .whl/ (or $MILES_WHEELS) and are installed from there with --no-index.
#
# MILES_CHECK_DEVICE=cpu runs the same steps on the CPU (a smoke test of this script).
#
# Last line of output: {"engine_contract_cuda": "passed"|"failed", ...} (exit status 0 / 1).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
device=${MILES_CHECK_DEVICE:-cuda}
venv=${MILES_CUDA_VENV:-/tmp/miles-venv-cuda}
log=${MILES_CHECK_LOG:-$(mktemp -t engine-contract-cuda.XXXXXX)}

finish() {  # finish STATUS REASON [SUMMARY]
  local secs=$(( $(date +%s) - t0 ))
  "${PY:-python3}" - "$1" "$2" "${3:-}" "$secs" "$log" "$device" <<'PY' 2>/dev/null ||
import json, sys
status, reason, summary, secs, log, device = sys.argv[1:7]
out = {"engine_contract_cuda": status, "reason": reason, "summary": summary, "device": device,
       "seconds": int(secs), "log": log}
try:
    import torch
    out["torch"] = torch.__version__
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
except Exception as exc:  # report what is there; the status line must still print
    out["torch"] = f"unavailable: {exc}"
print(json.dumps(out))
PY
    echo "{\"engine_contract_cuda\": \"$1\", \"reason\": \"$2\", \"seconds\": $secs}"
  [ "$1" = passed ]
  exit $?
}

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
  PY=.venv/bin/python
else
  [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv" \
    || finish failed "could not create $venv"
  PY=$venv/bin/python
fi
[ "$device" = cpu ] || has_cuda "$PY" || finish failed "torch of $PY does not see a CUDA device"

wheels=${MILES_WHEELS:-.whl}
if [ -n "${MILES_SKIP_INSTALL:-}" ]; then
  :  # the caller installed the wheels and the editable packages (gpu_checks.sh)
elif compgen -G "$wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$wheels"/*.whl >>"$log" 2>&1 \
    || finish failed "installing the wheels in $wheels failed (see log)"
fi
[ -n "${MILES_SKIP_INSTALL:-}" ] || "$PY" -m pip install -q --no-deps --no-build-isolation \
  -e . -e plugins/backends/engines/client -e plugins/backends/engines/embedded >>"$log" 2>&1 \
  || finish failed "pip install -e of miles-core / engine client / embedded failed (see log)"
missing=$("$PY" - <<'PY'
import importlib
names = ["transformers", "aiohttp", "pydantic", "pluggy", "yaml", "safetensors", "pytest",
         "pytest_timeout", "miles_core", "miles_engine_client", "miles_engine_embedded"]
bad = []
for n in names:
    try:
        importlib.import_module(n)
    except Exception:
        bad.append(n)
print(" ".join(bad))
PY
)
[ -z "$missing" ] || finish failed "missing Python packages: $missing"

MILES_TEST_ENGINE_DEVICE=$device PYTHONUNBUFFERED=1 timeout 420 "$PY" -m pytest \
  plugins/backends/engines/embedded/tests/test_embedded_contract.py -q -p no:cacheprovider \
  --timeout 300 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
summary=$(grep -E "[0-9]+ (passed|failed|error)" "$log" | tail -1 | tr -d '=' | xargs)
if [ "$rc" -eq 0 ]; then
  finish passed "" "$summary"
elif [ "$rc" -eq 124 ]; then
  finish failed "pytest ran past 420 s" "$summary"
else
  finish failed "pytest exit status $rc" "$summary"
fi
