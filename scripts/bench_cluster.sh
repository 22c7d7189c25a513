#!/usr/bin/env bash
# Emulated multi-node cluster benchmark: Lins vs FSDP2 / HSDP / hpZ / ZeRO / DDP.
#
# Usage (as root; needs iproute2's `ip` and `tc`):
#   bash scripts/bench_cluster.sh [options] [-- <options of python -m lins_dtensor.bench.cluster>]
#
# Options (each also settable by the environment variable in brackets):
#   --nodes N             emulated nodes = network namespaces (default 2)      [BENCH_NODES]
#   --ranks-per-node R    gloo ranks per node (default 4; 2x4 = 8 ranks)       [BENCH_RANKS_PER_NODE]
#   --rate RATE           tbf rate of each node's link, both directions, in tc
#                         units (default 300mbit)                              [BENCH_RATE]
#   --timeout S           wall-clock limit of the whole run, seconds (1500)    [BENCH_TIMEOUT]
#   --out DIR             where cluster.json/.md/.png and bandwidth.json go
#                         (default bench/results)                              [BENCH_OUT]
#   --subnet A.B.C        private /24 for the veth addresses (10.231.0)        [BENCH_SUBNET]
#   --tag NAME            prefix of the namespaces/links created (default
#                         lb<pid>; at most 8 characters)                       [BENCH_TAG]
#   --profile-max-size S  largest message of the bandwidth profile (4MiB)      [BENCH_PROFILE_MAX]
#   --profile-iters K     calls per profiled point and round (3)               [BENCH_PROFILE_ITERS]
#   --profile-rounds R    rounds over all points; each keeps its median (5)    [BENCH_PROFILE_ROUNDS]
#   --run NAME            cluster: profile, then the benchmark (default);
#                         timeline: one Lins plan's step, collective by collective
#                         (python -m lins_dtensor.bench.timeline; no profile)   [BENCH_RUN]
# Everything after `--` goes to the benchmark module, e.g.
#   -- --model tiny --strategies fsdp2 --microbatches 1 --warmup 0 --steps 1
#   -- --memory-budget-gib 0.25 (per-rank budget the planner must respect)
# See docs/benchmark.md and `python -m lins_dtensor.bench.cluster --help`.
#
# What it does: creates a "switch" namespace holding a bridge and one namespace per
# node, each joined to the bridge by a veth pair addressed inside the private /24;
# both ends of every node's veth get a tbf qdisc at RATE, so each node has a RATE
# up- and down-link while ranks inside a node talk over loopback. It then launches,
# in every node namespace, one `torchrun --nnodes N --node-rank i` with
# GLOO_SOCKET_IFNAME set to that node's veth, rendezvous on node 0's address: first
# `python -m lins_dtensor.planner profile` (the planner's bandwidth table, measured
# on this emulated cluster), then `python -m lins_dtensor.bench.cluster`. A trap on
# EXIT/INT/TERM kills what it started and deletes every namespace it created (their
# veths and qdiscs go with them), on success, failure, timeout or Ctrl-C. Traffic only
# goes to loopback and to the addresses assigned here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODES="${BENCH_NODES:-2}"
RPN="${BENCH_RANKS_PER_NODE:-4}"
RATE="${BENCH_RATE:-300mbit}"
TIMEOUT="${BENCH_TIMEOUT:-1500}"
OUT="${BENCH_OUT:-$ROOT/bench/results}"
SUBNET="${BENCH_SUBNET:-10.231.0}"
TAG="${BENCH_TAG:-lb$$}"
PROFILE_MAX="${BENCH_PROFILE_MAX:-4MiB}"
PROFILE_ITERS="${BENCH_PROFILE_ITERS:-3}"
PROFILE_ROUNDS="${BENCH_PROFILE_ROUNDS:-5}"
RUN="${BENCH_RUN:-cluster}"
BENCH_ARGS=()

die() { echo "bench_cluster.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --ranks-per-node) RPN="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --subnet) SUBNET="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --profile-max-size) PROFILE_MAX="$2"; shift 2 ;;
    --profile-iters) PROFILE_ITERS="$2"; shift 2 ;;
    --profile-rounds) PROFILE_ROUNDS="$2"; shift 2 ;;
    --run) RUN="$2"; shift 2 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

# ----- preconditions: one line and a non-zero status when the machine cannot do it ----
[ "$(id -u)" -eq 0 ] || { echo "bench_cluster.sh: needs root to create network namespaces (run as root)" >&2; exit 3; }
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 \
  || { echo "bench_cluster.sh: needs iproute2 ('ip' and 'tc' not found)" >&2; exit 3; }
