#!/usr/bin/env bash
# The GPU checks, in one run on a one-GPU machine (under 9 minutes):
#   1. transports: colocated over CUDA IPC and p2p with NIXL on GPU memory
#      (scripts/device/transports_cuda_check.py);
#   2. the FSDP2 backend on CUDA (plugins/backends/trainers/fsdp2/tests/test_fsdp2_cuda.py);
#   3. the engine contract suite against the embedded engine serving on CUDA
#      (scripts/device/engine_cuda_check.sh);
#   4. the Megatron backend on CUDA (plugins/backends/trainers/megatron/tests/
#      test_megatron_cuda.py: no CPU patch applied, Transformer Engine's spec when TE is there);
#   5. true on-policy mode's batch-invariant kernels on CUDA
#      (scripts/device/true_on_policy_cuda_check.py).
# The machine's python3 must hold a CUDA torch; packages it lacks (pydantic and its three
# dependencies, nixl and nixl-cu13) are installed from wheels in .whl/ (see README, "GPU").
# Results go to $OUT (or /tmp/miles-gpu) as transports.json, fsdp2.log, engine.log,
# megatron.log and true_on_policy.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/miles-gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

echo "== transports"
timeout 300 python3 scripts/device/transports_cuda_check.py 2>&1 | tee "$out/transports.log"
tail -1 "$out/transports.log" > "$out/transports.json"

echo "== fsdp2 on cuda"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/algorithms \
  -e plugins/backends/trainers/common -e plugins/backends/trainers/fsdp2 \
  -e plugins/backends/engines/client -e plugins/backends/engines/embedded \
  >"$out/install.log" 2>&1 || echo "install failed (see install.log)"
timeout 150 python3 -m pytest plugins/backends/trainers/fsdp2/tests/test_fsdp2_cuda.py -q \
  -p no:cacheprovider -rs 2>&1 | tee "$out/fsdp2.log" | tail -15

echo "== engine contract on cuda"
PYTHON=python3 MILES_CHECK_LOG="$out/engine.log" timeout 330 \
  bash scripts/device/engine_cuda_check.sh 2>&1 | tail -5

echo "== megatron on cuda"
python3 -m pip install -q --no-deps --no-build-isolation "megatron-core==0.16.1" \
  -e plugins/backends/trainers/megatron >>"$out/install.log" 2>&1 || echo "install failed"
timeout 150 python3 -m pytest plugins/backends/trainers/megatron/tests/test_megatron_cuda.py -q \
  -p no:cacheprovider -rs 2>&1 | tee "$out/megatron.log" | tail -15

echo "== true on-policy kernels on cuda"
timeout 120 python3 scripts/device/true_on_policy_cuda_check.py 2>&1 | tee "$out/true_on_policy.log"
tail -1 "$out/true_on_policy.log" > "$out/true_on_policy.json"
