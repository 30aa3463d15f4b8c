// cuda_emu.h: a CUDA execution environment for the host compiler, so the real kernel source of
// ulysses_cuda.cuh runs on the CPU (tests and debugging only; not part of the product headers).
//
// Include this FIRST, before ulysses_cuda.cuh, and link tests/emu/cuda_emu.cpp. Under nvcc it only
// includes <cuda_runtime.h>, so the same test source also builds for a real GPU.
//
// Model: every CUDA thread is a fiber; a block's fibers run on one OS thread, blocks run on a small
// pool of OS threads. __syncthreads counts arrivals; warp operations meet at a per-warp
// rendezvous; threads run in a seeded random order between those points. Divergence, deadlock,
// ldmatrix rows or cp.async destinations outside the shared memory, and a store to the
// destination of a cp.async still in flight fail the launch (cudaGetLastError) with a message
// naming the kernel, block, threads and seed; other shared accesses past it are
// AddressSanitizer's to catch. Environment: ULY_EMU_SEED (replay a
// schedule), ULY_EMU_THREADS (OS threads, 1 for gdb), ULY_EMU_STACK_KB (fiber stack size),
// ULY_EMU_ABORT=1 (abort() at the first failure, to get a backtrace of the failing fiber).
// Built with -DULY_EMU_TSAN and linked into a program built with -fsanitize=thread, it reports
// data races between CUDA threads (cuda_emu.cpp, ThreadSanitizer annotations). See the emulator
// section of README.md.
#ifndef ULY_CUDA_EMU_H
#define ULY_CUDA_EMU_H

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else

#define ULY_EMU 1

// The toolkit's own headers give the runtime API declarations, vector types, dim3, bf16 and half;
// with a host compiler they define __global__, __device__, __host__, __constant__ and
// __launch_bounds__ as nothing. cuda_emu.cpp implements this subset of the runtime, on host
// memory; each stream is a queue run by a worker thread of its own, so work named on a stream
// runs after the call (see Streams in cuda_emu.cpp):
//   memory    cudaMalloc cudaFree cudaMallocHost cudaFreeHost cudaPointerGetAttributes
//             cudaMemcpy cudaMemcpyAsync cudaMemset cudaMemsetAsync cudaMemset2DAsync
//             cudaMemcpyToSymbol cudaMemcpyFromSymbol
//   streams   cudaStreamCreate cudaStreamCreateWithFlags cudaStreamDestroy
//             cudaStreamSynchronize cudaStreamQuery cudaStreamWaitEvent
//   events    cudaEventCreate cudaEventCreateWithFlags cudaEventDestroy cudaEventRecord
//             cudaEventSynchronize cudaEventElapsedTime
//   errors    cudaGetLastError cudaPeekAtLastError cudaGetErrorString cudaGetErrorName
//   device    cudaDeviceSynchronize cudaDeviceReset cudaFuncSetAttribute cudaGetDeviceCount
//             cudaGetDevice cudaSetDevice cudaMemGetInfo cudaGetDeviceProperties
//             cudaDeviceGetAttribute
// Kernels launch through ULY_LAUNCH below, not <<<>>>.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// nvcc makes printf, malloc and assert visible to device code without includes; so do we.
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// A block's fibers share one OS thread and an OS thread runs one block at a time, so a
// thread-local static is exactly one copy per running block. Its contents carry over from the
// previous block on that OS thread (CUDA leaves shared memory uninitialized too).
#undef __shared__
#define __shared__ static thread_local

// An occupancy hint means nothing here (host_defines.h defines it for nvcc only), nor does a
// parameter read in place (GCC would warn about the unknown attribute host_defines.h gives it).
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

// ---------------------------------------------------------------------------------------------
// Builtin variables, set by the scheduler for the running fiber.

extern __thread uint3 threadIdx;
extern __thread uint3 blockIdx;
extern __thread dim3 blockDim;
extern __thread dim3 gridDim;
static constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Emulator entry points. Kernel code reaches these only through the wrappers of ulysses_cuda.cuh
// and the CUDA names below.

