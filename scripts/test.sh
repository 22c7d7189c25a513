#!/usr/bin/env bash
# Run the test suite. Creates .venv and installs what is missing on a fresh machine
# (torch pinned to the local CPU wheel 2.13.0 when no torch is installed).
# Usage: bash scripts/test.sh [pytest args]   e.g.  bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec python -m pytest -q "$@"
