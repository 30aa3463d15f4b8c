// cuda_ptx.cuh: the portability layer of ulysses_cuda.cuh. Every PTX instruction the kernels use
// sits in one small uly_ wrapper: inline asm for the GPU, or the CUDA host emulator's function
// when ULY_EMU is defined (tests/emu/cuda_emu.h), so the same kernel source runs in CI on a CPU.
// Kernels launch through ULY_LAUNCH and get dynamic shared memory through ULY_DYN_SMEM, which
// the emulator defines first.
#ifndef ULY_CUDA_PTX_CUH
#define ULY_CUDA_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>

#ifndef ULY_LAUNCH
#define ULY_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)                                  \
    kernel<<<grid, block, smem_bytes, stream>>>(__VA_ARGS__)
#endif

// Dynamic shared memory, 128-byte aligned (swizzled tiles and cp.async need at least 16).
#ifndef ULY_DYN_SMEM
#define ULY_DYN_SMEM(T, name)                                                                      \
    extern __shared__ __align__(128) unsigned char uly__dyn_smem[];                               \
    T *name = reinterpret_cast<T *>(uly__dyn_smem)
#endif

// %laneid: the thread's lane in its warp.
static __device__ __forceinline__ uint32_t uly_lane_id() {
#ifdef ULY_EMU
    return uly_emu_lane_id();
#else
    uint32_t lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
#endif
}

// The 32-bit shared-window address of a pointer into shared memory (ldmatrix, cp.async).
static __device__ __forceinline__ uint32_t uly_smem_addr(const void *p) {
#ifdef ULY_EMU
    return uly_emu_smem_addr(p);
#else
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

// mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32: D = A*B + C for one warp, T = bf16 or half,
// fragments as in the PTX ISA. d may alias c.
template <typename T>
static __device__ __forceinline__ void uly_mma_m16n8k16(float d[4], const uint32_t a[4],
                                                        const uint32_t b[2], const float c[4]) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "mma operands are bf16 or half");
#ifdef ULY_EMU
    uly_emu_mma(16, std::is_same<T, __half>::value ? ULY_EMU_F16 : ULY_EMU_BF16, d, a, b, c);
#else
    if constexpr (std::is_same<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
#endif
}

// mma.sync.aligned.m16n8k8.row.col.f32.T.T.f32. d may alias c.
template <typename T>
static __device__ __forceinline__ void uly_mma_m16n8k8(float d[4], const uint32_t a[2],
                                                       const uint32_t b[1], const float c[4]) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "mma operands are bf16 or half");
#ifdef ULY_EMU
    uly_emu_mma(8, std::is_same<T, __half>::value ? ULY_EMU_F16 : ULY_EMU_BF16, d, a, b, c);
#else
    if constexpr (std::is_same<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b[0]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b[0]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
#endif
}

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: N 8x8 matrices of 16-bit elements; lane
// 8*i + r passes the address of row r of matrix i (16 bytes, 16-byte aligned).
template <int N, bool TRANS>
static __device__ __forceinline__ void uly_ldmatrix(uint32_t r[N], uint32_t smem_addr) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
#ifdef ULY_EMU
    uly_emu_ldmatrix(N, TRANS, r, smem_addr);
#else
    if constexpr (N == 1 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                     : "=r"(r[0]) : "r"(smem_addr) : "memory");
    else if constexpr (N == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                     : "=r"(r[0]) : "r"(smem_addr) : "memory");
    else if constexpr (N == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr) : "memory");
    else if constexpr (N == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr) : "memory");
    else if constexpr (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr)
                     : "memory");
#endif
}

// cp.async.{ca,cg}.shared.global of BYTES (4, 8 or 16; .cg, which bypasses L1, for 16): copies
// src_bytes from global memory and zero-fills the rest (src_bytes = 0: a pure zero fill).
template <int BYTES>
static __device__ __forceinline__ void uly_cp_async(uint32_t smem_addr, const void *gmem,
                                                    int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#ifdef ULY_EMU
    uly_emu_cp_async(smem_addr, gmem, BYTES, src_bytes);
#else
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr), "l"(gmem), "r"(src_bytes) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                     :: "r"(smem_addr), "l"(gmem), "n"(BYTES), "r"(src_bytes) : "memory");
#endif
}

// Closes the group of cp.async issued since the last commit.
static __device__ __forceinline__ void uly_cp_async_commit() {
#ifdef ULY_EMU
    uly_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are pending.
template <int N>
static __device__ __forceinline__ void uly_cp_async_wait() {
#ifdef ULY_EMU
    uly_emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// Waits for all of this thread's cp.async, committed or not.
static __device__ __forceinline__ void uly_cp_async_wait_all() {
#ifdef ULY_EMU
    uly_emu_cp_async_commit();
    uly_emu_cp_async_wait(0);
#else
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

#endif  // ULY_CUDA_PTX_CUH