[[ "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 2 && "$NODES" -le 16 ]] || die "--nodes must be 2..16, got '$NODES'"
[[ "$RPN" =~ ^[0-9]+$ && "$RPN" -ge 1 ]] || die "--ranks-per-node must be >= 1, got '$RPN'"
[[ "$TIMEOUT" =~ ^[0-9]+$ && "$TIMEOUT" -ge 10 ]] || die "--timeout must be >= 10 seconds, got '$TIMEOUT'"
[[ "$SUBNET" =~ ^10\.[0-9]+\.[0-9]+$ ]] || die "--subnet must be a private 10.x.y prefix, got '$SUBNET'"
[[ "$TAG" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--tag must be 1-8 lowercase letters/digits, got '$TAG'"
[[ "$RUN" == cluster || "$RUN" == timeline ]] || die "--run must be cluster or timeline, got '$RUN'"

# ----- cleanup: everything created below, whatever happens -----------------------------
NAMESPACES=()
PIDS=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do
    # Each launcher runs under `timeout` (its own process group): end the group.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  for ns in "${NAMESPACES[@]}"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  [ "${#NAMESPACES[@]}" -eq 0 ] || echo "bench_cluster.sh: removed namespaces ${NAMESPACES[*]}" >&2
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
DEADLINE=$(( $(date +%s) + TIMEOUT ))
remaining() { echo $(( DEADLINE - $(date +%s) )); }

# ----- the emulated cluster -------------------------------------------------------------
SWITCH="${TAG}sw"
ip netns add "$SWITCH"; NAMESPACES+=("$SWITCH")
ip -n "$SWITCH" link set lo up
ip -n "$SWITCH" link add br0 type bridge
ip -n "$SWITCH" link set br0 up
for i in $(seq 0 $((NODES - 1))); do
  ns="${TAG}n$i"
  ip netns add "$ns"; NAMESPACES+=("$ns")
  ip -n "$ns" link set lo up
  # Created inside the node namespace, so no link ever appears in the host namespace.
  ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$SWITCH"
  ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$SWITCH" link set "p$i" master br0
  ip -n "$SWITCH" link set "p$i" up
  # The node's uplink (node -> switch) and downlink (switch -> node).
  tc -n "$ns" qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 100ms
  tc -n "$SWITCH" qdisc add dev "p$i" root tbf rate "$RATE" burst 256kb latency 100ms
done
echo "bench_cluster.sh: $NODES nodes x $RPN ranks, inter-node links $RATE (tbf), namespaces ${NAMESPACES[*]}" >&2

# ----- python -------------------------------------------------------------------------
cd "$ROOT"
# shellcheck disable=SC1091
source scripts/env.sh
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=ERROR

# launch PORT MODULE ARGS...: one torchrun per node namespace; waits for all of them.
launch() {
  local port="$1"; shift
  local left; left=$(remaining)
  [ "$left" -gt 5 ] || { echo "bench_cluster.sh: out of time (--timeout $TIMEOUT)" >&2; return 124; }
  PIDS=()
  for i in $(seq 0 $((NODES - 1))); do
    # `timeout` makes its own process group, so cleanup can end torchrun and its ranks.
    timeout -k 10 "$left" ip netns exec "${TAG}n$i" env GLOO_SOCKET_IFNAME=eth0 \
      torchrun --nnodes "$NODES" --nproc-per-node "$RPN" --node-rank "$i" \
        --master-addr "$SUBNET.1" --master-port "$port" "$@" &
    PIDS+=("$!")
  done
  local status=0
  for pid in "${PIDS[@]}"; do
    wait "$pid" || status=$?
  done
  PIDS=()
  return "$status"
}

if [ "$RUN" = timeline ]; then
  launch 29513 -m lins_dtensor.bench.timeline "${BENCH_ARGS[@]}"
  exit 0
fi
echo "bench_cluster.sh: profiling collectives (planner bandwidth table)" >&2
launch 29511 -m lins_dtensor.planner profile --out "$OUT/bandwidth.json" \
  --max-size "$PROFILE_MAX" --iters "$PROFILE_ITERS" --rounds "$PROFILE_ROUNDS" --ranks-per-node "$RPN"
echo "bench_cluster.sh: running the benchmark" >&2
launch 29512 -m lins_dtensor.bench.cluster --bandwidth "$OUT/bandwidth.json" --out-dir "$OUT" \
  --link-rate "$RATE" "${BENCH_ARGS[@]}"
echo "bench_cluster.sh: results in $OUT" >&2
