/* bench_cuda.h - what the GPU benchmarks share: CUDA_OK and bench_ok, random bf16 data made on
   the device, and the median time of a piece of work on a stream. Include after
   ulysses_cuda.cuh (and, for an emulated smoke run, after emu/cuda_emu.h). */
#ifndef ULY_BENCH_CUDA_H
#define ULY_BENCH_CUDA_H

#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#define CUDA_OK(x)                                                                             \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                           \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* Under the emulator (make test's smoke runs, which check that every call succeeds and the
   tables print; the times mean nothing there) a benchmark runs each piece of work twice: one
   warm-up run, one timed. */
#ifdef ULY_EMU
enum { BENCH_SMOKE = 1 };
#else
enum { BENCH_SMOKE = 0 };
#endif

/* Exits with the message of a failed ulysses call. */
static inline void bench_ok(uly_status st, const char *what) {
    if (!st.code) return;
    fprintf(stderr, "%s: %s\n", what, st.msg);
    exit(1);
}

/* x[i] uniform in [-1, 1), a hash of i and seed. */
__global__ void bench_fill(__nv_bfloat16 *x, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = __float2bfloat16((float)(h & 0xffff) / 32768.f - 1.f);
    }
}

/* Adds to *bad the count of x's elements that are not finite: outputs poisoned with 0xff bytes
   (bf16 NaN) before a call and not written by it count too. */
__global__ void bench_count_nonfinite(const __nv_bfloat16 *x, int64_t n, unsigned *bad) {
    unsigned c = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        c += !isfinite(__bfloat162float(x[i]));
    if (c) atomicAdd(bad, c);
}

/* n random bf16 values in new device memory, filled on stream s. */
static inline __nv_bfloat16 *bench_random(int64_t n, uint32_t seed, cudaStream_t s) {
    __nv_bfloat16 *x;
    CUDA_OK(cudaMalloc((void **)&x, (size_t)n * 2));
    ULY_LAUNCH(bench_fill, dim3(1024), dim3(256), 0, s, x, n, seed);
    CUDA_OK(cudaGetLastError());
    return x;
}

/* Median milliseconds of fn() on stream s over `runs` runs. First at least `warm` untimed runs
   and 100 ms of them, as the clocks ramp up from idle. Then the timed runs back to back with an
   event between each, waited for once at the end: an interval is one run's GPU time, the host's
   launch work hidden behind the queue (an event pair around a synchronized run would time it
   too: a few microseconds, 10% of a 64 MB copy). */
template <typename F> static double bench_median_ms(cudaStream_t s, int warm, int runs, F fn) {
    if (BENCH_SMOKE) warm = 1, runs = 1;
    std::vector<cudaEvent_t> ev((size_t)runs + 1);
    for (cudaEvent_t &e : ev) CUDA_OK(cudaEventCreate(&e));
    float spent = 0;
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < warm || (!BENCH_SMOKE && spent < 100.f); i++) {
        fn();
        CUDA_OK(cudaEventRecord(ev[1], s));
        CUDA_OK(cudaEventSynchronize(ev[1]));
        CUDA_OK(cudaEventElapsedTime(&spent, ev[0], ev[1]));
    }
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < runs; i++) {
        fn();
        CUDA_OK(cudaEventRecord(ev[(size_t)i + 1], s));
    }
    CUDA_OK(cudaEventSynchronize(ev[(size_t)runs]));
    std::vector<float> ms((size_t)runs);
    for (int i = 0; i < runs; i++)
        CUDA_OK(cudaEventElapsedTime(&ms[(size_t)i], ev[(size_t)i], ev[(size_t)i + 1]));
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

#endif
