#!/usr/bin/env bash
# The CUDA path of Lins on every GPU of this machine, under CUDA's stream sanitizer,
# against the same run on CPU. Prints what it checked; exit 0 when everything matched
# and the sanitizer reported nothing. Needs torch with CUDA (2.11 or newer) and the
# package importable (pip install -e . --no-deps, or PYTHONPATH=src). Under 5 minutes.
#
# What runs: torchrun with one rank per GPU and NCCL trains the tests' tiny LLaMA for 3
# steps of M = 2 micro-batches under each plan of scripts/gpu_smoke.py (one GPU: the
# ddp plan, world 1, where every level is local and no collective runs; two or more: the
# fsdp preset, i.e. FSDP2's streams and Lins' side stream; a P-replicated plan, no FSDP2;
# with four or more a mixed plan), with TORCH_CUDA_SANITIZER=1, which reports any
# kernel that touches a tensor another stream may still be using. The same ranks then
# run the same plans on CPU with gloo, and the masters and losses are compared.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_smoke: no CUDA device visible (torch.cuda.device_count() = 0)" >&2
  exit 2
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "gpu_smoke: $GPUS GPU(s), torch $(python -c 'import torch; print(torch.__version__)')"

PORT=$((29600 + RANDOM % 200))
TORCH_CUDA_SANITIZER=1 timeout 200 torchrun --standalone --nproc-per-node "$GPUS" --master-port "$PORT" \
  scripts/gpu_smoke.py --backend nccl --out "$OUT/gpu.pt" 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ] || grep -q "CSAN" "$OUT/gpu.log"; then
  echo "gpu_smoke: FAILED on GPU (exit $status$(grep -q CSAN "$OUT/gpu.log" && echo ', CUDA sanitizer reported a race'))" >&2
  exit 1
fi
echo "gpu_smoke: GPU run finished, CUDA sanitizer reported no race"

CUDA_VISIBLE_DEVICES="" timeout 80 torchrun --standalone --nproc-per-node "$GPUS" --master-port "$((PORT + 1))" \
  scripts/gpu_smoke.py --backend gloo --out "$OUT/cpu.pt"
python scripts/gpu_smoke.py --compare "$OUT/gpu.pt" "$OUT/cpu.pt"
echo "gpu_smoke: OK"
