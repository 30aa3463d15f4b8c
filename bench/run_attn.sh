#!/bin/sh
# run_attn.sh [-o OUTDIR] [-d DEVICE] BENCH_ATTN PYTHON [SIZES...] - the attention benchmark
# (make bench-gpu): our kernels, then PyTorch's SDPA (flash backend) in the same session, then the
# table and the plot. Writes, under OUTDIR (default bench/): attention_ulysses.csv,
# attention_kernels.txt (registers and shared memory per kernel), attention_sdpa.csv, attention.md
# (TFLOP/s side by side) and attention.png. SIZES (TOKENS [SMIN SMAX [WIDTH]]) go to both
# programs, DEVICE (default cuda) to bench_sdpa.py: make test runs a tiny size on the emulator and
# the CPU, into build/. A program that fails stops neither the others nor the table of what was
# printed, so a GPU lease keeps what it measured; the exit status says whether one failed.
set -e
usage="usage: run_attn.sh [-o OUTDIR] [-d DEVICE] BENCH_ATTN PYTHON [SIZES...]"
out=bench dev=cuda
while getopts o:d: opt; do
    case $opt in
    o) out=$OPTARG ;;
    d) dev=$OPTARG ;;
    *) echo "$usage" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
bench=$1 py=$2
shift 2
mkdir -p "$out"
rc=0
"$bench" "$@" > "$out/attention_ulysses.csv" 2> "$out/attention_kernels.txt" || rc=1
cat "$out/attention_kernels.txt"
if "$py" -c 'import torch' 2>/dev/null; then
    "$py" bench/bench_sdpa.py --device "$dev" "$@" > "$out/attention_sdpa.csv" || rc=1
else
    echo "bench_sdpa: no PyTorch for $py; the table has our numbers only"
    echo "impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops" \
        > "$out/attention_sdpa.csv"
fi
"$py" bench/plot_attn.py "$out/attention_ulysses.csv" "$out/attention_sdpa.csv" \
    "$out/attention.png" > "$out/attention.md" || rc=1
cat "$out/attention.md"
[ $rc = 0 ] || echo "run_attn: a program failed (its message is above)"
exit $rc
