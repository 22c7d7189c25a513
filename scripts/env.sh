# Sourced by the scripts: make .venv with everything lins_dtensor needs, then activate it.
# Idempotent and quick when already installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  python3 -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  # The pinned CPU build; an unpinned 'torch' would pull a multi-GB CUDA build.
  pip install -q torch==2.13.0
fi
if ! python -c "import torchtitan, triton, tomli, pytest, tensorboard, tokenizers, matplotlib, pytest_timeout" 2>/dev/null; then
  pip install -q "torchtitan==0.2.2" triton tomli pytest pytest-timeout tensorboard tokenizers matplotlib
fi
if ! python -c "import lins_dtensor" 2>/dev/null; then
  pip install -q --no-deps -e "$ROOT"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
