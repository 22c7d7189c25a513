#!/usr/bin/env bash
# Run the quick, torch-internals-sensitive tests against each torch release, each in a
# throwaway venv (under a temp dir, removed as soon as that version is done and at exit),
# with torch pinned, pytest, and lins_dtensor from this checkout via PYTHONPATH=src.
# A version outside compat.SUPPORTED_TORCH is not tested: it must stop `import
# lins_dtensor` with the one-line ImportError instead.
#
# Usage: bash scripts/test_torch_versions.sh [VERSION ...]
#   default: 2.10.0 (below the range: refused) 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0, the
#   newest patch of each minor release. Versions are tested or checked for the refusal by
#   compat.SUPPORTED_TORCH at the time. The venvs ignore pip's constraint file (this
#   machine's caps torch at 2.14.1): each pins its torch itself.
# Prints one line per version; exits 1 if an installed version fails (or an out-of-range
# one is not refused), 2 if no version could be installed at all.
#
# Cost per version: the PyPI Linux wheels are CUDA builds (they run on CPU but need their
# nvidia-* packages, about 3 GB to fetch and 5.5 GB installed); 2.13.0 resolves to the
# local +cpu wheel. Set TMPDIR to put the venvs on a disk with room.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# FSDP2 against stock FSDP2/HSDP (fp32 and bf16, custom all-gather/reduce-scatter), the
# overlapped executor under FSDP2 (stream waits, end-of-backward callback), bf16 P cast
# after a meta-device init, DTensor optimizer states, DCP checkpoints, the process-group
# timeout setter, gloo's groups running Lins' last chains after destroy_process_group (at
# exit), the chunk layout, the import gate and no deprecated torch API called:
# the private APIs and release differences in compat.py and the FSDP2 setters Lins calls.
# 2 to 6 minutes per version on 2 shared cores, plus 1.5 to 3.5 to install.
SUBSET=(
  tests/test_plan.py
  tests/test_layout.py
  tests/test_executor.py
  tests/test_packaging.py
  tests/test_compat.py
  tests/test_runtime.py::test_fsdp_equivalent_plans_match_fsdp2_and_hsdp
  tests/test_runtime.py::test_fsdp_equivalent_plans_send_fsdp2_bytes
  tests/test_runtime.py::test_bf16_error_is_within_fsdp2_bf16_error
  tests/test_runtime.py::test_tied_embeddings_in_a_nested_tree_train_like_one_process
  tests/test_runtime.py::test_masters_hold_the_full_precision_initial_values
  tests/test_runtime.py::test_optimizer_state_bytes_counts_local_shards_of_dtensor_states
  tests/test_checkpoint.py
  tests/test_errors.py::test_a_stopped_peer_fails_the_collective_within_the_timeout
  tests/test_collectives.py::test_ranks_that_exit_before_a_late_peer_wait_for_their_collectives
)
MIN_FREE_GB=8

