#!/usr/bin/env bash
# Convergence of Lins' wire formats against exact fp32 training (issue 20): the debug
# LLaMA on 4 CPU ranks (2 emulated nodes x 2), 300 steps, train_configs/llama3_debug_cpu_convergence.toml.
# Usage:
#   bash scripts/convergence.sh run --name fp32-seed0 --seed 0            one run -> bench/results/convergence/<name>.json
#   bash scripts/convergence.sh run --name grads-int8 --seed 0 -- --lins.comm_formats grads=int8
#   bash scripts/convergence.sh fp32                                      the 3 exact seeds (0, 1, 2), one after another
#   bash scripts/convergence.sh report                                    docs/convergence.md and docs/convergence.png
# Uses the active virtual environment if there is one, else scripts/env.sh's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  source scripts/env.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "${1:-}" = fp32 ]; then
  for seed in 0 1 2; do
    python -m lins_dtensor.bench.convergence run --name "fp32-seed$seed" --seed "$seed"
  done
else
  exec python -m lins_dtensor.bench.convergence "$@"
fi
