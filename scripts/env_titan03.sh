# Sourced by scripts/train_titan03.sh: make .venv-titan03 with torchtitan 0.3.0 (which
# cannot share a venv with the default install's 0.2.2, scripts/env.sh), then activate
# it. lins_dtensor comes from this checkout (PYTHONPATH), not installed into the venv.
# Idempotent and quick when already installed. VENV_TITAN03=<dir> uses another venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_TITAN03:-$ROOT/.venv-titan03}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  # The pinned CPU build; an unpinned 'torch' would pull a multi-GB CUDA build.
  pip install -q torch==2.13.0
fi
if ! python -c "import torchtitan, triton, tensorboard, tokenizers" 2>/dev/null; then
  # triton: torchtitan imports it on every trainer import (MoE kernels), even on CPU.
  pip install -q "torchtitan==0.3.0" triton tensorboard tokenizers
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
