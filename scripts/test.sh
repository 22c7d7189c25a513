#!/usr/bin/env bash
# Run the test suite. Creates .venv and installs what is missing on a fresh machine
# (torch pinned to the local CPU wheel 2.13.0 when no torch is installed).
# Usage: bash scripts/test.sh [--quick] [pytest args]   e.g.  bash scripts/test.sh -m "not slow"
#   --quick: only the tests marked quick (pyproject.toml): the in-process tests (LinsUnit
#   over simulated ranks, the executor, layouts, plans, the planner) and every world-4
#   plan's parity, bytes and memory in one forked launch; under 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- -m quick "$@"
fi
exec python -m pytest -q "$@"
