#!/bin/bash
# One device call for the planarity and tricubic follow-ups: build the two C++ extensions,
# run both test files on CUDA, then both benchmarks (CPU rows limited to 2 threads).
# Usage on the GPU host, from the repository root, with OUT set: bash benchmarks/h100_planarity_tricubic.sh
set -o pipefail
export PYTHONUNBUFFERED=1
date=$(date -u +%F)
inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# Only these two extensions (other helpers' uncommitted .cpp files stay unbuilt).
for src in kernels/planarity/_plane_fit.cpp kernels/tricubic/_tricubic.cpp; do
    g++ -O3 -std=c++17 -fno-math-errno -fopenmp -fPIC -shared -I"$inc" "$src" -o "${src%.cpp}$ext" &
done
wait
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
# The two test files side by side (independent; 16 cores), then the benchmarks alone.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_planarity.py > "$OUT/planarity_tests.log" 2>&1 &
p1=$!
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tricubic.py > "$OUT/tricubic_tests.log" 2>&1
r2=$?
wait $p1
r1=$?
tail -n 3 "$OUT/planarity_tests.log" "$OUT/tricubic_tests.log"
export OMP_NUM_THREADS=2
python3 benchmarks/bench_planarity.py --reps 300 --cpu-threads 2 \
    --out "$OUT/planarity_cuda_h100_$date.json" 2>&1 | tee "$OUT/planarity_bench.log"
python3 benchmarks/bench_tricubic.py --out-dir "$OUT" 2>&1 | tee "$OUT/tricubic_bench.log"
echo "tests rc: planarity $r1 tricubic $r2"
