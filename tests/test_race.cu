// test_race.cu: the emulator's race detection (ThreadSanitizer over fibers, ULY_EMU_TSAN in
// tests/emu/cuda_emu.cpp). Each kernel comes twice: with a race CUDA does not order away (a
// missing __syncthreads or __syncwarp, a cp.async waited for too late), which must be reported,
// and with the barrier that fixes it, which must not. The kernels of ulysses_cuda.cuh then run
// under the same detector in make test (their tests built with -fsanitize=thread into
// build/tsan), so a missing barrier there is a failure on the CPU, not a wrong number on some
// GPU under some timing.
//
// Built only with -fsanitize=thread and the emulator's TSan build; reports are counted through
// ThreadSanitizer's __tsan_on_report hook, and the expected ones are not printed.
#include "emu/cuda_emu.h"
#include "ulysses_cuda.cuh"

#include <fcntl.h>
#include <sanitizer/common_interface_defs.h>
#include <unistd.h>

#include "check.h"

// Called inside a report, on whichever fiber found the race: not itself instrumented.
static int reports;
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_on_report(void *) { reports++; }
// This program counts the reports itself: the expected ones must not fail its exit status, and
// the kernels race on the same addresses (one shared-memory arena), which TSan reports once.
extern "C" const char *__tsan_default_options() {
    return "exitcode=0:suppress_equal_addresses=0:suppress_equal_stacks=0";
}

// The reports of one launch (its expected reports go to /dev/null, not to the test log).
template <typename Launch> static int reports_of(bool quiet, Launch launch) {
    const int devnull = open("/dev/null", O_WRONLY);
    if (quiet) __sanitizer_set_report_fd(reinterpret_cast<void *>((intptr_t)devnull));
    const int before = reports;
    launch();
    CHECK(cudaGetLastError() == cudaSuccess, "launch failed: %s", uly_emu_last_failure());
    __sanitizer_set_report_fd(reinterpret_cast<void *>((intptr_t)2));
    close(devnull);
    return reports - before;
}

// Both variants of a kernel: the racy one reported, the fixed one not.
#define CHECK_RACE(launch_racy, launch_fixed)                                                   \
    do {                                                                                        \
        const int fixed = reports_of(false, [&] { launch_fixed; });                             \
        CHECK(fixed == 0, "the fixed kernel: %d reports, want none", fixed);                    \
        const int racy = reports_of(true, [&] { launch_racy; });                                \
        CHECK(racy > 0, "the racy kernel: no report");                                          \
    } while (0)

// Device buffers the kernels share: where they write, and a zero 8 x 8 bf16 tile to copy in.
static float *out_buffer() {
    static float *out;
    if (!out) cudaMalloc(&out, 4096 * sizeof(float));
    return out;
}

static const __nv_bfloat16 *tile_source() {
    static __nv_bfloat16 *src;
    if (!src) {
        cudaMalloc(&src, 64 * sizeof(__nv_bfloat16));
        cudaMemset(src, 0, 64 * sizeof(__nv_bfloat16));
    }
    return src;
}

// Warp 0 writes shared memory, warp 1 reads it: only a __syncthreads between orders them.
// `lead` barriers before the exchange check that a barrier orders only what came before it: a
// thread that left barrier g and reached g + 1 must not seem ordered before one still between.
__global__ void warps_share(bool fixed, int lead, float *out) {
    ULY_DYN_SMEM(float, s);
    for (int i = 0; i < lead; i++) __syncthreads();
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (warp == 0) s[lane] = (float)lane;
    if (fixed) __syncthreads();
    if (warp == 1) out[blockIdx.x * 32 + lane] = s[lane];
    if (!fixed) __syncthreads();
}

TEST(a_write_and_a_read_by_two_warps_need_a_barrier) {
    float *out = out_buffer();
    CHECK_RACE(ULY_LAUNCH(warps_share, 1, 64, 128, 0, false, 0, out),
               ULY_LAUNCH(warps_share, 1, 64, 128, 0, true, 0, out));
}

// 32 blocks, each its own random schedule: under some, the writing warp reaches the next
// barrier before the reading warp leaves the last one.
TEST(a_barrier_orders_only_what_came_before_it) {
    float *out = out_buffer();
    CHECK_RACE(ULY_LAUNCH(warps_share, 32, 64, 128, 0, false, 3, out),
               ULY_LAUNCH(warps_share, 32, 64, 128, 0, true, 3, out));
}

