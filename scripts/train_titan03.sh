#!/usr/bin/env bash
# Train with Lins on torchtitan 0.3: scripts/train.sh's job (the LLaMA-3 debug model on
# 4 CPU ranks, gloo, offline) with torchtitan 0.3's typed configs instead of TOML.
# Usage: bash scripts/train_titan03.sh [--config NAME] [--section.field value ...]
#   default config: llama3_debug_cpu (lins_dtensor/integrations/torchtitan03/config_registry.py)
#   bash scripts/train_titan03.sh --lins.plan auto
#   NPROC=8 bash scripts/train_titan03.sh --lins.plan zero2
#   bash scripts/train_titan03.sh --parallelism.tensor_parallel_degree 2   Lins + TP: the config's
#     plan is for 4 data-parallel ranks; with TP 2 there are 2, so unless --lins.plan is
#     given the planner picks the plan for them (--lins.plan auto, said on start).
#   LOG_RANK=0,1 ... shows more ranks' logs; TIMEOUT=900 bounds the run (seconds).
# Uses .venv-titan03 (scripts/env_titan03.sh creates it on first run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env_titan03.sh

CONFIG=(--config llama3_debug_cpu)
args=" $* "
if [[ "$args" == *" --config "* || "$args" == *" --config="* ]]; then
  CONFIG=()
fi
NPROC="${NPROC:-4}"
EXTRA=()
if [[ "$args" =~ \ --parallelism\.tensor_parallel_degree[\ =]([0-9]+) ]] && [ "${BASH_REMATCH[1]}" != 1 ] \
   && [[ "$args" != *" --lins.plan"* ]]; then
  echo "train_titan03.sh: tensor_parallel_degree ${BASH_REMATCH[1]} changes the number of data-parallel ranks the config's" \
       "lins.plan counts: planning them with --lins.plan auto (pass --lins.plan to choose)" >&2
  EXTRA=(--lins.plan auto)
fi
LOG_RANK="${LOG_RANK:-0}"
TIMEOUT="${TIMEOUT:-900}"

exec timeout "$TIMEOUT" torchrun --standalone --nproc_per_node "$NPROC" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m lins_dtensor.integrations.torchtitan03.train ${CONFIG[@]+"${CONFIG[@]}"} "$@" ${EXTRA[@]+"${EXTRA[@]}"}
