/* bench_attn.cu - TFLOP/s of the flash kernels (make bench-gpu).

   FlashAttention's shapes and FLOP convention: bf16, B * S = 16K tokens, S = 1K .. 32K (B = 1 at
   32K: there is no B = 1/2), H * D = 2048, D = 64 and 128, causal and not; forward
   4 * B * S^2 * H * D FLOPs, halved when causal; backward 2.5x the forward. Each point is the
   median of 10 timed runs (bench_median_ms: back to back, after 100 ms of warm-up). Prints CSV
   (impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops) on stdout and, on stderr,
   each kernel's registers and shared memory. bench/bench_sdpa.py prints the same for PyTorch;
   bench/plot_attn.py draws them side by side.
   Arguments: bench_attn [TOKENS [SMIN SMAX [WIDTH [D CAUSAL]]]]: B * S, the range of S
   (doubling) and H * D, defaults 16384 1024 32768 2048; D and CAUSAL keep one head dim and mask
   (bench/lent_gpu.sh profiles that point's first launch). make test runs it under the emulator
   at a tiny size, a smoke check of the whole pipeline (bench/run_attn.sh) whose times mean
   nothing. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"

#include "bench_cuda.h"
#include "ref64.h"

#include <math.h>
#include <string.h>

static void kernel_info(const char *name, const void *fn, size_t dyn_smem) {
#ifdef ULY_EMU /* no cudaFuncGetAttributes there: registers and spills are nvcc's */
    (void)fn;
    fprintf(stderr, "%-28s %6zu bytes shared (dynamic)\n", name, dyn_smem);
#else
    cudaFuncAttributes at;
    CUDA_OK(cudaFuncGetAttributes(&at, fn));
    fprintf(stderr, "%-28s %3d registers, %6zu bytes shared (dynamic), %zu spilled\n", name,
            at.numRegs, dyn_smem, at.localSizeBytes);
#endif
}

template <int D> static void kernel_table(void) {
    typedef __nv_bfloat16 T;
    char name[64];
    snprintf(name, sizeof name, "fwd D=%d", D);
    kernel_info(name, (const void *)uly__flash_fwd<T, D>, uly__fa_fwd_smem<D>());
    snprintf(name, sizeof name, "bwd dK dV + atomic dQ D=%d", D);
    kernel_info(name, (const void *)uly__flash_bwd_kv<T, D, true>, uly__fa_bwd_kv_smem<D>());
    snprintf(name, sizeof name, "bwd dK dV (determ.) D=%d", D);
    kernel_info(name, (const void *)uly__flash_bwd_kv<T, D, false>, uly__fa_bwd_kv_smem<D>());
    snprintf(name, sizeof name, "bwd dQ (determ.) D=%d", D);
    kernel_info(name, (const void *)uly__flash_bwd_q<T, D>, uly__fa_bwd_q_smem<D>());
}

/* Batch b of t on the host, as floats. */
static std::vector<float> host_batch(const uly_tensor &t, int64_t b) {
    std::vector<__nv_bfloat16> x((size_t)t.sb);
    CUDA_OK(cudaMemcpy(x.data(), (const __nv_bfloat16 *)t.data + b * t.sb, x.size() * 2,
                       cudaMemcpyDeviceToHost));
    std::vector<float> f(x.size());
    for (size_t i = 0; i < x.size(); i++) f[i] = __bfloat162float(x[i]);
    return f;
}

/* Query rows 0 and S - 1 of the last batch and head: o against tests/ref64.h's fp64 softmax of
   the same bf16 inputs; the larger |o - ref| / |ref| of the two rows. */
static double rows_error(const uly_attn_args &a) {
    const int64_t S = a.q.s, D = a.q.d, b = a.q.b - 1, h = a.q.h - 1;
    const std::vector<float> q = host_batch(a.q, b), k = host_batch(a.k, b);
    const std::vector<float> v = host_batch(a.v, b), o = host_batch(a.o, b);
    const ref_shape one = {1, S, S, a.q.h, a.k.h, D, a.causal, 0}; /* batch b, dense */
    std::vector<double> p((size_t)S);
    double worst = 0;
    for (int64_t i : {(int64_t)0, S - 1}) {
        ref_row_probs(&one, q.data(), k.data(), 0, h, i, p.data());
        double err = 0, norm = 0;
        for (int64_t d = 0; d < D; d++) {
            double r = 0;
            for (int64_t j = 0; j < S; j++) r += p[j] * v[ref_ki(&one, 0, j, h) + d];
            const double e = o[ref_qi(&one, 0, i, h) + d] - r;
            err += e * e, norm += r * r;
        }
        worst = std::max(worst, sqrt(err / norm));
    }
    return worst;
}

