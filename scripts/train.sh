#!/usr/bin/env bash
# Train with Lins on torchtitan. Default: the LLaMA-3 debug model on 4 CPU ranks (gloo),
# offline (tokenizer and corpus are generated from Python's stdlib on first run).
# Usage: bash scripts/train.sh [config.toml] [--section.key value ...]
#   NPROC=8 bash scripts/train.sh train_configs/llama3_debug_cpu_lins.toml --lins.plan zero2
#   LOG_RANK=0,1 ... shows more ranks' logs; TIMEOUT=900 bounds the run (seconds).
#   bash scripts/train.sh --parallelism.tensor_parallel_degree 2   Lins + TP: the config's
#     plan is for 4 data-parallel ranks; with TP 2 there are 2, so unless --lins.plan is
#     given the planner picks the plan for them (--lins.plan auto, said on start).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

CONFIG="train_configs/llama3_debug_cpu_lins.toml"
if [ $# -gt 0 ] && [[ "$1" == *.toml ]]; then
  CONFIG="$1"
  shift
fi
NPROC="${NPROC:-4}"
EXTRA=()
args=" $* "
if [[ "$args" =~ \ --parallelism\.tensor_parallel_degree[\ =]([0-9]+) ]] && [ "${BASH_REMATCH[1]}" != 1 ] \
   && [[ "$args" != *" --lins.plan"* ]]; then
  echo "train.sh: tensor_parallel_degree ${BASH_REMATCH[1]} changes the number of data-parallel ranks the config's" \
       "[lins] plan counts: planning them with --lins.plan auto (pass --lins.plan to choose)" >&2
  EXTRA=(--lins.plan auto)
fi
LOG_RANK="${LOG_RANK:-0}"
TIMEOUT="${TIMEOUT:-900}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

exec timeout "$TIMEOUT" torchrun --standalone --nproc_per_node "$NPROC" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m lins_dtensor.train --job.config_file "$CONFIG" "$@" ${EXTRA[@]+"${EXTRA[@]}"}
