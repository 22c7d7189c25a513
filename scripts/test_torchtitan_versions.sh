#!/usr/bin/env bash
# Run the torchtitan integration tests against each supported torchtitan release, each
# in a throwaway venv (under a temp dir, removed as soon as that release is done and at
# exit) with torch pinned, and lins_dtensor from this checkout via PYTHONPATH=src.
# 0.2.2 and 0.3.0 cannot share a venv (0.3 dropped TOML configs; both pin their own
# dependencies), so the main venv (scripts/env.sh) stays on 0.2.2 and this script is
# where 0.3 is tested. Not part of the 15-minute main suite.
#
# Usage: bash scripts/test_torchtitan_versions.sh [VERSION ...]
#   default: 0.2.2 0.3.0, every supported release (0.4.0 is not on the registry here).
#   TORCH=2.13.0 (default) picks the torch release; 2.13.0 resolves to the local +cpu
#   wheel, others are CUDA builds (~3 GB each). PYTEST_ARGS="-m 'not slow'" keeps the
#   quick tests only (default: all, slow ones included: parity with torchtitan's FSDP
#   from a seed checkpoint, resume, TP 2).
# Prints one line per release; exits 1 if an installed release fails, 2 if none could
# be installed.
#
# Tests per release: 0.2.2 -> tests/test_torchtitan.py (TOML `[lins]`), 0.3.x ->
# tests/test_torchtitan03.py (`LinsTrainer.Config`, `--lins.*`). Each file skips itself
# in the other release's venv. Cost on 2 shared cores: install 2-4 min, quick tests
# 3-6 min, all tests 15-30 min per release.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ $# -gt 0 ]; then VERSIONS=("$@"); else VERSIONS=(0.2.2 0.3.0); fi
TORCH="${TORCH:-2.13.0}"
MIN_FREE_GB=6

test_file() {  # the test file of a torchtitan release
  case "$1" in
    0.2.*) echo tests/test_torchtitan.py ;;
    0.3.*) echo tests/test_torchtitan03.py ;;
    *) return 1 ;;
  esac
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/lins-torchtitan-versions.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

SUMMARY=()
FAILED=0
INSTALLED=0
START=$SECONDS
for v in "${VERSIONS[@]}"; do
  t0=$SECONDS
  if ! tests=$(test_file "$v"); then
    SUMMARY+=("torchtitan $v: not supported by lins_dtensor (supported: 0.2.2, 0.3.x)")
    FAILED=1
    continue
  fi
  free_gb=$(( $(df -Pk "$WORK" | awk 'NR==2 {print $4}') / 1024 / 1024 ))
  if [ "$free_gb" -lt "$MIN_FREE_GB" ]; then
    SUMMARY+=("torchtitan $v: not installable here: ${free_gb} GB free under $(dirname "$WORK"), needs ${MIN_FREE_GB} GB")
    continue
  fi
  venv="$WORK/venv"
  echo "=== torchtitan $v, torch $TORCH: installing into a throwaway venv" >&2
  python3 -m venv "$venv"
  # triton: torchtitan imports it on every trainer import (MoE kernels), even on CPU.
  if ! "$venv/bin/pip" install --only-binary=torch "torch==$TORCH" "torchtitan==$v" triton tomli pytest pytest-timeout \
       tensorboard tokenizers >"$WORK/pip.log" 2>&1; then
    SUMMARY+=("torchtitan $v: not installable here: pip: $(grep -m1 '^ERROR' "$WORK/pip.log" | cut -c1-200)")
    rm -rf "$venv"
    continue
  fi
  INSTALLED=$((INSTALLED + 1))
  install_s=$((SECONDS - t0))

  echo "=== torchtitan $v: $tests" >&2
  t1=$SECONDS
  # shellcheck disable=SC2086  # PYTEST_ARGS holds several arguments
  eval "PYTHONPATH=\"$ROOT/src\" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \"$venv/bin/python\" -m pytest -q -p no:cacheprovider \
    ${PYTEST_ARGS:-} \"$tests\"" >"$WORK/pytest.log" 2>&1
  rc=$?
  last=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$WORK/pytest.log" | grep -E ' in [0-9.]+s' | tail -n1)
  count() { printf '%s' "$last" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0; }
  counts="$(count passed) passed, $(count failed) failed, $(count skipped) skipped, $(count 'errors?') errors"
  line="torchtitan $v (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')): $counts in $((SECONDS - t1)) s (install ${install_s} s)"
  if [ "$rc" -ne 0 ] || [ "$(count passed)" = 0 ]; then
    line+=": FAILED (pytest exit $rc)"
    FAILED=1
    echo "--- torchtitan $v: the end of pytest's output" >&2
    tail -n 60 "$WORK/pytest.log" >&2
  fi
  SUMMARY+=("$line")
  rm -rf "$venv"
done

echo
echo "torchtitan releases ($(( (SECONDS - START) / 60 )) min in all):"
printf '  %s\n' "${SUMMARY[@]}"
[ "$FAILED" -eq 0 ] || exit 1
[ "$INSTALLED" -gt 0 ] || exit 2
