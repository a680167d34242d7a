#!/usr/bin/env bash
# `astraflow bench control` as docs/benchmarks.md runs it on a lent many-core host.
#
#   scripts/bench_control_ab.sh inproc  ROUNDS SHAPE...   in process on one CPU, BASE_SRC and this tree alternated
#   scripts/bench_control_ab.sh live    ROUNDS SHAPE...   live, 2 members, the controller alone on one CPU, alternated
#   scripts/bench_control_ab.sh members ROUNDS SHAPE      this tree only: 2 against 10,000 members (--repeat ROUNDS)
#
# SHAPE is GxP (group size x tasks a step: 16x32 is the quickstart's). BASE_SRC is the src/ directory of
# the tree to compare with (a `git worktree` of another commit); without it only this tree runs.
# CONTROLLER_CPU (default 0) and INPROC_CPU (default 2) move the pinned CPUs on a smaller machine; SLOTS
# (default 0: a step's tasks) is the tasks each worker asks for at a time (`--slots`, both trees must take it).
# Each line printed is one run: the side, the shape, the round and its figures.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?inproc, live or members}
rounds=${2:?rounds}
shift 2
here=$PWD/src
sides=(new)
[ -n "${BASE_SRC:-}" ] && sides=(base new)
py=${PYTHON:-python3}

src_of() { if [ "$1" = base ]; then echo "$BASE_SRC"; else echo "$here"; fi; }

inproc() { # side G P round
  local steps=40
  [ "$(($2 * $3))" -gt 1024 ] && steps=10
  PYTHONPATH=$(src_of "$1")${PYTHONPATH:+:$PYTHONPATH} taskset -c "${INPROC_CPU:-2}" "$py" -m astraflow bench control --in-process \
    --steps "$steps" --group-size "$2" --batch-prompts "$3" ${SLOTS:+--slots "$SLOTS"} 2>/dev/null |
    awk -v s="inproc $1 $2x$3 $4" '/controller CPU/ {printf "%s %s us/sequence; ", s, $3} /by message/ {print}'
}

live() { # side G P round
  local out
  out=$(mktemp)
  PYTHONPATH=$(src_of "$1")${PYTHONPATH:+:$PYTHONPATH} timeout 120 "$py" -m astraflow bench control --members 2 \
    --curve off --seconds 8 --procs 2 --controller-cpu "${CONTROLLER_CPU:-0}" --group-size "$2" --batch-prompts "$3" ${SLOTS:+--slots "$SLOTS"} --json >"$out" 2>/dev/null || true
  "$py" - "$out" "live $1 $2x$3 $4" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][0]
except Exception as exc:  # a run that failed says so and the others go on
    print(sys.argv[2], "failed:", exc)
else:
    keys = ("sequences_per_s", "controller_cpu_pct", "controller_cpu_ms_per_step", "main_ms_per_step")
    print(sys.argv[2], {k: r.get(k) for k in keys})
PY
  rm -f "$out"
}

case "$mode" in
  inproc | live)
    for round in $(seq "$rounds"); do
      for shape in "$@"; do
        for side in "${sides[@]}"; do "$mode" "$side" "${shape%x*}" "${shape#*x}" "$round"; done
      done
    done
    ;;
  members)
    shape=${1:-64x64}
    PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} "$py" -m astraflow bench control --members 2,10000 \
      --group-size "${shape%x*}" --batch-prompts "${shape#*x}" --seconds 10 --procs 8 --controller-cpu "${CONTROLLER_CPU:-0}" \
      --settle-s 15 --repeat "$rounds" --curve off
    ;;
  *)
    echo "mode must be inproc, live or members" >&2
    exit 2
    ;;
esac