enum uly_emu_type { ULY_EMU_BF16, ULY_EMU_F16 };

unsigned char *uly_emu_dyn_smem();
uint32_t uly_emu_lane_id();
uint32_t uly_emu_smem_addr(const void *p);
void uly_emu_mma(uly_emu_type t, float *d, const uint32_t *a, const uint32_t *b,
                 const float *c);
void uly_emu_ldmatrix(int n, bool trans, uint32_t *r, uint32_t smem_addr);
void uly_emu_cp_async(uint32_t smem_addr, const void *src, int bytes, int src_bytes);
void uly_emu_cp_async_commit();
void uly_emu_cp_async_wait(int n);
float uly_emu_ex2(float x);
float uly_emu_atomic_add(float *p, float v);
void uly_emu_red_add2(float *p, float a, float b);

// Test hooks: the schedule seed in use, the message of the last failed launch (empty if none),
// and whether failures are printed to stderr (tests of failure detection turn printing off).
unsigned long long uly_emu_seed();
const char *uly_emu_last_failure();
void uly_emu_set_quiet(bool quiet);

// Test hook: while stalled, s runs none of its work and cudaStreamQuery(s) answers
// cudaErrorNotReady, as for a stream whose collective waits on a dead peer, and what would wait
// for the stream (cudaStreamSynchronize, a copy of pageable memory) aborts the test, where a GPU
// would hang; released, it runs what was queued. Stream 0 stands for the calling host thread's
// default stream (each rank thread of tests/emu/nccl_emu.cpp models its own GPU).
void uly_emu_stall_stream(cudaStream_t s, bool stalled);

// For the test doubles of other libraries (tests/emu/nccl_emu.cpp, cublaslt_emu.cpp): queue work
// on a stream as the runtime queues its own, or wait until what is queued on it has run (a
// stalled stream runs nothing and is not waited for).
void uly_emu_queue(cudaStream_t s, std::function<void()> work);
void uly_emu_drain(cudaStream_t s);

// Test hook: the next `calls` calls of cudaSetDevice fail (cudaErrorDevicesUnavailable, as for
// a device another process holds exclusively), whichever host threads make them.
void uly_emu_fail_set_device(int calls);

// Test hook: the calling host thread's nth next call (1: the next) of `what`, one of
// "cudaMemcpyAsync", "cudaEventRecord" and "cudaStreamWaitEvent", returns e and queues nothing,
// as a call given a bad handle or made on a broken context; what = nullptr cancels. Unlike the
// runtime, it leaves the thread's last error alone, which the emulator's copies would return.
void uly_emu_fail_call(const char *what, int nth, cudaError_t e);

// Test hook: the opt-in shared memory per block the device reports and cudaFuncSetAttribute
// accepts, as on a smaller GPU (sm_86 and sm_89: 99 KB); 0 restores the H100's 227 KB.
void uly_emu_set_smem_optin(size_t bytes);

// Test hooks: what the calling host thread asked of the device since it last called
// uly_emu_record_reset (or since it started), so a test can check that a library call queues its
// work on the caller's stream and allocates nothing. The record is per host thread, as the
// default stream is: each rank thread models its own GPU. It holds every operation CUDA orders on
// a stream, with that stream: kernel launches, cudaMemcpyAsync, cudaMemsetAsync,
// cudaMemset2DAsync, cudaEventRecord and cudaStreamWaitEvent on the stream they name; cudaMemcpy,
// cudaMemset and the symbol copies on the default stream (0), which they synchronize with; and
// what the other doubles add with uly_emu_record_op (tests/emu/nccl_emu.cpp: every NCCL call that
// names a stream). And it counts allocations: cudaMalloc and cudaMallocHost (the runtime's other
// allocators, such as cudaMallocAsync, are not emulated, so code that calls them does not link).
struct uly_emu_op {
    const char *what;     // the kernel as written at its launch, or the runtime function
    const void *kernel;   // the kernel's address, to compare with the kernel itself; else null
    cudaStream_t stream;  // 0: the default stream
    dim3 grid;            // a launch's grid; 0 x 0 x 0 for the rest
};
void uly_emu_record_reset();
std::vector<uly_emu_op> uly_emu_recorded_ops();
void uly_emu_record_op(const char *what, cudaStream_t s);
unsigned long long uly_emu_recorded_allocs();

