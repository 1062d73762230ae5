#!/usr/bin/env bash
# Runs the CUDA tests and the benchmarks on a GPU machine and writes the results to DIR.
#
#   PARTS="tests density planarity tricubic workbench cpu" bash benchmarks/run_gpu.sh DIR
#
# Run from the repository root. Assumes the Python dependencies (torch, triton, gemmi, the
# workbench's widget stack, pytest, pytest-xdist, nanobind) are installed; builds the C++ extensions in
# place (scripts/build.sh; cmake and ninja from .whl/build/ where the machine lacks them). Parts (default: all but eager, ensemble, aniso, determinism and loop):
#   tests      the CUDA suite: tests/kernels and tests/workbench (the notebook and browser tests
#              need Jupyter and Chromium and are left out)
#   density    benchmarks/_density_cuda.py with the 3WIP variants
#   planarity  bench_planarity.py, CPU rows at 2 threads, with the eager-call profile
#   tricubic   bench_tricubic.py (CPU rows at 2 and 1 threads)
#   workbench  bench_workbench.py on 3WIP with the GPU
#   cpu        bench_density.py --device cpu on the host's cores, 1 and 2 threads, 11 rounds
#   eager      bench_eager.py: density (with the torchref peers from $PEER053 / $PEER070, each a
#              `pip install --no-deps --target DIR` of its wheel; a peer left unset is reported as
#              not run), planarity and tricubic, eager vs graph vs the floor
#   ensemble   bench_ensemble.py on one GPU; with 2 or more GPUs also the torchrun (NCCL) run on 2
#   stream     issue 37, bench_ensemble.py --stream-gpu on one GPU: 10^6 frames of 1AKI and 10^5 of 3WIP
#              streamed from a generator (forward, forward + the streamed backward, peak memory, against
#              the in-memory rate); stops at 270 s
#   stream2    issue 37 under torchrun on 2 GPUs (needs 2 visible): 3WIP streamed from a DCD it writes (one
#              GPU against two, decoding alone) and one map's all-reduce; stops at 270 s
#   aniso      bench_aniso_gpu.py: anisotropic against isotropic atoms (1PFE, 3O5R, 3WIP synthetic U)
#   determinism  issue 36: tests/kernels/test_density_deterministic.py (10 calls bitwise, permuted atoms),
#              bench_atomics.py (atomic-add throughput, the splat's fractions of it) and bench_eager.py's
#              density part with --deterministic (peers as for eager)
#   loop       bench_loop.py: the fitting loop on the GPU, eager (every structure, the ensemble,
#              L-BFGS) and compiled / reduce-overhead (Adam), in three runs of at most 9 minutes
#   loopprof   issue 33's profile: bench_loop.py --profile on 1aki and 3wip, iso and U, atoms.replace, eager /
#              compiled / reduce-overhead: GPU kernels and host ops per step, the Python functions (cProfile)
#   detprof    issue 36's deterministic misses with their profile: bench_eager.py --parts density --deterministic
#              --profile (no peers): ours, ours deterministic and the floor, and the GPU work of each call
#   loopab     issue 33's compiled-against-eager target: loop_compile_ab.py, the whole step eager / compiled /
#              compiled loss and optimiser / reduce-overhead, interleaved, on 1aki, 3wip and 3wip-hiB, iso and U
#   gputier    scripts/test_gpu.sh: the GPU test tier (pytest -m gpu), failures printed as they happen
#   peers      issue 36 part 3: bench_eager.py --parts peers with torchref 0.5.3.3, 0.7.0 and the 0.8 build, each
#              installed from .whl/peers/ (torchref*.whl, torchref_kernels*.whl) into a --target folder under /tmp
#   ab         issue 35's before/after: $BEFORE (an exported older checkout, built here) against this tree,
#              benchmarks/density_ab.py (eager, side by side in one run)
#   bitwise    scripts/triton_bitwise.py on the GPU: $BEFORE's and this tree's deterministic maps and
#              gradients, bit for bit. Slow: every kernel variant compiles cold in each tree (over 7 minutes
#              on an H200 host), so the interpreter and PTX-hash checks of that script are the usual route
#   reciprocal issue 48: bench_reciprocal.py on the GPU (structure factors of 3WIP at 2 A from its 0.667 A
#              map, shells, FSC; targets 1 ms each) and on the host's CPU at 2 threads, and the CUDA tests of
#              tests/kernels/test_reciprocal.py
#   streamvjp  issue 37's second pass: bench_stream_vjp.py (backward alone against recomputing the forward)
#   gather     issue 49: tests/kernels/test_density_triton_gather.py on CUDA, the isotropic deterministic CUDA tests
#              with every forward through the gather (KERNELS_TRITON_FORWARD=gather), then bench_gather.py (scatter,
#              deterministic scatter, gather and its parts, the zeros_like write bound); needs no C++ build (BUILD=0)
#   loopcheck  issue 33's GPU check, about 3 minutes after the C++ build (which takes 1.5 more on the H200
#              host the first time): the CUDA tests that reduce-overhead replays
#              (planarity, a fitting step, tricubic) match eager, then bench_loop.py on 1aki and
#              3wip, iso and U, eager / compiled / reduce-overhead, step against its parts (interleaved),
#              building the atoms, compiled and replayed gradients against eager (--check-grads)
# Files are named <op>_<gpu>_<date> (GPU parts) and <op>_<gpu>host_<date> (CPU parts), <gpu> from
# nvidia-smi (h100, h200, a100, ... or "gpu"). device.txt records the GPU, CPU and versions.
# BUILD=0 skips building the C++ modules in place, for parts that run only the GPU paths (stream,
# stream2, peers, streamvjp, gather: no module of theirs imports them).
set -o pipefail
DIR="${1:?usage: bash benchmarks/run_gpu.sh DIR}"
PARTS="${PARTS:-tests density planarity tricubic workbench cpu}"
mkdir -p "$DIR"
day=$(date -u +%F)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oE '[AHBL][0-9]{2,3}' | head -n 1 | tr 'A-Z' 'a-z')
gpu="${gpu:-gpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
build_inplace() {  # CHECKOUT: its C++ modules, built in place (an older checkout may still build with setup.py)
    if [ -f "$1/scripts/build.sh" ]; then
        PYTHON=python3 bash "$1/scripts/build.sh"
    else
        (cd "$1" && python3 setup.py -q build_ext --inplace)
    fi
}
if [ "${BUILD:-1}" != 0 ]; then
    build_inplace . > "$DIR/build.log" 2>&1 || { tail -n 30 "$DIR/build.log"; exit 1; }
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    python3 -c "import torch, triton, gemmi; print('torch', torch.__version__, 'triton', triton.__version__, 'gemmi', gemmi.__version__)"
    python3 -c "from kernels.density import cpu, _scatter; print('cpu build', _scatter.build_info())"
    nproc
    lscpu | grep -iE "model name|thread|core|socket|numa node\(s\)" | cut -c1-200
} > "$DIR/device.txt" 2>&1
cat "$DIR/device.txt"
has() { [[ " $PARTS " == *" $1 "* ]]; }
# GPUs this process may use (CUDA_VISIBLE_DEVICES honoured, which nvidia-smi ignores)
visible_gpus() { python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
summary=()
if has tests; then
    python3 -m pytest tests/kernels tests/workbench -q -p no:cacheprovider -n 6 -o addopts="-ra" \
        > "$DIR/tests_cuda_${gpu}_$day.log" 2>&1
    summary+=("tests rc=$?: $(tail -n 1 "$DIR/tests_cuda_${gpu}_$day.log")")
fi
if has density; then
    python3 -m benchmarks._density_cuda --variants --out "$DIR/density_cuda_${gpu}_$day.json" \
        > "$DIR/density_cuda_${gpu}_$day.log" 2>&1
    summary+=("density rc=$?")
fi
if has planarity; then
    OMP_NUM_THREADS=2 python3 benchmarks/bench_planarity.py --reps 300 --cpu-threads 2 --profile \
        --out "$DIR/planarity_cuda_${gpu}_$day.json" > "$DIR/planarity_cuda_${gpu}_$day.log" 2>&1
    summary+=("planarity rc=$?")
fi
if has tricubic; then
    OMP_NUM_THREADS=2 python3 benchmarks/bench_tricubic.py --out-dir "$DIR" > "$DIR/tricubic_cuda_${gpu}_$day.log" 2>&1
    summary+=("tricubic rc=$?")
fi
if has workbench; then
    python3 benchmarks/bench_workbench.py --device cuda --structure tests/data/3wip.cif.gz \
        --out "$DIR/workbench_cuda_${gpu}_$day.json" > "$DIR/workbench_cuda_${gpu}_$day.log" 2>&1
    summary+=("workbench rc=$?")
fi
if has cpu; then
    OMP_NUM_THREADS=2 python3 benchmarks/bench_density.py --device cpu --structures 1orc 1aki 5h73 3wip \
        --threads 1 2 --repeats 11 --slab-variants 1 4 --out "$DIR/density_cpu_${gpu}host_$day.json" \
        > "$DIR/density_cpu_${gpu}host_$day.log" 2>&1
    summary+=("density cpu rc=$?")
fi
if has eager; then
    peers=()
    [ -n "${PEER053:-}" ] && peers+=(--peer053 "$PEER053")
    [ -n "${PEER070:-}" ] && peers+=(--peer070 "$PEER070")
    timeout 600 python3 benchmarks/bench_eager.py "${peers[@]}" --out "$DIR/eager_cuda_${gpu}_$day.json" \
        > "$DIR/eager_cuda_${gpu}_$day.log" 2>&1
    summary+=("eager rc=$?")
fi
if has ensemble; then
    timeout 480 python3 benchmarks/bench_ensemble.py --out "$DIR/ensemble_cuda_${gpu}_$day.json" \
        > "$DIR/ensemble_cuda_${gpu}_$day.log" 2>&1
    summary+=("ensemble rc=$?")
    if [ "$(visible_gpus)" -ge 2 ]; then
        timeout 480 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_ensemble.py --distributed \
            --out "$DIR/ensemble_cuda_${gpu}x2_$day.json" > "$DIR/ensemble_cuda_${gpu}x2_$day.log" 2>&1
        summary+=("ensemble 2 GPUs rc=$?")
    fi
fi
if has stream; then
    timeout 270 python3 benchmarks/bench_ensemble.py --stream-gpu --out-dir "$DIR" \
        > "$DIR/stream_cuda_${gpu}_$day.log" 2>&1
    summary+=("stream 1 GPU rc=$?")
fi
if has stream2; then
    if [ "$(visible_gpus)" -ge 2 ]; then
        timeout 270 python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_ensemble.py \
            --stream-gpu --out-dir "$DIR" > "$DIR/stream_cuda_${gpu}x2_$day.log" 2>&1
        summary+=("stream 2 GPUs rc=$?")
    else
        summary+=("stream 2 GPUs: not run, $(visible_gpus) GPU visible")
    fi
fi
if has aniso; then
    timeout 300 python3 benchmarks/bench_aniso_gpu.py --out "$DIR/aniso_cuda_${gpu}_$day.json" \
        > "$DIR/aniso_cuda_${gpu}_$day.log" 2>&1
    summary+=("aniso rc=$?")
fi
if has determinism; then
    python3 -m pytest tests/kernels/test_density_deterministic.py tests/kernels/test_tricubic.py -q -p no:cacheprovider \
        -k "gpu or deterministic" -o addopts="-ra" > "$DIR/tests_determinism_${gpu}_$day.log" 2>&1
    summary+=("determinism tests rc=$?: $(tail -n 1 "$DIR/tests_determinism_${gpu}_$day.log")")
    timeout 240 python3 benchmarks/bench_atomics.py --out "$DIR/atomics_${gpu}_$day.json" \
        > "$DIR/atomics_${gpu}_$day.log" 2>&1
    summary+=("atomics rc=$?")
    peers=()
    [ -n "${PEER053:-}" ] && peers+=(--peer053 "$PEER053")
    [ -n "${PEER070:-}" ] && peers+=(--peer070 "$PEER070")
    timeout 420 python3 benchmarks/bench_eager.py "${peers[@]}" --parts density --deterministic \
        --out "$DIR/eager_deterministic_cuda_${gpu}_$day.json" > "$DIR/eager_deterministic_cuda_${gpu}_$day.log" 2>&1
    summary+=("eager deterministic rc=$?")
fi
if has gather; then
    timeout 300 python3 -m pytest tests/kernels/test_density_triton_gather.py -q -p no:cacheprovider -o addopts="-ra" \
        > "$DIR/tests_gather_${gpu}_$day.log" 2>&1
    summary+=("gather tests rc=$?: $(tail -n 1 "$DIR/tests_gather_${gpu}_$day.log")")
    KERNELS_TRITON_FORWARD=gather timeout 300 python3 -m pytest tests/kernels/test_density_deterministic.py -q \
        -p no:cacheprovider -k "gpu_isotropic or gpu_frames_ten_calls_bitwise[iso] or gpu_ensemble" -o addopts="-ra" \
        > "$DIR/tests_gather_deterministic_${gpu}_$day.log" 2>&1
    summary+=("gather deterministic tests rc=$?: $(tail -n 1 "$DIR/tests_gather_deterministic_${gpu}_$day.log")")
    timeout 240 python3 benchmarks/bench_gather.py --out "$DIR/gather_${gpu}_$day.json" > "$DIR/gather_${gpu}_$day.log" 2>&1
    summary+=("gather bench rc=$?")
fi
if has loop; then
    timeout 540 python3 benchmarks/bench_loop.py --device cuda --modes eager \
        --out "$DIR/loop_cuda_${gpu}_${day}_eager.json" > "$DIR/loop_cuda_${gpu}_${day}_eager.log" 2>&1
    summary+=("loop eager rc=$?")
    for adp in iso aniso; do
        timeout 540 python3 benchmarks/bench_loop.py --device cuda --modes compiled reduce-overhead --optimizers adam \
            --ensemble 0 --adp "$adp" --steps 30 --out "$DIR/loop_cuda_${gpu}_${day}_compiled_$adp.json" \
            > "$DIR/loop_cuda_${gpu}_${day}_compiled_$adp.log" 2>&1
        summary+=("loop compiled $adp rc=$?")
    done
fi
if has loopcheck; then
    timeout -k 10 50 python3 -m pytest tests/kernels/test_compile_planarity_tricubic.py -k reduce_overhead \
        -v -p no:cacheprovider -o addopts="-ra" > "$DIR/tests_loop_${gpu}_$day.log" 2>&1
    summary+=("reduce-overhead tests rc=$? (124: timed out): $(tail -n 1 "$DIR/tests_loop_${gpu}_$day.log")")
    timeout -k 10 120 python3 benchmarks/bench_loop.py --device cuda --structures 1aki 3wip --adp iso aniso \
        --modes eager compiled reduce-overhead --optimizers adam --ensemble 0 --steps 12 --reps 10 \
        --case-seconds 3 --check-grads --out "$DIR/loop_cuda_${gpu}_$day.json" > "$DIR/loop_cuda_${gpu}_$day.log" 2>&1
    summary+=("loop bench rc=$? (1: a case failed, 124: timed out; the JSON keeps what was measured)")
fi
if has loopprof; then
    timeout -k 10 200 python3 benchmarks/bench_loop.py --device cuda --structures 1aki 3wip --adp iso aniso \
        --modes eager compiled reduce-overhead --optimizers adam --builds replace --ensemble 0 --steps 12 --reps 10 \
        --case-seconds 3 --profile --out "$DIR/loop_profile_cuda_${gpu}_$day.json" > "$DIR/loop_profile_cuda_${gpu}_$day.log" 2>&1
    summary+=("loop profile rc=$?")
fi
if has detprof; then
    timeout -k 10 300 python3 benchmarks/bench_eager.py --parts density --deterministic --profile --reps 30 \
        --out "$DIR/eager_deterministic_profile_cuda_${gpu}_$day.json" > "$DIR/eager_deterministic_profile_cuda_${gpu}_$day.log" 2>&1
    summary+=("deterministic profile rc=$?")
fi
if has loopab; then
    timeout -k 10 300 python3 benchmarks/loop_compile_ab.py --device cuda --structures 1aki 3wip 3wip-hiB \
        --adp iso aniso --reps 40 --out "$DIR/loop_ab_cuda_${gpu}_$day.json" > "$DIR/loop_ab_cuda_${gpu}_$day.log" 2>&1
    summary+=("loop a/b rc=$?")
fi
if has gputier; then
    LOG="$DIR/tests_gpu_tier_${gpu}_$day.log" timeout 540 bash scripts/test_gpu.sh > /dev/null 2>&1
    summary+=("gpu tier rc=$?: $(tail -n 1 "$DIR/tests_gpu_tier_${gpu}_$day.log")")
fi
if has peers; then
    for p in 053:torchref-0.5.3.3 070:torchref-0.7.0 08:torchref-0.8.0.dev0+g26e407e; do
        python3 -m pip install -q --no-deps --no-index --target "/tmp/peer${p%%:*}" ".whl/peers/${p#*:}-py3-none-any.whl"
    done
    for d in /tmp/peer070 /tmp/peer08; do
        python3 -m pip install -q --no-deps --no-index --target "$d" .whl/peers/torchref_kernels-*.whl
    done
    timeout 300 python3 benchmarks/bench_eager.py --parts peers --peer053 /tmp/peer053 --peer070 /tmp/peer070 \
        --peer08 /tmp/peer08 --profile --out "$DIR/peers_cuda_${gpu}_$day.json" > "$DIR/peers_cuda_${gpu}_$day.log" 2>&1
    summary+=("peers rc=$?")
fi
if has ab; then
    build_inplace "${BEFORE:?ab needs BEFORE=an older checkout}" > "$DIR/build_before.log" 2>&1
    timeout 420 python3 benchmarks/density_ab.py --before "$BEFORE" --out "$DIR/density_ab_cuda_${gpu}_$day.json" \
        > "$DIR/density_ab_cuda_${gpu}_$day.log" 2>&1
    summary+=("density a/b rc=$?")
fi
if has bitwise; then
    build_inplace "${BEFORE:?bitwise needs BEFORE=an older checkout}" > "$DIR/build_before.log" 2>&1
    { PYTHONPATH="$BEFORE:${PYTHONPATH#"$PWD:"}" timeout 600 python3 scripts/triton_bitwise.py save --deterministic /tmp/bitwise_before.pt &&
      timeout 600 python3 scripts/triton_bitwise.py save --deterministic /tmp/bitwise_after.pt &&
      python3 scripts/triton_bitwise.py compare /tmp/bitwise_before.pt /tmp/bitwise_after.pt; } > "$DIR/bitwise_cuda_${gpu}_$day.log" 2>&1
    summary+=("triton bitwise rc=$?: $(tail -n 1 "$DIR/bitwise_cuda_${gpu}_$day.log")")
fi
if has reciprocal; then
    python3 -m pytest tests/kernels/test_reciprocal.py -q -p no:cacheprovider -k cuda -o addopts="-ra" \
        > "$DIR/tests_reciprocal_${gpu}_$day.log" 2>&1
    summary+=("reciprocal tests rc=$?: $(tail -n 1 "$DIR/tests_reciprocal_${gpu}_$day.log")")
    timeout 300 python3 benchmarks/bench_reciprocal.py --device cuda --machine "$gpu" --out-dir "$DIR" \
        > "$DIR/reciprocal_cuda_${gpu}_$day.log" 2>&1
    summary+=("reciprocal cuda rc=$?")
    OMP_NUM_THREADS=2 timeout 300 python3 benchmarks/bench_reciprocal.py --device cpu --machine "${gpu}host" \
        --out-dir "$DIR" > "$DIR/reciprocal_cpu_${gpu}host_$day.log" 2>&1
    summary+=("reciprocal cpu rc=$?")
fi
if has streamvjp; then
    timeout 180 python3 benchmarks/bench_stream_vjp.py --out-dir "$DIR" > "$DIR/stream_vjp_cuda_${gpu}_$day.log" 2>&1
    summary+=("stream vjp rc=$?")
fi
for f in "$DIR"/*.log; do
    [ "$f" = "$DIR/build.log" ] && continue
    echo "=== $(basename "$f")"
    tail -n 14 "$f"
done
printf '%s\n' "${summary[@]}"
