#!/usr/bin/env bash
# Issue 18's targets on a many-core host, in one go and in priority order (each run capped,
# the whole well inside ten minutes on 16 cores): every result is a JSON line appended to
# OUT/results.jsonl, the benchmarks' own output to OUT/log.
#
#   bash bench/many_cores.sh OUT [PYTHON]
#
# For a host with no package index, see bench/offline_wheels.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/many_cores.sh OUT [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

run() {  # run SECONDS ARGS...: one benchmark, its JSON lines kept
    local limit=$1; shift
    echo "== $(date +%T) $*" | tee -a "$out/log"
    timeout "$limit" "$py" "$@" 2>>"$out/log" | tee -a "$out/log" \
        | grep '^{' >>"$out/results.jsonl" || echo "   (ended: status $?)" | tee -a "$out/log"
}

"$py" -c "import os, sys; print('cores', os.cpu_count(), 'python', sys.version.split()[0])" \
    | tee -a "$out/log"
run 120 bench/scale.py --only W1                      # W1 placements/s (>= 2,500)
run 120 bench/scale.py --only W1 --rate 1000          # W1 p99 submit->ASSIGNED (<= 100 ms)
run 90 bench/submit_latency.py --jobs 100             # W3 submit->SUCCEEDED p50 (<= 8 ms)
run 120 bench/scale.py --only W8,P1                   # gangs/s (>= 200); P1 jobs/s, CPU/job
run 240 bench/scale.py --only W4 --w4-sizes 1000,10000 --w4-cap 60  # >= 0.8x, <= 400 MiB
echo "== $(date +%T) done" | tee -a "$out/log"
