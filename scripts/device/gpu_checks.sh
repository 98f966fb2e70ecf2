#!/usr/bin/env bash
# The GPU checks, in one run on a one-GPU machine (about 5 minutes):
#   1. the FSDP2 backend on CUDA (plugins/backends/trainers/fsdp2/tests/test_fsdp2_cuda.py);
#   2. the engine contract suite against the embedded engine serving on CUDA
#      (scripts/device/engine_cuda_check.sh);
#   3. the Megatron backend on CUDA (plugins/backends/trainers/megatron/tests/
#      test_megatron_cuda.py: no CPU patch applied, Transformer Engine's spec when TE is there,
#      Megatron's distributed optimizer);
#   4. true on-policy mode's batch-invariant kernels on CUDA
#      (scripts/device/true_on_policy_cuda_check.py);
#   5. transports: colocated over CUDA IPC, and p2p with NIXL on GPU memory where nixl is
#      installed (scripts/device/transports_cuda_check.py).
# Checks 1-4 only test correctness and run side by side (one GPU holds them all); 5 times
# updates, so it runs after them, alone.
# The machine's python3 must hold a CUDA torch; packages it lacks (pydantic and its three
# dependencies, megatron-core, msgspec; nixl and nixl-cu13 for the p2p check) are installed
# from wheels in .whl/ (see README, "GPU").
# Results go to $OUT (or /tmp/miles-gpu): install.log, fsdp2.log, engine.log, megatron.log,
# true_on_policy.log, transports.log, and summary.txt (one line per check, the JSON results).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/miles-gpu}
mkdir -p "$out"
t0=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/algorithms \
  -e plugins/backends/trainers/common -e plugins/backends/trainers/fsdp2 \
  -e plugins/backends/trainers/megatron -e plugins/backends/engines/client \
  -e plugins/backends/engines/embedded -e plugins/transports/common \
  >"$out/install.log" 2>&1 || echo "install failed (see install.log)"
echo "installed in $(( $(date +%s) - t0 )) s"

pytest_check() {  # pytest_check NAME FILE: the file's tests, log in $out/NAME.log
  timeout 240 python3 -m pytest "$2" -q -p no:cacheprovider -rs --timeout 220 \
    >"$out/$1.log" 2>&1
  echo "$1: rc=$? $(grep -E '[0-9]+ (passed|failed|error|skipped)' "$out/$1.log" | tail -1)"
}

pytest_check fsdp2 plugins/backends/trainers/fsdp2/tests/test_fsdp2_cuda.py >"$out/s1" &
pytest_check megatron plugins/backends/trainers/megatron/tests/test_megatron_cuda.py >"$out/s3" &
(PYTHON=python3 MILES_SKIP_INSTALL=1 MILES_CHECK_LOG="$out/engine.log" timeout 280 \
  bash scripts/device/engine_cuda_check.sh 2>&1 | tail -1 | sed 's/^/engine: /') >"$out/s2" &
(timeout 150 python3 scripts/device/true_on_policy_cuda_check.py >"$out/true_on_policy.log" 2>&1
  echo "true_on_policy: rc=$? $(tail -1 "$out/true_on_policy.log")") >"$out/s4" &
wait
transports=colocated
python3 -c "import nixl" 2>/dev/null && transports=colocated,p2p
timeout 200 python3 scripts/device/transports_cuda_check.py --transports "$transports" \
  >"$out/transports.log" 2>&1
echo "transports ($transports): rc=$? $(tail -1 "$out/transports.log")" >"$out/s5"
cat "$out"/s[1-5] | tee "$out/summary.txt"
rm -f "$out"/s[1-5]
echo "gpu checks: $(( $(date +%s) - t0 )) s"
