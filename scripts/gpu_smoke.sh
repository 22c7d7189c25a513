#!/usr/bin/env bash
# Lins' accelerator path, every side-stream path, against the CPU path (scripts/gpu_smoke.py
# says what runs and why gloo carries the CUDA tensors). Needs only torch (2.11 or newer)
# and this checkout: Lins runs from src/ (PYTHONPATH), no pip, no torchtitan, no network.
#
# Usage: bash scripts/gpu_smoke.sh [--dry-run] [--out-dir DIR]
#   on a GPU machine: 4 ranks on the GPU(s), 6 cases x 3 steps with host-sync counting and
#     injected device sleeps, then the same under TORCH_CUDA_SANITIZER=1 (CSAN reports any
#     kernel touching a tensor another stream may still use; DTensor's inner kernels
#     are not seen by it, so the TP case is checked by the masters only). Under 5 minutes.
#   --dry-run: the same driver on CPU with tests/fake_device.py as the device (no GPU
#     needed; CI runs it); about 1 minute.
# Writes gpu_smoke_<pass>.json and .md under DIR (default: $OUT if set, else
# ./gpu_smoke_out); exit 0 when every case matched the CPU path with no host sync in its
# steady-state steps and the sanitizer reported nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
OUT_DIR="${OUT:-$PWD/gpu_smoke_out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out-dir) OUT_DIR="$2"; shift ;;
    *) echo "usage: bash scripts/gpu_smoke.sh [--dry-run] [--out-dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
PYTHON="${PYTHON:-python}"

launch() {  # launch LABEL DEVICE TIMEOUT [ENV=VALUE ...]
  local label=$1 device=$2 limit=$3
  shift 3
  env "$@" timeout "$limit" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 4 \
    scripts/gpu_smoke.py --device "$device" --out-dir "$OUT_DIR" --label "$label" 2>&1 | tee "$OUT_DIR/gpu_smoke_$label.log"
  return "${PIPESTATUS[0]}"
}

if [ "$DRY" -eq 1 ]; then
  echo "gpu_smoke: dry run on CPU with the fake device, torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
  launch dry-run fake 240
  status=$?
  [ "$status" -eq 0 ] && echo "gpu_smoke: dry run OK ($OUT_DIR/gpu_smoke_dry-run.md)" || echo "gpu_smoke: dry run FAILED (exit $status)" >&2
  exit "$status"
fi

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_smoke: no CUDA device visible; use --dry-run on a machine without one" >&2
  exit 2
fi
echo "gpu_smoke: $("$PYTHON" -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)')"
launch main cuda 180
main=$?
launch sanitizer cuda 120 TORCH_CUDA_SANITIZER=1
sanitizer=$?
if grep -q "CSAN" "$OUT_DIR/gpu_smoke_sanitizer.log"; then
  echo "gpu_smoke: the CUDA sanitizer reported a race (see $OUT_DIR/gpu_smoke_sanitizer.log)" >&2
  sanitizer=1
fi
echo "gpu_smoke: main pass exit $main, sanitizer pass exit $sanitizer; reports in $OUT_DIR"
[ "$main" -eq 0 ] && [ "$sanitizer" -eq 0 ]
