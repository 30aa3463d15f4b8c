// bench_emu.cu: what the CUDA host emulator costs per barrier, per warp rendezvous and per mma,
// for one block of 128 threads (4 warps), the shape of the attention kernels. Prints; times
// nothing against a limit.
#include "emu/cuda_emu.h"
#include "ulysses_cuda.cuh"

#include <chrono>
#include <cstdio>

static const int kThreads = 128, kReps = 1000;

__global__ void barriers(int *out) {
    int v = threadIdx.x;
    for (int i = 0; i < kReps; i++) {
        v += i;
        __syncthreads();
    }
    out[threadIdx.x] = v;
}

__global__ void shuffles(int *out) {
    int v = threadIdx.x;
    for (int i = 0; i < kReps; i++) v += __shfl_xor_sync(0xffffffff, v, i & 31);
    out[threadIdx.x] = v;
}

__global__ void mmas(float *out) {
    uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b[2] = {a[0], a[1]};
    float acc[4] = {};
    for (int i = 0; i < kReps; i++) uly_mma_m16n8k16<__nv_bfloat16>(acc, a, b, acc);
    out[threadIdx.x] = acc[0];
}

// Runs the launch a few times and prints the best time per block and per operation.
template <typename F> static void report(const char *what, const char *per, F launch) {
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        auto t0 = std::chrono::steady_clock::now();
        launch();
        auto t1 = std::chrono::steady_clock::now();
        double s = std::chrono::duration<double>(t1 - t0).count();
        if (s < best) best = s;
    }
    if (cudaGetLastError() != cudaSuccess) printf("%s: launch failed\n", what);
    printf("%-44s %8.2f ms per block   %7.1f ns per %s\n", what, best * 1e3, best * 1e9 / kReps,
           per);
}

int main() {
    int *iout;
    float *fout;
    cudaMalloc(&iout, kThreads * sizeof(int));
    cudaMalloc(&fout, kThreads * sizeof(float));
    printf("cuda_emu: one block of %d threads, %d repetitions\n", kThreads, kReps);
    unsigned long long s0 = uly_emu_switches();
    report("__syncthreads", "barrier", [&] { ULY_LAUNCH(barriers, 1, kThreads, 0, 0, iout); });
    unsigned long long s1 = uly_emu_switches();
    report("__shfl_xor_sync (4 warps)", "rendezvous", [&] {
        ULY_LAUNCH(shuffles, 1, kThreads, 0, 0, iout);
    });
    report("mma.sync m16n8k16 bf16 (4 warps)", "mma", [&] {
        ULY_LAUNCH(mmas, 1, kThreads, 0, 0, fout);
    });
    printf("fiber switches per barrier: %.1f\n", (double)(s1 - s0) / (5.0 * kReps));
    cudaFree(iout);
    cudaFree(fout);
    return 0;
}