/* What one point's first forward and backward wrote, outside the timed runs: every element of
   o, dq, dk and dv (poisoned with NaN before them) finite, and o's first and last query rows of
   the last batch and head within 2e-2 of a double softmax (bf16 inputs, P and output: about
   5e-3). A kernel that skipped part of a grid this large would otherwise time as faster. */
static void check_point(const uly_attn_args &a) {
    unsigned *bad, n_bad = 0;
    CUDA_OK(cudaMalloc((void **)&bad, sizeof *bad));
    CUDA_OK(cudaMemset(bad, 0, sizeof *bad));
    for (const uly_tensor *t : {&a.o, &a.dq, &a.dk, &a.dv})
        ULY_LAUNCH(bench_count_nonfinite, dim3(1024), dim3(256), 0, 0,
                   (const __nv_bfloat16 *)t->data, t->b * t->s * t->h * t->d, bad);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(&n_bad, bad, sizeof n_bad, cudaMemcpyDeviceToHost));
    cudaFree(bad);
    const double err = rows_error(a);
    if (n_bad || !(err <= 2e-2)) {
        fprintf(stderr, "check: %u outputs not finite, o's rows off by %.2g\n", n_bad, err);
        exit(1);
    }
}

int main(int argc, char **argv) {
    int64_t tokens = 16384, smin = 1024, smax = 32768, width = 2048, one_d = 0, one_causal = 0;
    if (argc > 1) tokens = atoll(argv[1]);
    if (argc > 3) smin = atoll(argv[2]), smax = atoll(argv[3]);
    if (argc > 4) width = atoll(argv[4]);
    if (argc > 6) one_d = atoll(argv[5]), one_causal = atoll(argv[6]);
    const bool bad_point =
        one_d && ((one_d != 64 && one_d != 128) || one_causal < 0 || one_causal > 1);
    if (argc == 3 || argc == 6 || argc > 7 || tokens < 1 || smin < 1 || width < 128 ||
        width % 128 || bad_point) {
        fprintf(stderr, "usage: bench_attn [TOKENS [SMIN SMAX [WIDTH [D CAUSAL]]]], WIDTH a "
                        "multiple of 128, D 64 or 128, CAUSAL 0 or 1\n");
        return 2;
    }
    kernel_table<64>();
    kernel_table<128>();
    printf("impl,d,causal,seq,batch,heads,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops\n");
    for (int64_t D : {64, 128})
        for (int causal : {0, 1}) {
            if (one_d && (D != one_d || causal != one_causal)) continue;
            for (int64_t S = smin; S <= smax; S *= 2) {
                const int64_t B = std::max<int64_t>(1, tokens / S), H = width / D;
                const int64_t n = B * S * H * D;
                std::vector<__nv_bfloat16 *> buf(8);
                for (uint32_t i = 0; i < 8; i++) buf[i] = bench_random(n, i * 977u + 1u, 0);
                uly_attn_args a;
                memset(&a, 0, sizeof a);
                a.q = uly_dense(buf[0], ULY_BF16, B, S, H, D), a.k = a.q, a.v = a.q, a.o = a.q;
                a.k.data = buf[1], a.v.data = buf[2], a.o.data = buf[3];
                a.dout = a.q, a.dout.data = buf[4], a.dq = a.q, a.dq.data = buf[5];
                a.dk = a.q, a.dk.data = buf[6], a.dv = a.q, a.dv.data = buf[7];
                a.causal = causal;
                CUDA_OK(cudaMalloc((void **)&a.lse, (size_t)(B * H * S) * 4));
                const uly_attn fa = uly_flash_attention();
                a.workspace_bytes = fa.workspace(fa.ctx, &a);
                CUDA_OK(cudaMalloc(&a.workspace, (size_t)a.workspace_bytes));
                for (int i : {3, 5, 6, 7}) CUDA_OK(cudaMemset(buf[i], 0xff, (size_t)n * 2));
                bench_ok(fa.fwd(fa.ctx, &a), "forward");
                bench_ok(fa.bwd(fa.ctx, &a), "backward");
                check_point(a);
                const double fwd =
                    bench_median_ms(0, 2, 10, [&] { bench_ok(fa.fwd(fa.ctx, &a), "forward"); });
                const double bwd =
                    bench_median_ms(0, 2, 10, [&] { bench_ok(fa.bwd(fa.ctx, &a), "backward"); });
                const double flops = 4.0 * B * S * S * H * D / (causal ? 2 : 1);
                printf("ulysses,%lld,%d,%lld,%lld,%lld,%.3f,%.3f,%.1f,%.1f\n", (long long)D, causal,
                       (long long)S, (long long)B, (long long)H, fwd, bwd, flops / fwd * 1e-9,
                       2.5 * flops / bwd * 1e-9);
                fflush(stdout);
                for (auto p : buf) cudaFree(p);
                cudaFree(a.lse), cudaFree(a.workspace);
            }
        }
    return 0;
}
