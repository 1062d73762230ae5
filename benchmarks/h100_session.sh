#!/usr/bin/env bash
# Everything the lead runs on the lent H100 in one device call, from the repository root:
#   tests    — the CUDA test suite (tests/kernels + tests/workbench; the notebook and browser tests
#              need Jupyter and Chromium, which that machine does not have: they run in CI);
#   density  — benchmarks/_density_cuda.py with its 3WIP variants;
#   workbench, planarity — bench_workbench.py on 3WIP (cuda), bench_planarity.py (--profile);
#   cpu      — bench_density.py --device cpu on the host's idle cores, 1 and 2 threads (11 rounds,
#              with the forward at 1 and 4 slabs per thread as same-run variants);
#   probe    — cpu_phase_probe.py on 5H73 and 3WIP at 1 and 2 threads (phases, slabs, page faults);
#   compilers — the CPU kernel built by every g++-N the host has, timed against the default build
#              (cpu_build_ab.py, 5H73 and 3WIP at 1 and 2 threads) with the compilers' versions.
# Usage: PARTS="tests density workbench planarity cpu probe compilers" bash benchmarks/h100_session.sh
# The GPU image has torch/triton but not gemmi or the widget stack: their py3.12 wheels travel in the
# git-ignored .whl/ (carry: [".whl"]). Results, named with the device and date, are packed into
# $OUT/h100_results.tar.gz (the device tool returns at most 8 files).
set -o pipefail
DEST="${OUT:-/tmp/h100-out}"
OUT=/tmp/h100-results
PARTS="${PARTS:-tests density workbench planarity cpu}"
mkdir -p "$OUT" "$DEST"
day=$(date -u +%F)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl/workbench/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    python3 -c "import torch, triton, gemmi; print('torch', torch.__version__, 'triton', triton.__version__, 'gemmi', gemmi.__version__)"
    nproc
    lscpu | grep -iE "model name|thread|core|socket|numa node\(s\)|flags" | cut -c1-200
} | tee "$OUT/device.txt"
has() { [[ " $PARTS " == *" $1 "* ]]; }
summary=()
if has tests; then
    # xdist: the test files are independent; 16 cores, one GPU with room for all of them.
    timeout 200 python3 -m pytest tests/kernels tests/workbench -q -p no:cacheprovider -n 6 -o addopts="-ra" \
        > "$OUT/tests_cuda_h100_$day.log" 2>&1
    summary+=("tests rc=$?: $(tail -n 1 "$OUT/tests_cuda_h100_$day.log")")
fi
if has density; then
    timeout 200 python3 -m benchmarks._density_cuda --variants --out "$OUT/density_cuda_h100_$day.json" \
        > "$OUT/density_cuda_h100_$day.log" 2>&1
    summary+=("density rc=$?")
fi
if has workbench; then
    timeout 90 python3 benchmarks/bench_workbench.py --device cuda --structure tests/data/3wip.cif.gz \
        --out "$OUT/workbench_cuda_h100_$day.json" > "$OUT/workbench_cuda_h100_$day.log" 2>&1
    summary+=("workbench rc=$?")
fi
if has planarity; then
    OMP_NUM_THREADS=2 timeout 90 python3 benchmarks/bench_planarity.py --reps 300 --cpu-threads 2 --profile \
        --out "$OUT/planarity_cuda_h100_$day.json" > "$OUT/planarity_cuda_h100_$day.log" 2>&1
    summary+=("planarity rc=$?")
fi
if has cpu; then
    python3 -c "from kernels.density import _scatter; print('cpu build', _scatter.build_info())" | tee -a "$OUT/device.txt"
    OMP_NUM_THREADS=2 timeout 400 python3 benchmarks/bench_density.py --device cpu --structures 1orc 1aki 5h73 3wip \
        --threads 1 2 --repeats 11 --slab-variants 1 4 --out "$OUT/density_cpu_h100host_$day.json" \
        > "$OUT/density_cpu_h100host_$day.log" 2>&1
    summary+=("density cpu rc=$?")
fi
if has probe; then
    OMP_NUM_THREADS=2 timeout 200 python3 benchmarks/cpu_phase_probe.py --structures 5h73 3wip --threads 1 2 \
        --rounds 12 --out "$OUT/cpu_phase_probe_h100host_$day.json" > "$OUT/cpu_phase_probe_h100host_$day.log" 2>&1
    summary+=("cpu probe rc=$?")
fi
if has compilers; then
    so=$(ls kernels/density/_scatter.cpython-*.so)
    builds=(--build "default=$so")
    { echo "default: $(c++ --version | head -n 1)"; } > "$OUT/compilers_h100host_$day.txt"
    for cxx in $(cd /usr/bin && ls g++-[0-9]* 2>/dev/null); do
        CC=$cxx CXX=$cxx LDSHARED="$cxx -shared" python3 setup.py -q build_ext --build-lib "/tmp/b-$cxx" \
            --build-temp "/tmp/t-$cxx" >> "$OUT/build.log" 2>&1 || continue
        builds+=(--build "$cxx=$(ls /tmp/b-"$cxx"/kernels/density/_scatter.cpython-*.so)")
        echo "$cxx: $($cxx --version | head -n 1)" >> "$OUT/compilers_h100host_$day.txt"
    done
    OMP_NUM_THREADS=2 timeout 200 python3 benchmarks/cpu_build_ab.py "${builds[@]}" --structures 5h73 3wip \
        --threads 1 2 --rounds 11 --out "$OUT/cpu_build_ab_h100host_$day.json" > "$OUT/cpu_build_ab_h100host_$day.log" 2>&1
    summary+=("compilers rc=$?")
fi
for f in "$OUT"/*.log; do
    [ "$f" = "$OUT/build.log" ] && continue
    echo "=== $(basename "$f")"
    tail -n 14 "$f"
done
printf '%s\n' "${summary[@]}"
tar -czf "$DEST/h100_results.tar.gz" -C "$OUT" .
