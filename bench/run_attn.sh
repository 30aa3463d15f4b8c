#!/bin/sh
# run_attn.sh BENCH_ATTN PYTHON - the attention benchmark (make bench-gpu): our kernels, then
# PyTorch's SDPA (flash backend) in the same session, then the table and the plot. Writes, under
# bench/: attention_ulysses.csv, attention_kernels.txt (registers and shared memory per kernel),
# attention_sdpa.csv, attention.md (TFLOP/s side by side) and attention.png.
set -e
"$1" > bench/attention_ulysses.csv 2> bench/attention_kernels.txt
cat bench/attention_kernels.txt
if "$2" -c 'import torch' 2>/dev/null; then
    "$2" bench/bench_sdpa.py > bench/attention_sdpa.csv
else
    echo "bench_sdpa: no PyTorch for $2; the table has our numbers only"
    echo "impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops" > bench/attention_sdpa.csv
fi
"$2" bench/plot_attn.py bench/attention_ulysses.csv bench/attention_sdpa.csv > bench/attention.md
cat bench/attention.md