// Lanes of one warp are threads too: lane 0's write and lane 1's read need a __syncwarp.
__global__ void lanes_share(bool fixed, float *out) {
    ULY_DYN_SMEM(float, s);
    if (threadIdx.x == 0) s[0] = 1.f;
    if (fixed) __syncwarp();
    if (threadIdx.x == 1) out[0] = s[0];
}

TEST(a_write_and_a_read_by_two_lanes_need_a_syncwarp) {
    float *out = out_buffer();
    CHECK_RACE(ULY_LAUNCH(lanes_share, 1, 32, 16, 0, false, out),
               ULY_LAUNCH(lanes_share, 1, 32, 16, 0, true, out));
}

// Warp 0 reads an 8 x 8 bf16 tile with ldmatrix while warp 1 starts refilling it with cp.async,
// to wait for the copy a barrier later (the double-buffering mistake: the next stage issued
// into a buffer before every warp is done with it). The copy may land any time after its issue.
__global__ void refill_while_read(bool fixed, const __nv_bfloat16 *src, float *out) {
    ULY_DYN_SMEM(__nv_bfloat16, tile);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (warp == 0 && lane < 8) uly_cp_async<16>(uly_smem_addr(tile + 8 * lane), src + 8 * lane, 16);
    uly_cp_async_wait_all();
    __syncthreads();
    if (warp == 0) {
        uint32_t r[1];
        uly_ldmatrix<1, false>(r, uly_smem_addr(tile + 8 * (lane % 8)));
        out[lane] = (float)r[0];
    }
    if (fixed) __syncthreads();
    if (warp == 1 && lane < 8) uly_cp_async<16>(uly_smem_addr(tile + 8 * lane), src + 8 * lane, 16);
    uly_cp_async_commit();
    __syncthreads();
    uly_cp_async_wait<0>();
}

// Warp 1 loads a tile with cp.async but waits for it only after the barrier that warp 0 reads
// behind: the copy may land while warp 0 reads.
__global__ void wait_after_barrier(bool fixed, const __nv_bfloat16 *src, float *out) {
    ULY_DYN_SMEM(__nv_bfloat16, tile);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (warp == 1 && lane < 8) uly_cp_async<16>(uly_smem_addr(tile + 8 * lane), src + 8 * lane, 16);
    uly_cp_async_commit();
    if (fixed) uly_cp_async_wait<0>();
    __syncthreads();
    if (!fixed) uly_cp_async_wait<0>();
    if (warp == 0) out[lane] = __bfloat162float(tile[lane]);
}

TEST(a_tile_refilled_while_ldmatrix_reads_it_is_a_race) {
    const __nv_bfloat16 *src = tile_source();
    float *out = out_buffer();
    CHECK_RACE(ULY_LAUNCH(refill_while_read, 1, 64, 128, 0, false, src, out),
               ULY_LAUNCH(refill_while_read, 1, 64, 128, 0, true, src, out));
}

TEST(a_cp_async_waited_for_after_the_barrier_is_a_race) {
    const __nv_bfloat16 *src = tile_source();
    float *out = out_buffer();
    CHECK_RACE(ULY_LAUNCH(wait_after_barrier, 1, 64, 128, 0, false, src, out),
               ULY_LAUNCH(wait_after_barrier, 1, 64, 128, 0, true, src, out));
}

// A block that fails leaves threads mid-kernel (here lanes wait in a shuffle for lane 0, which
// trapped); what they did still comes before the next block on the same shared-memory arena.
__global__ void trap_midway(float *out) {
    ULY_DYN_SMEM(float, s);
    s[threadIdx.x] = 1.f;
    if (threadIdx.x == 0) __trap();
    out[threadIdx.x] = __shfl_sync(0xffffffffu, s[threadIdx.x], 0);
}

TEST(threads_of_a_failed_block_come_before_the_next_block) {
    float *out = out_buffer();
    uly_emu_set_quiet(true);
    const int failed = reports_of(false, [&] {
        ULY_LAUNCH(trap_midway, 1, 64, 256, 0, out);
        CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "the trap did not fail the launch");
    });
    uly_emu_set_quiet(false);
    const int next =
        reports_of(false, [&] { ULY_LAUNCH(warps_share, 1, 64, 256, 0, true, 0, out); });
    CHECK(failed == 0 && next == 0, "%d reports in the failed block, %d in the next", failed, next);
}

int main() {
    const int failed = uly_run_tests();
    // TSan's closing count of reports would include the expected ones.
    __sanitizer_set_report_fd(reinterpret_cast<void *>((intptr_t)open("/dev/null", O_WRONLY)));
    return failed;
}
