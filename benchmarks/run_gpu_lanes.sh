#!/usr/bin/env bash
# Two run_gpu.sh lanes side by side on a two-GPU host, then parts that need both GPUs:
#
#   bash benchmarks/run_gpu_lanes.sh OUT "LANE0" "LANE1" "AFTER" [DEADLINE_S] [AFTER_S]
#
# A lane is run_gpu.sh PARTS, or "cmd:<shell command>" (run with DIR set to the lane's folder).
# Lane 0 runs on GPU 0 and the first half of the cores, from this tree; lane 1 on GPU 1 and the
# other half, from a copy of the tree in /tmp/lane1 (so that no build in one lane rewrites a module
# the other has loaded; BEFORE, for the ab part, defaults to the lane's tree's before/). AFTER (run_gpu.sh PARTS) runs on both GPUs once both lanes are done.
# DEADLINE_S bounds the whole run (default 560), of which AFTER_S is kept for AFTER (default 0).
# OUT/results.tgz holds every file of the lanes and of AFTER (folders l0, l1, after): one file, for
# machines that hand back few.
# BUILD_FIRST=0 skips building the C++ modules first (parts that use only the GPU paths; run_gpu.sh
# takes BUILD=0 likewise). Records made this way say which lane shared the host with what.
set -o pipefail
t0=$SECONDS
OUT="${1:?usage: bash benchmarks/run_gpu_lanes.sh OUT LANE0 LANE1 AFTER [DEADLINE_S] [AFTER_S]}"
L0="$2"; L1="$3"; AFTER="$4"; DEADLINE="${5:-560}"; AFTER_S="${6:-0}"
R=$(mktemp -d)
mkdir -p "$OUT" "$R/l0" "$R/l1" "$R/after"
finish() {
    tar czf "$OUT/results.tgz" -C "$R" .
    for f in "$R"/*/lane.out; do echo "### $f"; tail -n 25 "$f"; done
}
trap finish EXIT
if [ "${BUILD_FIRST:-1}" != 0 ]; then
    PYTHON=python3 bash scripts/build.sh > "$R/build.log" 2>&1 || { tail -n 30 "$R/build.log"; exit 1; }
    echo "built at $((SECONDS - t0)) s"
fi
rm -rf /tmp/lane1 && mkdir /tmp/lane1 && tar -C . --exclude=./.git --exclude=./.venv -cf - . | tar -C /tmp/lane1 -xf -
n=$(nproc); h=$((n / 2))
lane() { # gpu cores outdir tree parts seconds
    if [[ "$5" == cmd:* ]]; then
        (cd "$4" && CUDA_VISIBLE_DEVICES=$1 DIR="$3" taskset -c "$2" timeout -k 5 "$6" bash -c "${5#cmd:}") > "$3/lane.out" 2>&1
    else
        (cd "$4" && CUDA_VISIBLE_DEVICES=$1 BEFORE="${BEFORE:-$4/before}" PARTS="$5" taskset -c "$2" \
            timeout -k 5 "$6" bash benchmarks/run_gpu.sh "$3") > "$3/lane.out" 2>&1
    fi
    echo "lane $1 rc=$? at $((SECONDS - t0)) s"
}
left=$((DEADLINE - (SECONDS - t0) - AFTER_S))
[ -n "$L0" ] && lane 0 "0-$((h - 1))" "$R/l0" "$PWD" "$L0" "$left" &
[ -n "$L1" ] && lane 1 "$h-$((n - 1))" "$R/l1" /tmp/lane1 "$L1" "$left" &
wait
if [ -n "$AFTER" ]; then
    left=$((DEADLINE - (SECONDS - t0)))
    (PARTS="$AFTER" timeout -k 5 "$left" bash benchmarks/run_gpu.sh "$R/after") > "$R/after/lane.out" 2>&1
    echo "after ($AFTER) rc=$? at $((SECONDS - t0)) s"
fi
