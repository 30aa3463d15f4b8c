/* bench_cuda.h - what the GPU benchmarks share: CUDA_OK and bench_ok, random bf16 data made on
   the device, and the median time of a piece of work on a stream. Include after ulysses_cuda.cuh (and,
   for an emulated smoke run, after emu/cuda_emu.h). */
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

/* n random bf16 values in new device memory, filled on stream s. */
static inline __nv_bfloat16 *bench_random(int64_t n, uint32_t seed, cudaStream_t s) {
    __nv_bfloat16 *x;
    CUDA_OK(cudaMalloc((void **)&x, (size_t)n * 2));
    ULY_LAUNCH(bench_fill, dim3(1024), dim3(256), 0, s, x, n, seed);
    return x;
}

/* Median milliseconds of fn() on stream s over `runs` timed runs after `warm` untimed ones. */
template <typename F> static double bench_median_ms(cudaStream_t s, int warm, int runs, F fn) {
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int i = 0; i < warm + runs; i++) {
        CUDA_OK(cudaEventRecord(a, s));
        fn();
        CUDA_OK(cudaEventRecord(b, s));
        CUDA_OK(cudaEventSynchronize(b));
        float t;
        CUDA_OK(cudaEventElapsedTime(&t, a, b));
        if (i >= warm) ms.push_back(t);
    }
    cudaEventDestroy(a), cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

#endif