if [ $# -gt 0 ]; then VERSIONS=("$@"); else VERSIONS=(2.10.0 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0); fi

# The supported (major, minor) range, read from compat.py (importing it needs torch).
read -r LO HI < <(python3 - "$ROOT/src/lins_dtensor/compat.py" <<'EOF'
import ast, sys
for node in ast.parse(open(sys.argv[1]).read()).body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SUPPORTED_TORCH":
        lo, hi = ast.literal_eval(node.value)
        print(".".join(map(str, lo)), ".".join(map(str, hi)))
EOF
)
[ -n "${HI:-}" ] || { echo "cannot read SUPPORTED_TORCH from src/lins_dtensor/compat.py" >&2; exit 2; }

in_range() {  # in_range 2.12.1 -> status 0 when LO <= (major, minor) <= HI
  python3 -c 'import sys
key = lambda v: tuple(int(p) for p in v.split("+")[0].split(".")[:2])
sys.exit(0 if key(sys.argv[2]) <= key(sys.argv[1]) <= key(sys.argv[3]) else 1)' "$1" "$LO" "$HI"
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/lins-torch-versions.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM
# An empty constraint file replaces pip's configured one (PIP_CONSTRAINT overrides the
# config's `constraint`), so a release above a local cap installs too.
: >"$WORK/no-constraints.txt"

SUMMARY=()
FAILED=0
INSTALLED=0
START=$SECONDS
for v in "${VERSIONS[@]}"; do
  t0=$SECONDS
  venv="$WORK/venv"
  echo "=== torch $v: installing into a throwaway venv" >&2
  free_gb=$(( $(df -Pk "$WORK" | awk 'NR==2 {print $4}') / 1024 / 1024 ))
  if [ "$free_gb" -lt "$MIN_FREE_GB" ]; then
    SUMMARY+=("torch $v: not installable here: ${free_gb} GB free under $(dirname "$WORK"), needs ${MIN_FREE_GB} GB")
    continue
  fi
  python3 -m venv "$venv"
  if ! PIP_CONSTRAINT="$WORK/no-constraints.txt" "$venv/bin/pip" install --only-binary=torch "torch==$v" pytest pytest-timeout numpy >"$WORK/pip.log" 2>&1; then
    reason="pip: $(grep -m1 '^ERROR' "$WORK/pip.log" | cut -c1-200)"
    SUMMARY+=("torch $v: not installable here: $reason")
    rm -rf "$venv"
    continue
  fi
  if ! found=$("$venv/bin/python" -c 'import torch; print(torch.__version__ + (", CUDA " + torch.version.cuda + " build on CPU" if torch.version.cuda else ", CPU build"))' 2>"$WORK/import.log"); then
    SUMMARY+=("torch $v: not installable here: installed but 'import torch' fails: $(tail -n1 "$WORK/import.log")")
    rm -rf "$venv"
    continue
  fi
  INSTALLED=$((INSTALLED + 1))
  install_s=$((SECONDS - t0))

  if ! in_range "$v"; then
    # Outside the range: the import must stop with the one-line ImportError.
    msg=$(PYTHONPATH="$ROOT/src" "$venv/bin/python" -c '
try:
    import lins_dtensor
except ImportError as e:
    print("refused:", e)
else:
    print("imported")' 2>&1)
    if [[ "$msg" == "refused: lins_dtensor supports torch"* ]] && [ "$(printf '%s\n' "$msg" | wc -l)" -eq 1 ]; then
      SUMMARY+=("torch $v ($found, outside $LO-$HI): refused at import as expected: ${msg#refused: }")
    else
      SUMMARY+=("torch $v ($found, outside $LO-$HI): FAILED: expected the one-line ImportError, got: $(printf '%s' "$msg" | tail -n1)")
      FAILED=1
    fi
    rm -rf "$venv"
    continue
  fi

  echo "=== torch $v ($found): running the quick subset" >&2
  t1=$SECONDS
  PYTHONPATH="$ROOT/src" HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
    --timeout=900 "${SUBSET[@]}" >"$WORK/pytest.log" 2>&1
  rc=$?
  last=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$WORK/pytest.log" | grep -E ' in [0-9.]+s' | tail -n1)
  count() { printf '%s' "$last" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0; }
  counts="$(count passed) passed, $(count failed) failed, $(count skipped) skipped, $(count 'errors?') errors"
  line="torch $v ($found): $counts in $((SECONDS - t1)) s (install ${install_s} s)"
  if [ "$rc" -ne 0 ]; then
    line+=": FAILED (pytest exit $rc)"
    FAILED=1
    echo "--- torch $v: the end of pytest's output" >&2
    tail -n 40 "$WORK/pytest.log" >&2
    echo "--- torch $v: the errors raised, with how often" >&2
    grep -oE '^E +[A-Za-z_.]*(Error|Exception): .*' "$WORK/pytest.log" | sed -E 's/^E +//' | cut -c1-200 |
      sort | uniq -c | sort -rn | head -n 8 >&2
  fi
  SUMMARY+=("$line")
  rm -rf "$venv"
done

echo
echo "torch versions, quick subset ($(( (SECONDS - START) / 60 )) min in all):"
printf '  %s\n' "${SUMMARY[@]}"
[ "$FAILED" -eq 0 ] || exit 1
[ "$INSTALLED" -gt 0 ] || exit 2
