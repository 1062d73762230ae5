#!/usr/bin/env bash
# Everything the lead runs on the lent H100 in one device call: the CUDA test suite
# (kernels + workbench) and the benchmarks that need the GPU host (workbench latency on
# 3WIP, the CPU density benchmark on the host's idle cores with 1 and 2 threads).
# The GPU image has torch/triton but not gemmi or the widget stack: their py3.12 wheels
# travel in the git-ignored .whl/ (carry: [".whl"]). Results go to $OUT.
set -o pipefail
OUT="${OUT:-/tmp/h100-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl/workbench/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
timeout 330 python3 -m pytest tests/kernels tests/workbench -q -p no:cacheprovider -o addopts="-ra" \
    > "$OUT/tests_cuda.log" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/tests_cuda.log"
timeout 150 python3 benchmarks/bench_workbench.py --device cuda --structure tests/data/3wip.cif.gz \
    --out "$OUT/workbench_cuda.json" > "$OUT/workbench_cuda.log" 2>&1
echo "workbench bench rc=$?" >> "$OUT/workbench_cuda.log"
OMP_NUM_THREADS=2 timeout 150 python3 benchmarks/bench_density.py --device cpu \
    --structures 1orc 1aki 5h73 3wip --threads 1 2 --out "$OUT/density_cpu_host.json" > "$OUT/density_cpu_host.log" 2>&1
echo "density cpu bench rc=$?" >> "$OUT/density_cpu_host.log"
tail -25 "$OUT/tests_cuda.log"; tail -15 "$OUT/workbench_cuda.log"; tail -25 "$OUT/density_cpu_host.log"