// Cost counters for bench/bench_emu.cu: fiber switches since the process started.
unsigned long long uly_emu_switches();

// Shared-memory bank conflicts of ldmatrix since the process started: the wavefronts beyond one
// per 8 x 8 matrix (each matrix's 8 rows of 16 bytes are one wavefront when they fall in distinct
// 16-byte groups of the 32 four-byte banks; rows that share a group but not an address add one).
unsigned long long uly_emu_ldmatrix_conflicts();

#define ULY_DYN_SMEM(T, name) T *name = reinterpret_cast<T *>(uly_emu_dyn_smem())

// ---------------------------------------------------------------------------------------------
// Barriers and warp operations. The call site (file, line) names a barrier in failure reports.

void uly_emu_syncthreads(const char *file, int line);
unsigned long long uly_emu_warp(int op, unsigned mask, unsigned long long value, int b, int c,
                                const char *file, int line);

enum { ULY_EMU_SHFL_IDX, ULY_EMU_SHFL_UP, ULY_EMU_SHFL_DOWN, ULY_EMU_SHFL_BFLY, ULY_EMU_VOTE,
       ULY_EMU_SYNCWARP };

inline void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    uly_emu_syncthreads(file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
    uly_emu_warp(ULY_EMU_SYNCWARP, mask, 0, 0, 0, file, line);
}

// The PTX shfl.sync operand c: segment mask in bits 12:8, clamp in bits 4:0 (as nvcc builds it).
inline int uly__shfl_c(int width, bool up) { return ((warpSize - width) << 8) | (up ? 0 : 0x1f); }

template <typename T>
T uly__shfl(int op, unsigned mask, T var, int b, int c, const char *file, int line) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "shuffles move values of at most 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, static_cast<const void *>(&var), sizeof(T));
    bits = uly_emu_warp(op, mask, bits, b, c, file, line);
    std::memcpy(static_cast<void *>(&var), &bits, sizeof(T));
    return var;
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return uly__shfl(ULY_EMU_SHFL_IDX, mask, var, src_lane, uly__shfl_c(width, false), file, line);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return uly__shfl(ULY_EMU_SHFL_UP, mask, var, (int)delta, uly__shfl_c(width, true), file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return uly__shfl(ULY_EMU_SHFL_DOWN, mask, var, (int)delta, uly__shfl_c(width, false), file,
                     line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return uly__shfl(ULY_EMU_SHFL_BFLY, mask, var, lane_mask, uly__shfl_c(width, false), file,
                     line);
}

inline unsigned __ballot_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return (unsigned)uly_emu_warp(ULY_EMU_VOTE, mask, pred != 0, 0, 0, file, line);
}
inline int __any_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return __ballot_sync(mask, pred, file, line) != 0;
}
inline int __all_sync(unsigned mask, int pred, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return __ballot_sync(mask, pred, file, line) == mask;
}

// ---------------------------------------------------------------------------------------------
// Memory: shared-window addresses, atomics (blocks run concurrently, so these are real atomics),
// fences, read-only loads.

inline size_t __cvta_generic_to_shared(const void *p) { return uly_emu_smem_addr(p); }

template <typename T> T __ldg(const T *p) { return *p; }

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// Read-modify-write by compare-and-swap on the bits (floats included), as CUDA itself once did.
template <typename T, typename F> T uly__atomic_rmw(T *p, F f) {
    T old, want;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do want = f(old);
    while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}

inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned *p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float *p, float v) { return uly_emu_atomic_add(p, v); }
inline double atomicAdd(double *p, double v) {
    return uly__atomic_rmw(p, [v](double x) { return x + v; });
}
template <typename T> T uly__atomic_max(T *p, T v) {
    return uly__atomic_rmw(p, [v](T x) { return x < v ? v : x; });
}
template <typename T> T uly__atomic_min(T *p, T v) {
    return uly__atomic_rmw(p, [v](T x) { return v < x ? v : x; });
}
inline int atomicMax(int *p, int v) { return uly__atomic_max(p, v); }
inline int atomicMin(int *p, int v) { return uly__atomic_min(p, v); }
inline unsigned atomicMax(unsigned *p, unsigned v) { return uly__atomic_max(p, v); }
inline unsigned atomicMin(unsigned *p, unsigned v) { return uly__atomic_min(p, v); }
inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned *p, unsigned v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
inline int atomicCAS(int *p, int expected, int v) {
    __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expected;
}
inline unsigned atomicCAS(unsigned *p, unsigned expected, unsigned v) {
    __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expected;
}

// ---------------------------------------------------------------------------------------------
// Math intrinsics without a libm twin (expf, exp2f, fmaxf, ... come from <cmath>).

inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}

// CUDA's min/max accept mixed argument types (int and unsigned, float and int, ...).
template <typename A, typename B> constexpr std::common_type_t<A, B> min(A a, B b) {
    return b < a ? b : a;
}
template <typename A, typename B> constexpr std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

void __trap();

// ---------------------------------------------------------------------------------------------
// The C++ overloads that cuda_runtime.h declares for nvcc only: kernels and symbols by name.

template <typename T>
cudaError_t cudaFuncSetAttribute(T *kernel, cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute(reinterpret_cast<const void *>(kernel), attr, value);
}
template <typename T>
cudaError_t cudaMemcpyToSymbol(const T &symbol, const void *src, size_t count, size_t offset = 0,
                               cudaMemcpyKind kind = cudaMemcpyHostToDevice) {
    return cudaMemcpyToSymbol(static_cast<const void *>(&symbol), src, count, offset, kind);
}
template <typename T>
cudaError_t cudaMemcpyFromSymbol(void *dst, const T &symbol, size_t count, size_t offset = 0,
                                 cudaMemcpyKind kind = cudaMemcpyDeviceToHost) {
    return cudaMemcpyFromSymbol(dst, static_cast<const void *>(&symbol), count, offset, kind);
}

// ---------------------------------------------------------------------------------------------
// Kernel launch. ULY_LAUNCH(kernel, grid, block, smem_bytes, stream, args...) converts the
// arguments to the kernel's parameter types once on the host, like <<<>>>, checks the launch
// configuration (an error of cudaGetLastError at once), and queues the grid on the stream: it
// runs later, on the stream's worker thread, and its failures surface at the next synchronizing
// call. Wrap a template kernel in parentheses: ULY_LAUNCH((attn<64, true>), ...).

struct uly_emu_grid {
    const char *name;       // the kernel as written at the launch, for failure reports
    const void *fn;         // the kernel's address, the key of cudaFuncSetAttribute
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    std::function<void()> call;  // the kernel with the launch's arguments, held by value
};

void uly_emu_launch(const uly_emu_grid &g);

template <typename... P> struct uly__launcher {
    uly_emu_grid g;
    void (*kernel)(P...);

    template <typename... A> void operator()(A &&...a) {
        static_assert(sizeof...(A) == sizeof...(P), "wrong number of kernel arguments");
        std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
        g.call = [k = kernel, args = std::move(args)] { std::apply(k, args); };
        uly_emu_launch(g);
    }
};

template <typename... P>
uly__launcher<P...> uly__launch(void (*kernel)(P...), const char *name, dim3 grid, dim3 block,
                                size_t smem, cudaStream_t stream) {
    return {{name, reinterpret_cast<const void *>(kernel), grid, block, smem, stream, {}},
            kernel};
}

#define ULY_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)                                  \
    uly__launch(kernel, #kernel, grid, block, smem_bytes, stream)(__VA_ARGS__)

#endif  // __CUDACC__
#endif  // ULY_CUDA_EMU_H
