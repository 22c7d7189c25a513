#!/usr/bin/env bash
# torch DDP with torch's communication hooks in torchtitan 0.2.2's trainer, for the
# convergence comparison of issue 20 (docs/convergence-ddp.md): the config of the Lins
# convergence runs (train_configs/llama3_debug_cpu_convergence.toml) with
# --lins.no-enable --model.name ddp_llama3 --experimental.custom_import
# lins_dtensor.bench.ddp_hooks_titan, the hook chosen by LINS_BENCH_DDP_HOOK.
# Usage:
#   bash scripts/convergence_ddp.sh validate     plain all-reduce (fp32), first 20 steps -> ddp-fp32-validation.json,
#                                                compared with bench/results/convergence/fp32-seed0.json if present
#   bash scripts/convergence_ddp.sh hooks        300 steps each: ddp-bf16-hook-seed0, ddp-powersgd-seed0
#   bash scripts/convergence_ddp.sh fp32         300 steps of the plain all-reduce -> ddp-fp32-validation.json
#   bash scripts/convergence_ddp.sh run --name N --hook allreduce|bf16|powersgd [--seed S] [--stop-after K] [-- trainer args]
# Needs the tokenizer/corpus folder of the config (outputs/llama3_debug_cpu_lins/assets;
# built on first use, or copied from the Lins runs' checkout for byte-identical data).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  source scripts/env.sh
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
M=lins_dtensor.bench.ddp_hooks_titan
R=bench/results/convergence
case "${1:-}" in
  validate)
    python -m $M run --name ddp-fp32-validation --hook allreduce --seed 0 --stop-after 20
    if [ -f $R/fp32-seed0.json ]; then python -m $M compare $R/fp32-seed0.json $R/ddp-fp32-validation.json --steps 20; fi
    ;;
  hooks)
    python -m $M run --name ddp-bf16-hook-seed0 --hook bf16 --seed 0
    python -m $M run --name ddp-powersgd-seed0 --hook powersgd --seed 0
    ;;
  fp32)
    python -m $M run --name ddp-fp32-validation --hook allreduce --seed 0
    ;;
  *)
    exec python -m $M "$@"
    ;;
esac
