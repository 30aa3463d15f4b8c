/* ulysses_cuda.cuh - the GPU side of ulysses: layout kernels, the device-local and NCCL
   communicators, FlashAttention-compatible attention kernels. MIT license, see the end.

   It runs ulysses.h's layer on GPUs. The driver (uly_forward, uly_backward) only calls the
   layer's layout, communicator and attention, so on the GPU the same driver runs with
       L.layout = uly_cuda_layout()           pack/unpack kernels on (cudaStream_t)L.stream
       L.comm   = a device communicator       device-local (P ranks on one GPU) or NCCL
       L.attn   = uly_flash_attention()       or uly_cuda_reference_attention() to check it
   which uly_cuda_layer() fills in: the SP layer uses the flash kernels by default. L.workspace,
   `saved` and every tensor are GPU memory. Nothing here allocates: pack, unpack, alltoallv and
   the attention queue work on the stream, and every call returns a uly_status.

   Like ulysses.h it is stb-style: declarations here, the implementation behind
   ULYSSES_IMPLEMENTATION in exactly one .cu file (or, with ULYSSES_STATIC, a private copy in
   each file that defines both), which also makes ulysses.h's:

       #include <nccl.h>
       #define ULYSSES_NCCL
       #define ULYSSES_IMPLEMENTATION
       #include "ulysses_cuda.cuh"

   USAGE: one SP attention layer, one GPU per rank (examples/sp_attention_nccl.cu in full)

       ncclComm_t world, sp, dp;                 // world from ncclCommInitRank, MPI bootstrap
       uly_nccl_split(world, P, 0, &sp, &dp);    // SP: P consecutive ranks; DP: across groups
       uly_nccl nccl = {sp, scratch, 60, stream}; // ULY_NCCL_SCRATCH GPU doubles; 60 s limit
       uly_comm comm;
       uly_nccl_comm(&nccl, &comm);
       uly_plan_desc desc = {world_size, rank, P, B, S, H, Hkv, D, ULY_BF16, 0};
       uly_plan plan;
       uly_status st = uly_plan_init(&plan, &desc);
       uly_layer L = uly_cuda_layer(&plan, &comm, stream);
       L.causal = 1;
       L.workspace_bytes = uly_layer_workspace(&L);
       cudaMalloc(&L.workspace, L.workspace_bytes);
       st = uly_layer_agree(&L);                 // once: every rank planned the same layer
       int64_t nsaved = uly_saved_bytes(&plan);
       cudaMalloc(&saved, nsaved);
       uly_qkv_views(d_qkv, ULY_BF16, B, S_r, H, Hkv, D, &q, &k, &v);  // llm.c's fused QKV
       st = uly_forward(&L, q, k, v, out, saved, nsaved);
       st = uly_backward(&L, dout, saved, nsaved, dq, dk, dv);

   WHAT IS HERE
       Layout kernels: every exchange is one launch of one kernel, a strided box copy. bf16,
       fp16, fp32; 16-, 8- or 4-byte accesses, the widest the tensor's address, strides and
       rows allow, element accesses otherwise; int64 indexing. A kv head that several ranks
       received comes back as several gradient copies, which the DKV unpack sums in fp32 in
       peer order, rounding once.

       Communicators (uly_comm with device = 1: buffers are GPU memory, work on the given stream):
           uly_cuda_local_run   P virtual ranks on the current GPU, as threads (tests, benchmarks)
           uly_nccl_comm        NCCL (ULYSSES_NCCL): alltoallv as grouped ncclSend/ncclRecv;
                                alltoall, which the layer calls where every block of every rank
                                has one size, as ncclAlltoAll (NCCL >= 2.28)
           uly_nccl_split       SP and DP communicators from a world one (ncclCommSplit)
           uly_nccl_wait        waits for a stream while watching NCCL's asynchronous errors

       Attention: uly_flash_attention() is a uly_attn (the contract of ulysses.h): bf16 and fp16,
       head dims 64 and 128, fp32 accumulation, causal (bottom-right) or not, GQA/MQA with groups
       split across SP ranks (q_head0, kv_group), Sq != Sk, any lengths up to 2^30 rows (grids
       past CUDA's 65535 blocks run in slices), strided q/k/v/o (last dim contiguous, rows
       16-byte aligned), lse fp32 [B, H, Sq]. Fully masked rows give 0 and lse = +inf, never
       NaN; a deterministic mode.
       The softmax runs in log2 units, as FlashAttention's: softmax_scale >= 0, and scaled
       logits (q.k x scale) within FLT_MAX / log2(e), about 2.4e38, in magnitude.
       uly_flash_varlen_* run packed documents (cu_seqlens), and uly_flash_varlen_attention()
       runs them through the SP layer. uly_cublaslt_attention()
       (ULYSSES_CUBLASLT) is the unfused cuBLASLt path: the GPU-side second reference, and the
       fallback for any D <= 256, D % 8 == 0.

       The flash kernels (sm_80 and newer: mma.sync m16n8k16, ldmatrix, cp.async; the D = 128
       backward needs 161 KB of shared memory per block, which A100 and H100 have and sm_86 and
       sm_89 do not: there it is ULY_EUNSUPPORTED) are built from a few tile primitives, so each
       reads like its algorithm:
           uly__tile_load / uly__tile_store    global <-> swizzled shared tile, 16-byte chunks
                                               (the load by cp.async)
           uly__mma_ss / uly__mma_rs           a warp's C += A * B, A from shared memory or
                                               registers; uly__mma_ss_n: products of one shape
                                               at once, on the same fragment addresses
           uly__online_softmax                 FlashAttention's running max and sum, exp2 domain
           uly__softmax_grad                   P = exp(scale * s - lse), dS = P * (dP - Dsum)
       Forward: a block owns BM query rows and streams the key blocks (last first, so only the
       first iterations need the mask); the loads of K and V each overlap the other's GEMM.
       Backward: a pre-pass computes Dsum = rowsum(dout * out) and clears the fp32 dQ
       accumulator; the main kernel owns BN keys of one kv head, loops over the query blocks of
       every query head of its GQA group (so dK and dV are summed in registers, in a fixed order)
       and adds dQ into the fp32 accumulator with atomics, spread over the k-steps of its dK and
       dV products; a post-pass scales and converts dQ.
       Deterministic mode replaces the atomics with a second kernel that owns BM query rows and
       recomputes P and dS to sum dQ over the key blocks in order: identical bits run to run,
       about 1.4x the backward's FLOPs. Tile sizes live in one traits table per head dim
       (uly__fa_traits).

   OPTIONS (define before including)
       ULYSSES_NCCL       the NCCL communicator (include <nccl.h> first; link -lnccl)
       ULY_NCCL_ALLTOALL  1 (the default from NCCL 2.28): alltoall is ncclAlltoAll; 0: the layer
                          sends every exchange through ncclSend/ncclRecv, as before 2.28
       ULYSSES_CUBLASLT   the cuBLASLt attention (include <cublasLt.h> first; link -lcublasLt)
   Needs CUDA 12.1 or newer (the layout kernel takes its per-peer tables as a large parameter).

   KERNEL RULES, so that the project's CUDA host emulator (tests/emu) runs this same source on a
   CPU in CI: launches only through ULY_LAUNCH, dynamic shared memory only through ULY_DYN_SMEM,
   every PTX instruction in one uly_ wrapper (asm on the GPU, the emulator's function under
   ULY_EMU), no device globals beyond __constant__ tables. */
#ifndef ULYSSES_CUDA_CUH
#define ULYSSES_CUDA_CUH

#include "ulysses.h"

#if defined(CUDART_VERSION) && CUDART_VERSION < 12010
#error "ulysses_cuda.cuh needs CUDA 12.1 or newer: the layout kernel's parameter is about 7 KB"
#endif

/* ---------------------------------------------------------------------------------------------
   Declarations */

#ifdef __cplusplus
extern "C" {
#endif

/* Pack and unpack kernels, launched on the stream argument (a cudaStream_t). The tensor's and
   the exchange buffer's addresses must be multiples of the element size. Accesses are 16 bytes
   where both addresses, the strides and the rows (D * element size) are multiples of 16, else
   8 or 4 bytes where those are, else one element; the stride of a dim of extent 1 does not
   count. ctx is unused. */
ULYDEF uly_layout uly_cuda_layout(void);

/* Runs fn(comm, user) on `size` threads, one per virtual rank of an SP group on the calling
   thread's GPU, and waits for all of them. Each rank works on its own stream (the stream
   argument of each call); alltoallv copies device to device between the ranks' buffers, ordered
   by events, so the streams of different ranks run concurrently. allreduce_sum takes GPU or
   host memory (read once the stream is done) and synchronizes the stream. In both, counts that
   differ between ranks (or allreduce_sum's memory: host on some, GPU on others), or a rank that
   fails, fail every rank alike (ULY_ECOMM on its peers).
   barrier meets the host threads. Each thread makes the caller's GPU current; if that fails on
   any, fn runs on none and the failing rank's error is returned. */
ULYDEF uly_status uly_cuda_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                     void *user);

/* A plain attention for tests: one thread per query row (forward, dQ) or key row (dK, dV),
   fp32 accumulation, any dtype, head dims up to 256, the whole uly_attn contract. Always
   deterministic. The backward's workspace holds Dsum, fp32 [B, H, Sq]. ctx is unused. */
ULYDEF uly_attn uly_cuda_reference_attention(void);

#ifdef ULYSSES_NCCL
/* An NCCL communicator over `comm` (one SP group, one GPU per rank; NCCL 2.18 or newer); it
   keeps a pointer to n, which must outlive it.
   NCCL moves GPU memory only, so allreduce_sum of host memory (uly_loss_reduce's) and barrier
   go through `scratch`, ULY_NCCL_SCRATCH doubles of device memory the caller provides (NULL:
   they return ULY_EUNSUPPORTED), in chunks, and wait for the stream as uly_nccl_wait does; so
   every rank must give allreduce_sum the same kind of memory (NCCL cannot check). Calls given no
   stream (barrier, uly_loss_reduce's allreduce_sum) use `stream`, a stream of comm's device
   the caller makes (uly_nccl_comm refuses NULL): cudaStreamPerThread would be another stream
   to a non-blocking communicator, whose work NCCL's own thread may launch (so never give it to
   a layer over one either), and the legacy stream would also wait for every other blocking
   stream, another communicator's collectives among them, which can tie two communicators into
   a deadlock. Those waits mean barrier, allreduce_sum and uly_loss_reduce never go inside the
   caller's ncclGroupStart/ncclGroupEnd, where NCCL queues nothing until ncclGroupEnd; nor do
   uly_forward and uly_backward, whose kernels after an exchange would be queued before it.
   Failures return ULY_ECOMM with NCCL's message, and NCCL's last error, which may be an earlier
   call's (NCCL keeps one for the process). After any failure (a call NCCL refused, a peer or the
   network gone) or a timeout, treat the communicator as unusable and its peers as maybe stuck in
   the collective: every live rank must ncclCommAbort it (NCCL requires all of them to; it also
   lets a stuck stream drain). Nothing here aborts or destroys a communicator.
   comm may be blocking (NCCL's default config) or non-blocking (ncclConfig_t.blocking = 0).
   A blocking NCCL call can itself hold the thread when a peer never arrives (the first exchange
   with a peer connects to it), where no timeout reaches. A non-blocking one answers
   ncclInProgress, and each call here polls until NCCL has queued the work, so that a missing
   peer is ULY_ECOMM. Queued work that never ends (a peer gone after connecting) is another
   wait: the layer's calls return with it queued, and only a wait that polls NCCL (uly_nccl_wait,
   and barrier's and allreduce_sum's of host memory) turns it into ULY_ECOMM, where a
   cudaStreamSynchronize would hang. Each such wait, and each poll of a call in progress, gives
   up after timeout_s seconds (0: no limit), so one call that waits several times can take a
   few times that. */
enum { ULY_NCCL_SCRATCH = 64 };
typedef struct uly_nccl {
    ncclComm_t comm;
    double *scratch;
    double timeout_s;
    void *stream; /* cudaStream_t of the calls given none */
} uly_nccl;
ULYDEF uly_status uly_nccl_comm(uly_nccl *n, uly_comm *out);
/* Splits world into SP groups of sp_size consecutive ranks and DP groups across them (a
   collective over world, which must have no NCCL work outstanding), waiting at most timeout_s
   seconds (0: no limit) for a non-blocking world's init and for each split. On failure the
   caller aborts world first, then whichever of *sp and *dp is not NULL (NCCL's order: peers may
   still be inside the failed split, where a destroy here could wait for them forever, and
   after a non-blocking split timed out, NCCL's thread may store the new communicator there
   until world's abort stops it). */
ULYDEF uly_status uly_nccl_split(ncclComm_t world, int sp_size, double timeout_s, ncclComm_t *sp,
                                 ncclComm_t *dp);
/* Waits until the work queued on stream is done (on a non-blocking comm, also until NCCL has
   queued the work of a call that answered ncclInProgress), polling NCCL for an asynchronous
   error (a peer that died, a network failure). On such an error, or after timeout_s seconds
   (0: no limit), it returns ULY_ECOMM: never a silent hang on queued work. Then comm is
   unusable; every live rank must abort it. */
ULYDEF uly_status uly_nccl_wait(ncclComm_t comm, void *stream, double timeout_s);
#endif

/* The SP layer on the GPU with this file's defaults: uly_cuda_layout() and
   uly_flash_attention(); the caller sets causal, softmax_scale and the workspace. */
ULYDEF uly_layer uly_cuda_layer(const uly_plan *plan, const uly_comm *comm, void *stream);

/* Packed variable-length documents (FlashAttention's varlen): the documents of a batch are
   concatenated along the sequence. q and o are [1, total_q, H, D], k and v [1, total_k, Hkv, D]
   (same rules as the dense contract), lse fp32 [H, total_q]. Document b owns query rows
   [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b+1]);
   attention, and the bottom-right causal mask, stay inside a document. A cu_seqlens that breaks
   the rules below, or a document longer than max_seqlen, stops the call's first kernel with a
   message, as a device-side assert does: the next sync returns a launch failure and the CUDA
   context is lost, but no memory out of bounds is touched and no row is left unwritten. */
typedef struct uly_varlen {
    const int32_t *cu_seqlens_q; /* device memory, [batch + 1]: from 0 to total_q, nondecreasing */
    const int32_t *cu_seqlens_k; /* device memory, [batch + 1]: from 0 to total_k, nondecreasing */
    int64_t batch;
    int64_t max_seqlen_q;        /* the longest document's query and key counts (grid size) */
    int64_t max_seqlen_k;
} uly_varlen;

/* The flash kernels as a uly_attn. ctx is unused. The backward's workspace holds Dsum and, unless
   deterministic, the fp32 dQ accumulator; the forward needs none.
   Non-finite inputs: a tile's products multiply the zero probabilities of masked keys into V
   (and P, dS into dout, K), and 0 * Inf is NaN, so an Inf or NaN in k or v at a key some rows
   of its tile mask, or in dout at a row with no key kept, can reach rows that never see it, as
   in FlashAttention and the cuBLASLt attention. The reference attentions (ulysses.h's CPU one
   and uly_cuda_reference_attention) skip masked keys. With finite inputs masking makes no NaN
   or Inf (a result past the dtype's range, fp16's 65504, still overflows, as in any attention). */
ULYDEF uly_attn uly_flash_attention(void);

/* Varlen: args as for the dense calls, with q.b == k.b == 1 and the documents taken from v.
   The workspace is the dense query's: uly_flash_attention().workspace(NULL, a). */
ULYDEF uly_status uly_flash_varlen_fwd(const uly_attn_args *a, const uly_varlen *v);
ULYDEF uly_status uly_flash_varlen_bwd(const uly_attn_args *a, const uly_varlen *v);

/* The same as a uly_attn (ctx is v, which must outlive it and stay unchanged from a forward to
   its backward): packed documents through the SP layer. The layer attends over the full
   sequence, so v describes the documents of the whole [1, S] sample, the same on every SP rank
   (batch: the documents; max_seqlen_q = max_seqlen_k: the longest), and a document may cross
   any shard boundary. The plan's batch must be 1. */
ULYDEF uly_attn uly_flash_varlen_attention(const uly_varlen *v);

#ifdef ULYSSES_CUBLASLT
/* The unfused attention on cuBLASLt (include <cublasLt.h> first, link -lcublasLt): S = Q K^T and
   O = P V as batched GEMMs over each GQA group, a masked softmax kernel between them, and the
   backward the same way (dP = dO V^T, dS = scale P (dP - Dsum), dQ = dS K, dK and dV summed
   over the group in fp32; the flash kernels apply the scale to dQ and dK at the end instead).
   Every intermediate is materialized ([group, Sq, Sk] per kv head at a time): S and dP in fp32,
   P and dS rounded to the dtype as a plain attention's GEMM operands are. The GPU-side second
   reference for the flash kernels, and the fallback for head dims they do not cover (any
   D <= 256, D % 8 == 0; bf16 and fp16; dense or strided; the backward's o and dout rows
   16-byte aligned, as the flash kernels' Dsum pass, which it shares, needs). Deterministic.
   ctx is the handle, which cuBLASLt ties to the device current when it was created: call with
   that device current. A product no cuBLASLt kernel runs at its operands' alignment is
   ULY_EUNSUPPORTED. Each GEMM asks cuBLASLt's heuristic for its algorithm anew (nothing is
   kept between calls): host time, which shows where the GEMMs are small (short sequences). */
ULYDEF uly_attn uly_cublaslt_attention(cublasLtHandle_t handle);
#endif

#ifdef __cplusplus
}
#endif

/* ---------------------------------------------------------------------------------------------
   PTX primitives. Every PTX instruction the kernels use sits in one small uly_ wrapper: inline
   asm for the GPU, or the CUDA host emulator's function when ULY_EMU is defined
   (tests/emu/cuda_emu.h). Kernels launch through ULY_LAUNCH and get dynamic shared memory through
   ULY_DYN_SMEM, which the emulator defines first. */

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
    uly_emu_mma(std::is_same<T, __half>::value ? ULY_EMU_F16 : ULY_EMU_BF16, d, a, b, c);
#else
    // The instruction names its operand type; one asm statement per shape, the type spliced in.
#define ULY__MMA_16816(ty)                                                                        \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 "                       \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                     \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),             \
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]))
    if constexpr (std::is_same<T, __half>::value) ULY__MMA_16816("f16");
    else ULY__MMA_16816("bf16");
#undef ULY__MMA_16816
#endif
}

// ex2.approx.ftz.f32: 2^x to about 2 ulp, subnormal inputs flushed to +-0 and subnormal
// results to +0 (as is 2^-inf). The softmax's exponential: exp2f spends a range test and two
// multiplies per call on subnormal results, and a probability under 2^-126 adds nothing to a
// bf16/fp16 product.
static __device__ __forceinline__ float uly_ex2(float x) {
#ifdef ULY_EMU
    return uly_emu_ex2(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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

// If on: *p += a, p[1] += b, each atomically: one red.global.add.v2.f32 from sm_90 (half the
// instructions of two scalar adds), two atomicAdd before it. p is global and 8-byte aligned,
// which sm_90 requires and the emulator checks. Nothing in the kernel reads p back, so no
// memory clobber. Off, nothing is read or written. The predicate is the asm's, not a C++ branch:
// around those nvcc rebuilt the address registers that pending reds still had to read, and the
// warp stalled until they had. (ptxas still puts a branch around each red: bench/RESULTS.md.)
static __device__ __forceinline__ void uly_red_add2(float *p, float a, float b, bool on = true) {
#ifdef ULY_EMU
    if (on) uly_emu_red_add2(p, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred on;\n\tsetp.ne.b32 on, %3, 0;\n\t"
                 "@on red.global.add.v2.f32 [%0], {%1, %2};\n\t}"
                 :: "l"(p), "f"(a), "f"(b), "r"((int)on));
#else
    if (on) atomicAdd(p, a), atomicAdd(p + 1, b);
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

#endif /* ULYSSES_CUDA_CUH */

/* ---------------------------------------------------------------------------------------------
   Implementation */

#if defined(ULYSSES_IMPLEMENTATION) && !defined(ULYSSES_CUDA_IMPLEMENTED)
#define ULYSSES_CUDA_IMPLEMENTED
#ifdef __GNUC__
#pragma GCC diagnostic push
/* Under ULYSSES_STATIC a program calls only some of the functions. */
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

/* Element conversions: values travel as T, sums happen in fp32 and round once. */
static __device__ __forceinline__ float uly__widen(float x) { return x; }
static __device__ __forceinline__ float uly__widen(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float uly__widen(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T uly__round(float x);
template <> __device__ __forceinline__ float uly__round<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 uly__round<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half uly__round<__half>(float x) {
    return __float2half_rn(x);
}

/* Calls f(T()) with the element type of t. */
template <typename F> static uly_status uly__by_dtype(uly_dtype t, F f) {
    switch (t) {
    case ULY_BF16: return f(__nv_bfloat16());
    case ULY_F16: return f(__half());
    default: return f(0.0f);
    }
}

/* Row (b, s, h) of t: its d elements. */
template <typename T>
__host__ __device__ __forceinline__ T *uly__row(const uly_tensor &t, int64_t b, int64_t s,
                                                int64_t h) {
    return (T *)t.data + b * t.sb + s * t.ss + h * t.sh;
}

/* GQA over a rank's share of the heads: local query head h (global q_head0 + h) reads kv head
   (q_head0 + h) / g, local index counted from the rank's first (ulysses.h's uly__kv_of). */
__host__ __device__ __forceinline__ int64_t uly__kv_head(int64_t q_head0, int64_t g, int64_t h) {
    return (q_head0 + h) / g - q_head0 / g;
}

/* The inverse: the local query heads [first, end) of the nh held that read local kv head hk. */
struct uly__head_span {
    int64_t first, end;
};
__host__ __device__ __forceinline__ uly__head_span uly__q_heads(int64_t q_head0, int64_t g,
                                                                int64_t hk, int64_t nh) {
    const int64_t g0 = q_head0 / g;
    uly__head_span r;
    r.first = max((int64_t)0, (hk + g0) * g - q_head0);
    r.end = min(nh, (hk + g0 + 1) * g - q_head0);
    return r;
}

/* The error of the last launch, or of a CUDA call. */
static uly_status uly__cuda(cudaError_t e, const char *what) {
    ULY__CHECK(e == cudaSuccess, ULY_ECUDA, "%s: %s (%s)", what, cudaGetErrorString(e),
               cudaGetErrorName(e));
    return uly__ok();
}

/* ---------------------------------------------------------------------------------------------
   Layout kernels

   An exchange moves P boxes between a strided tensor t and the P dense blocks of an exchange
   buffer: box j is the part of t that goes to or comes from peer j, [B, tokens, heads, D], and
   block j holds it densely at element offset off[j]. On the sequence-layout side (pack Q and
   KV, unpack O and DKV) the boxes split the heads and share this rank's tokens; on the
   head-layout side they split the tokens and share this rank's heads. Head ranges are sorted
   and may overlap (a kv head several ranks need): the first box that holds such a head handles
   it for all of them, a pack reading it once and writing every copy, an unpack writing the sum
   of the copies once. */

/* A grid of at most 2048 blocks of 256 threads (about two waves on an H100) strides over the
   boxes: big enough to keep every SM's memory pipes full, small enough to need no tail. */
enum { ULY__COPY_THREADS = 256, ULY__COPY_BLOCKS = 2048 };

/* The kernel's parameters, by value: the per-peer tables make them about 7 KB, which CUDA
   allows since 12.1 (32 KB; 4 KB before), and they sit in constant memory, read by index in
   place (__grid_constant__: no thread copies them to its stack to take an element's address). */
struct uly__boxes {
    void *t, *buf;
    int64_t sb, ss, sh;        /* t's strides, elements */
    int64_t batch, width, dim; /* B, the extent of the dim all boxes share, D */
    int n;                     /* boxes, one per peer */
    int by_heads;              /* the boxes split heads (else tokens) */
    int shared;                /* some head is in two boxes (kv heads several ranks need) */
    int merge;                 /* a row is all of a box's heads at one token: t's heads are
                                  adjacent (sh == D) and no two boxes share a head */
    int64_t start[ULY_MAX_SP], count[ULY_MAX_SP], off[ULY_MAX_SP]; /* split ranges, offsets */
    int cols;                  /* grid columns: the boxes with something to write, */
    int box[ULY_MAX_SP];       /* box[c] being column c's */
};

/* The first of box j's heads that it handles, counted from its start: where the boxes share
   heads, those it shares with the previous box are that box's. */
__host__ __device__ __forceinline__ int64_t uly__box_first(const uly__boxes &x, int j) {
    const int64_t prev_end = j > 0 ? x.start[j - 1] + x.count[j - 1] : 0;
    return x.shared && prev_end > x.start[j] ? prev_end - x.start[j] : 0;
}

template <typename T, int W> struct alignas(sizeof(T) * W) uly__vec {
    T e[W];
};

/* Block m's copy of head h at (b, s), from element e of the row: W values. The boxes split
   the heads and share the tokens. */
template <typename T, int W>
__device__ __forceinline__ uly__vec<T, W> *uly__copy_at(const uly__boxes &x, int m, int64_t b,
                                                        int64_t s, int64_t h, int64_t e) {
    const int64_t row = (b * x.width + s) * x.count[m] + h - x.start[m];
    return (uly__vec<T, W> *)((T *)x.buf + x.off[m] + row * x.dim + e);
}

/* The end of the boxes j, j + 1, ... that hold head h, box j being one: ranges are sorted,
   so a later box holds h when it starts at or before it. */
__device__ __forceinline__ int uly__holders_end(const uly__boxes &x, int j, int64_t h) {
    int k = j + 1;
    while (k < x.n && x.start[k] <= h) k++;
    return k;
}

/* The sum of the copies of head h held by boxes j..k-1, k >= j + 2, at (b, s), element e of
   the row: fp32 in box order, one rounding. The first two copies are loaded before either is
   used, so that their latencies overlap: the loop's loads wait for each other. */
template <typename T, int W>
__device__ __forceinline__ uly__vec<T, W> uly__sum_copies(const uly__boxes &x, int j, int k,
                                                          int64_t b, int64_t s, int64_t h,
                                                          int64_t e) {
    uly__vec<T, W> v = *uly__copy_at<T, W>(x, j, b, s, h, e);
    const uly__vec<T, W> second = *uly__copy_at<T, W>(x, j + 1, b, s, h, e);
    float acc[W];
#pragma unroll
    for (int w = 0; w < W; w++) acc[w] = uly__widen(v.e[w]) + uly__widen(second.e[w]);
    for (int m = j + 2; m < k; m++) {
        v = *uly__copy_at<T, W>(x, m, b, s, h, e);
#pragma unroll
        for (int w = 0; w < W; w++) acc[w] += uly__widen(v.e[w]);
    }
#pragma unroll
    for (int w = 0; w < W; w++) v.e[w] = uly__round<T>(acc[w]);
    return v;
}

/* A flat access index of a box as its digits: element e (in accesses) of row r of token s of
   batch b, the box being [batch][nt][rows][nv]. A thread divides once, for its first index and
   for the grid's stride, then adds digit by digit: a 64-bit division per access costs more
   instructions than the access can hide. */
struct uly__pos {
    int64_t e, r, s, b;
};

__device__ __forceinline__ uly__pos uly__pos_of(int64_t i, int64_t nv, int64_t rows, int64_t nt) {
    uly__pos p;
    p.e = i % nv, i /= nv;
    p.r = i % rows, i /= rows;
    p.s = i % nt, p.b = i / nt;
    return p;
}

/* p += d, both with every digit below its radix (b aside), so each digit carries at most once. */
__device__ __forceinline__ void uly__pos_add(uly__pos &p, const uly__pos &d, int64_t nv,
                                             int64_t rows, int64_t nt) {
    p.e += d.e;
    const int ce = p.e >= nv;
    p.e -= ce ? nv : 0;
    p.r += d.r + ce;
    const int cr = p.r >= rows;
    p.r -= cr ? rows : 0;
    p.s += d.s + cr;
    const int cs = p.s >= nt;
    p.s -= cs ? nt : 0;
    p.b += d.b + cs;
}

/* What a launch does: t to the blocks, the blocks to t, or, where several boxes hold a head
   (kv heads several ranks need), t to every block holding it (the KV pack) or the sum of those
   blocks' copies to t (the DKV unpack). A template parameter, so the plain copies carry none of
   the shared heads' registers: 32 a thread, for full occupancy; the fan-out takes 40-48 (5
   blocks an SM) and the sum 60-64 (4). */
enum uly__copy_mode { ULY__PACK, ULY__UNPACK, ULY__PACK_FAN, ULY__UNPACK_SUM };

template <int MODE> constexpr int uly__copy_blocks_per_sm() {
    return MODE == ULY__PACK_FAN ? 5 : MODE == ULY__UNPACK_SUM ? 4 : 8;
}

/* Grid (blocks, columns): the blocks of column c stride over box x.box[c], W elements an
   access. */
template <typename T, int W, int MODE>
__global__ void __launch_bounds__(ULY__COPY_THREADS, uly__copy_blocks_per_sm<MODE>())
    uly__box_copy(const __grid_constant__ uly__boxes x) {
    typedef uly__vec<T, W> V;
    const int j = x.box[blockIdx.y]; /* not empty, and with heads of its own */
    const int64_t t0 = x.by_heads ? 0 : x.start[j], nt = x.by_heads ? x.width : x.count[j];
    const int64_t h0 = x.by_heads ? x.start[j] : 0, nh = x.by_heads ? x.count[j] : x.width;
    const int64_t h_first = uly__box_first(x, j);
    const int64_t row_heads = x.merge ? nh : 1, rows = x.merge ? 1 : nh - h_first;
    const int64_t nv = row_heads * x.dim / W; /* accesses per row */
    const T *t = (const T *)x.t + t0 * x.ss + h0 * x.sh;
    const T *blk = (const T *)x.buf + x.off[j];
    const uly__pos step = uly__pos_of((int64_t)gridDim.x * blockDim.x, nv, rows, nt);
    for (uly__pos p = uly__pos_of(blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nv, rows, nt);
         p.b < x.batch; uly__pos_add(p, step, nv, rows, nt)) {
        const int64_t e = p.e * W, h = h_first + p.r, s = p.s, b = p.b;
        V *tp = (V *)(t + b * x.sb + s * x.ss + h * x.sh + e);
        V *bp = (V *)(blk + ((b * nt + s) * nh + h) * x.dim + e);
        if constexpr (MODE == ULY__PACK) {
            *bp = *tp;
        } else if constexpr (MODE == ULY__UNPACK) {
            *tp = *bp;
        } else if constexpr (MODE == ULY__PACK_FAN) { /* one read for every copy */
            const V v = *tp;
            *bp = v;
#pragma unroll 1 /* unrolled, the stores' addresses took 86 registers */
            for (int m = j + 1, k = uly__holders_end(x, j, h0 + h); m < k; m++)
                *uly__copy_at<T, W>(x, m, b, s, h0 + h, e) = v;
        } else {
            const int k = uly__holders_end(x, j, h0 + h);
            /* One store of either value: a store in each branch compiles to W narrow ones. */
            *tp = k == j + 1 ? *bp : uly__sum_copies<T, W>(x, j, k, b, s, h0 + h, e);
        }
    }
}

/* The boxes of exchange x on this rank, from the plan's ranges and offsets. */
static uly__boxes uly__boxes_of(const uly_plan *p, uly_xchg x, int unpack, uly_tensor t,
                                void *buf) {
    int64_t c[4][ULY_MAX_SP];
    uly__boxes b;
    uly_exchange_counts(p, x, c[0], c[1], c[2], c[3]);
    b.t = t.data, b.buf = buf;
    b.sb = t.sb, b.ss = t.ss, b.sh = t.sh;
    b.batch = t.b, b.dim = t.d;
    b.n = p->desc.sp_size;
    b.by_heads = uly__to_head(x) != unpack;
    b.width = b.by_heads ? t.s : t.h;
    b.shared = 0;
    for (int j = 0; j < b.n; j++) {
        uly_range r = b.by_heads ? uly__xheads(p, x, j) : uly_tokens(p, j);
        b.start[j] = r.start, b.count[j] = r.count;
        b.off[j] = c[unpack ? 3 : 1][j] / p->elem_size;
        b.shared |= j > 0 && r.start < b.start[j - 1] + b.count[j - 1];
    }
    b.merge = t.sh == t.d && !b.shared;
    /* The grid's columns skip the boxes with nothing to do (empty, or all their heads an
       earlier box's: with MQA every box but the first), so their share of the blocks goes to
       the boxes that copy. */
    b.cols = 0;
    for (int j = 0; j < b.n; j++) {
        const int64_t nt = b.by_heads ? b.width : b.count[j];
        const int64_t nh = b.by_heads ? b.count[j] : b.width;
        if (b.batch * nt * b.dim > 0 && nh > uly__box_first(b, j))
            b.box[b.cols++] = j;
    }
    return b;
}

/* The widest access, 16, 8 or 4 bytes (else one element), that divides every address a thread
   forms in t and buf: block offsets are multiples of a row's D elements, so the pointers, t's
   strides and D say it. A dim of extent 1 is only ever at index 0, so its stride forms no
   address: one batch row, or one token a rank (decode-style), may have any stride there. bf16
   rows of D = 4 or 6 still move 8 or 4 bytes at a time, not 2. */
static int64_t uly__access_bytes(const uly_tensor &t, const void *buf) {
    const int64_t elem = uly_dtype_size(t.dtype);
    const int64_t steps = (t.b > 1 ? t.sb : 0) | (t.s > 1 ? t.ss : 0) | (t.h > 1 ? t.sh : 0);
    uint64_t bits = (uint64_t)(uintptr_t)t.data | (uint64_t)(uintptr_t)buf;
    bits |= (uint64_t)((steps | t.d) * elem);
    int64_t w = 16;
    while (w > elem && bits % (uint64_t)w) w /= 2;
    return uly__max(w, elem);
}

typedef void (*uly__box_fn)(const uly__boxes);
template <typename T, int W> static uly__box_fn uly__box_kernel(int mode) {
    return mode == ULY__PACK       ? uly__box_copy<T, W, ULY__PACK>
           : mode == ULY__UNPACK   ? uly__box_copy<T, W, ULY__UNPACK>
           : mode == ULY__PACK_FAN ? uly__box_copy<T, W, ULY__PACK_FAN>
                                   : uly__box_copy<T, W, ULY__UNPACK_SUM>;
}

/* The kernel moving `bytes` an access (uly__access_bytes). */
template <typename T> static uly__box_fn uly__box_kernel_of(int64_t bytes, int mode) {
    switch (bytes) {
    case 16: return uly__box_kernel<T, 16 / sizeof(T)>(mode);
    case 8: return uly__box_kernel<T, 8 / sizeof(T)>(mode);
    case 4: return uly__box_kernel<T, 4 / sizeof(T)>(mode);
    default: return uly__box_kernel<T, 1>(mode);
    }
}

/* The copy of boxes b, `bytes` an access (uly__access_bytes). */
template <typename T>
static uly_status uly__launch_boxes(const uly__boxes &b, int64_t bytes, int unpack,
                                    cudaStream_t s) {
    if (!b.cols) return uly__ok();
    const int64_t w = bytes / (int64_t)sizeof(T);
    int64_t most = 0; /* accesses in the largest box a column copies */
    for (int c = 0; c < b.cols; c++)
        most = uly__max(most, b.batch * b.width * b.count[b.box[c]] * b.dim / w);
    const int64_t blocks = uly__min((most + ULY__COPY_THREADS - 1) / ULY__COPY_THREADS,
                                    uly__max(1, ULY__COPY_BLOCKS / b.cols));
    const int mode = b.shared ? (unpack ? ULY__UNPACK_SUM : ULY__PACK_FAN)
                              : (unpack ? ULY__UNPACK : ULY__PACK);
    const uly__box_fn kernel = uly__box_kernel_of<T>(bytes, mode);
    ULY_LAUNCH(kernel, dim3((unsigned)blocks, (unsigned)b.cols), dim3(ULY__COPY_THREADS), 0, s,
               b);
    return uly__cuda(cudaGetLastError(), "layout kernel launch");
}

static uly_status uly__cuda_xfer(const uly_plan *p, uly_xchg x, int unpack, uly_tensor t,
                                 void *buf, void *stream) {
    ULY__TRY(uly__check_move(p, x, !unpack, t, buf));
    const uly__boxes b = uly__boxes_of(p, x, unpack, t, buf);
    const int64_t bytes = uly__access_bytes(t, buf);
    return uly__by_dtype(t.dtype, [&](auto tag) {
        return uly__launch_boxes<decltype(tag)>(b, bytes, unpack, (cudaStream_t)stream);
    });
}

static uly_status uly__cuda_pack(void *ctx, const uly_plan *p, uly_xchg x, uly_tensor src,
                                 void *send, void *stream) {
    (void)ctx;
    return uly__cuda_xfer(p, x, 0, src, send, stream);
}

static uly_status uly__cuda_unpack(void *ctx, const uly_plan *p, uly_xchg x, const void *recv,
                                   uly_tensor dst, void *stream) {
    (void)ctx;
    return uly__cuda_xfer(p, x, 1, dst, (void *)recv, stream);
}

ULYDEF uly_layout uly_cuda_layout(void) {
    uly_layout l;
    l.pack = uly__cuda_pack;
    l.unpack = uly__cuda_unpack;
    l.ctx = NULL;
    l.device = 1;
    return l;
}

/* ---------------------------------------------------------------------------------------------
   Device-local communicator

   Virtual rank r is thread r of uly_local_run. The host communicator of those threads carries
   the bookkeeping (where each block is, and the events that say when it is ready) and the GPU
   moves the bytes. alltoallv: record "ready" on my stream; trade block addresses with every
   peer over the host comm; make my stream wait for each sender's ready event and copy its block
   into my receive buffer; record "done"; meet; and make my stream wait for every peer's done
   event, so work queued after the call cannot overwrite my send buffer while a peer reads it.
   The events belong to the world and outlive every rank: a slow rank may still wait on the
   events of a peer that has already returned. */

/* allreduce_sum's buffer: n >= 0 doubles at buf, NULL only when n is 0. *device becomes
   whether it is GPU memory (left as it is for n = 0); since CUDA 11 plain host memory is an
   answer (cudaMemoryTypeUnregistered), not an error. */
static uly_status uly__sum_buffer(const double *buf, int64_t n, int *device) {
    ULY__CHECK(n >= 0 && (buf || !n), ULY_EINVAL, "allreduce_sum: n (%lld) must be >= 0 and buf "
               "not NULL", ULY__LL(n));
    cudaPointerAttributes a;
    if (!n) return uly__ok();
    ULY__TRY(uly__cuda(cudaPointerGetAttributes(&a, buf), "allreduce_sum: "
                       "cudaPointerGetAttributes"));
    *device = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    return uly__ok();
}

typedef struct uly__dl_world {
    void (*fn)(const uly_comm *comm, void *user);
    void *user;
    int device;
    cudaEvent_t ready[ULY_MAX_SP], done[ULY_MAX_SP]; /* rank r's */
    uly_status st[ULY_MAX_SP];                       /* of each rank's cudaSetDevice */
} uly__dl_world;

typedef struct uly__dl_rank {
    const uly_comm *host;
    const uly__dl_world *w;
} uly__dl_rank;

typedef struct uly__dl_block { /* what a sender tells receiver j */
    const char *src;
    int64_t bytes;
} uly__dl_block;

/* Every rank sends the same `size` bytes from out[j] to each peer j; in[i] is what i sent. */
static uly_status uly__dl_trade(const uly_comm *host, const void *out, void *in, int64_t size) {
    int64_t count[ULY_MAX_SP], off[ULY_MAX_SP];
    for (int j = 0; j < host->size; j++) count[j] = size, off[j] = j * size;
    return host->alltoallv(host->ctx, out, count, off, in, count, off, NULL);
}

static uly_status uly__dl_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                    const int64_t *send_offs, void *recv,
                                    const int64_t *recv_counts, const int64_t *recv_offs,
                                    void *stream) {
    uly__dl_rank *me = (uly__dl_rank *)ctx;
    const int P = me->host->size;
    cudaStream_t s = (cudaStream_t)stream;
    uly__dl_block out[ULY_MAX_SP], in[ULY_MAX_SP];
    uly_status st =
        uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts, recv_offs);
    const int r = me->host->rank;
    const cudaError_t ready = cudaEventRecord(me->w->ready[r], s);
    cudaError_t e = ready;
    /* Without its ready event, a peer's copy would not wait for this rank's stream: a rank that
       has bad counts or no event offers nothing (-1 bytes, which no receiver expects). */
    for (int j = 0; j < P; j++) {
        out[j].src = st.code || e ? NULL : (const char *)send + send_offs[j];
        out[j].bytes = st.code || e ? -1 : send_counts[j];
    }
    ULY__TRY(uly__dl_trade(me->host, out, in, sizeof *out));
    for (int i = 0; i < P && !st.code && !e; i++) {
        if (in[i].bytes < 0)
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d failed (bad arguments or a CUDA error) "
                          "and sends nothing", i);
        else if (in[i].bytes != recv_counts[i])
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d sends %lld bytes to rank %d, which "
                          "expects %lld", i, ULY__LL(in[i].bytes), r, ULY__LL(recv_counts[i]));
        else if (in[i].bytes && !(e = cudaStreamWaitEvent(s, me->w->ready[i], 0)))
            e = cudaMemcpyAsync((char *)recv + recv_offs[i], in[i].src, (size_t)in[i].bytes,
                                cudaMemcpyDeviceToDevice, s);
    }
    /* done follows whatever this rank queued, failed or not: peers order what they queue next
       (a write over their send buffers, a free) after it. */
    const cudaError_t done = ready ? ready : cudaEventRecord(me->w->done[r], s);
    if (!e) e = done;
    /* Meet, and learn whether any rank failed: one whose done event is missing may still be
       reading its peers' send buffers, so none of them may report success. */
    double failed = st.code != 0 || e != cudaSuccess;
    uly_status met = me->host->allreduce_sum(me->host->ctx, &failed, 1, NULL);
    for (int i = 0; i < P; i++) {
        const cudaError_t w = cudaStreamWaitEvent(s, me->w->done[i], 0);
        if (!e) e = w;
    }
    ULY__TRY(st);
    ULY__TRY(uly__cuda(e, "device-local alltoallv"));
    ULY__TRY(met);
    ULY__CHECK(failed == 0, ULY_ECOMM, "alltoallv: %g rank(s) failed (counts that do not match "
               "their senders', or a CUDA error)", failed);
    return uly__ok();
}

/* Through the host, a few values at a time: sums are the host comm's, in rank order. Host
   memory goes to it once the stream is done (as NCCL's, so that a result copied there on the
   stream is what is summed); device memory through a copy on the stream. Given no stream, the
   calling rank's per-thread default one (the legacy stream would wait for every rank's work).
   Every rank takes part in every round, failed or not, so that all of them return alike: first
   each learns every count (-1: a rank that failed) and memory (the two take different rounds),
   then each chunk carries whether a rank's copy failed. A rank that went away alone would leave
   its peers to pair this call with its next one. */
enum { ULY__DL_CHUNK = 64 }; /* doubles a host round trip carries: a stack buffer */
typedef struct uly__dl_sum {
    int64_t n, device;
} uly__dl_sum;
static uly_status uly__dl_allreduce(void *ctx, double *buf, int64_t n, void *stream) {
    static const char *const memory[2] = {"host", "device"};
    const uly_comm *host = ((uly__dl_rank *)ctx)->host;
    cudaStream_t s = stream ? (cudaStream_t)stream : cudaStreamPerThread;
    uly__dl_sum mine[ULY_MAX_SP], peer[ULY_MAX_SP];
    int device = 0;
    uly_status st = uly__sum_buffer(buf, n, &device);
    if (!st.code && !device)
        st = uly__cuda(cudaStreamSynchronize(s), "device-local allreduce_sum");
    for (int j = 0; j < host->size; j++) mine[j].n = st.code ? -1 : n, mine[j].device = device;
    ULY__TRY(uly__dl_trade(host, mine, peer, sizeof *mine));
    for (int i = 0; i < host->size && !st.code; i++) {
        if (peer[i].n < 0)
            st = uly__err(ULY_ECOMM, "allreduce_sum: rank %d failed", i);
        else if (peer[i].n != n)
            st = uly__err(ULY_ECOMM, "allreduce_sum: rank %d sums %lld values, rank %d %lld", i,
                          ULY__LL(peer[i].n), host->rank, ULY__LL(n));
        else if (peer[i].device != device)
            st = uly__err(ULY_ECOMM, "allreduce_sum: rank %d sums values in %s memory, rank %d "
                          "in %s memory", i, memory[peer[i].device], host->rank, memory[device]);
    }
    if (st.code) return st;
    if (!device) return host->allreduce_sum(host->ctx, buf, n, NULL);
    cudaError_t e = cudaSuccess;
    double failed = 0;
    for (int64_t at = 0; at < n && !failed; at += ULY__DL_CHUNK) {
        double tmp[ULY__DL_CHUNK + 1]; /* the values, then 1 if this rank's copies failed */
        const int64_t m = uly__min(ULY__DL_CHUNK, n - at);
        const size_t bytes = (size_t)m * sizeof(double);
        if (!e) e = cudaMemcpyAsync(tmp, buf + at, bytes, cudaMemcpyDefault, s);
        if (!e) e = cudaStreamSynchronize(s);
        tmp[m] = e != cudaSuccess;
        ULY__TRY(host->allreduce_sum(host->ctx, tmp, m + 1, NULL));
        failed = tmp[m];
        if (!e && !failed) e = cudaMemcpyAsync(buf + at, tmp, bytes, cudaMemcpyDefault, s);
        if (!e && !failed) e = cudaStreamSynchronize(s);
    }
    ULY__TRY(uly__cuda(e, "device-local allreduce_sum"));
    ULY__CHECK(!failed, ULY_ECOMM, "allreduce_sum: %g rank(s) could not copy their values",
               failed);
    return uly__ok();
}

static uly_status uly__dl_barrier(void *ctx) {
    const uly_comm *host = ((uly__dl_rank *)ctx)->host;
    return host->barrier(host->ctx);
}

static void uly__dl_main(const uly_comm *host, void *user) {
    uly__dl_world *w = (uly__dl_world *)user;
    uly__dl_rank me = {host, w};
    uly_status *st = &w->st[host->rank];
    *st = uly__cuda(cudaSetDevice(w->device), "device-local comm: cudaSetDevice");
    /* fn runs on every rank or on none: one that returned alone would leave its peers waiting in
       fn's first collective. uly_cuda_local_run returns the rank's error. */
    double failed = st->code != 0;
    const uly_status met = host->allreduce_sum(host->ctx, &failed, 1, NULL);
    if (!st->code) *st = met;
    if (failed || st->code) return;
    uly_comm c;
    memset(&c, 0, sizeof c);
    c.size = host->size, c.rank = host->rank;
    c.alltoallv = uly__dl_alltoallv;
    c.allreduce_sum = uly__dl_allreduce;
    c.barrier = uly__dl_barrier;
    c.ctx = &me;
    c.device = 1;
    w->fn(&c, w->user);
}

static uly_status uly__cuda_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                      void *user) {
    uly__dl_world w;
    uly_status st = uly__ok();
    int made = 0;
    memset(&w, 0, sizeof w);
    w.fn = fn, w.user = user;
    ULY__CHECK(fn, ULY_EINVAL, "fn is NULL");
    ULY__CHECK(size >= 1 && size <= ULY_MAX_SP, ULY_EINVAL, "size (%d) must be in [1, %d]", size,
               ULY_MAX_SP);
    ULY__TRY(uly__cuda(cudaGetDevice(&w.device), "cudaGetDevice"));
    for (; made < size && !st.code; made++) {
        cudaError_t e = cudaEventCreateWithFlags(&w.ready[made], cudaEventDisableTiming);
        if (!e) e = cudaEventCreateWithFlags(&w.done[made], cudaEventDisableTiming);
        st = uly__cuda(e, "cudaEventCreate");
    }
    if (!st.code) st = uly_local_run(size, uly__dl_main, &w);
    for (int r = 0; r < size && !st.code; r++) st = w.st[r];
    for (int r = 0; r < made; r++) {
        if (w.ready[r]) cudaEventDestroy(w.ready[r]);
        if (w.done[r]) cudaEventDestroy(w.done[r]);
    }
    return st;
}

ULYDEF uly_status uly_cuda_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                     void *user) {
    return uly__named("uly_cuda_local_run", uly__cuda_local_run(size, fn, user));
}

/* ---------------------------------------------------------------------------------------------
   NCCL communicator */

#ifdef ULYSSES_NCCL
#include <time.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "ULYSSES_NCCL needs NCCL 2.18 or newer (ncclCommSplit)"
#endif
#ifndef ULY_NCCL_ALLTOALL
#define ULY_NCCL_ALLTOALL (NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0))
#elif ULY_NCCL_ALLTOALL && NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)
#error "ULY_NCCL_ALLTOALL needs NCCL 2.28 or newer (ncclAlltoAll)"
#endif

static uly_status uly__nccl(ncclResult_t r, ncclComm_t comm, const char *what) {
    if (r == ncclSuccess) return uly__ok();
    const char *last = comm ? ncclGetLastError(comm) : "";
    return uly__err(ULY_ECOMM, "%s: %s%s%s", what, ncclGetErrorString(r),
                    last && last[0] ? "; NCCL's last error (maybe an earlier call's): " : "",
                    last ? last : "");
}

/* Seconds since t0. */
static double uly__since(const struct timespec *t0) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + 1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
}

/* NCCL's answer r to a call on comm, once final. A non-blocking communicator answers
   ncclInProgress until the call's work is queued, and until then only ncclCommGetAsyncError
   may be called on it (NCCL's rule): poll that, for at most timeout_s seconds (0: no limit). */
static uly_status uly__nccl_ready(ncclComm_t comm, ncclResult_t r, double timeout_s,
                                  const char *what) {
    struct timespec t0, nap = {0, 100000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (r == ncclInProgress) {
        ULY__TRY(uly__nccl(ncclCommGetAsyncError(comm, &r), comm, what));
        const double waited = uly__since(&t0);
        ULY__CHECK(r != ncclInProgress || !(timeout_s > 0 && waited > timeout_s), ULY_ECOMM,
                   "%s: still in progress after %.1f s (a peer may be gone); the communicator "
                   "is unusable: ncclCommAbort it on every rank", what, waited);
        if (r == ncclInProgress) nanosleep(&nap, NULL);
    }
    return uly__nccl(r, comm, what);
}

/* A failed or in-flight-broken communicator says so here, not in a hang at the next call.
   *state (unless NULL) gets NCCL's answer, ncclInProgress while a non-blocking call is queued. */
static uly_status uly__nccl_async(ncclComm_t comm, const char *what, ncclResult_t *state) {
    ncclResult_t async = ncclSuccess;
    ULY__TRY(uly__nccl(ncclCommGetAsyncError(comm, &async), comm, what));
    if (state) *state = async;
    return async == ncclInProgress ? uly__ok() : uly__nccl(async, comm, what);
}

/* uly_nccl_wait, whose messages its callers lead with their names. Done is when the stream is
   idle and NCCL answers success: a peer may have failed since the work ran, and a non-blocking
   call answers ncclInProgress until NCCL's thread has queued its work, when the stream can be
   idle with the work still to come. */
static uly_status uly__nccl_wait(ncclComm_t comm, void *stream, double timeout_s) {
    struct timespec t0, nap = {0, 100000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        const cudaError_t q = cudaStreamQuery((cudaStream_t)stream);
        if (q != cudaSuccess && q != cudaErrorNotReady) return uly__cuda(q, "cudaStreamQuery");
        /* The runtime keeps "not ready", like any answer but success, as the thread's last error,
           which the next launch's check (cudaGetLastError) would take for its own failure. */
        if (q == cudaErrorNotReady && cudaPeekAtLastError() == cudaErrorNotReady)
            (void)cudaGetLastError();
        ncclResult_t async = ncclSuccess;
        uly_status st = uly__nccl_async(comm, "ncclCommGetAsyncError", &async);
        if (!st.code && q == cudaSuccess && async == ncclSuccess) return st;
        const double waited = uly__since(&t0);
        if (!st.code && timeout_s > 0 && waited > timeout_s)
            st = uly__err(ULY_ECOMM, "%s after %.2f s (a peer may be gone)",
                          q == cudaSuccess ? "NCCL's call still in progress"
                                           : "the stream is not done",
                          waited);
        if (st.code)
            return uly__err(ULY_ECOMM, "%s; the communicator is unusable: ncclCommAbort it on "
                            "every rank", st.msg);
        nanosleep(&nap, NULL);
    }
}

/* Grouped ncclSend/ncclRecv even where this rank's counts are uniform: ncclAlltoAll is a
   collective every rank must call, and a rank sees only its own counts, which can be uniform
   while a peer's are not (that peer would wait in ncclRecv, forever). Both ends of a pair see
   the same count, so pairs agree without asking. The layer takes ncclAlltoAll through
   alltoall, where the plan says every rank's blocks are uniform. */
static uly_status uly__nccl_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                      const int64_t *send_offs, void *recv,
                                      const int64_t *recv_counts, const int64_t *recv_offs,
                                      void *stream) {
    uly_nccl *n = (uly_nccl *)ctx;
    cudaStream_t s = (cudaStream_t)stream;
    int P = 0;
    ULY__TRY(uly__nccl(ncclCommCount(n->comm, &P), n->comm, "alltoallv: ncclCommCount"));
    ULY__TRY(uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts, recv_offs));
    ULY__TRY(uly__nccl(ncclGroupStart(), n->comm, "alltoallv: ncclGroupStart"));
    ncclResult_t r = ncclSuccess;
    for (int j = 0; j < P && r == ncclSuccess; j++) {
        if (send_counts[j])
            r = ncclSend((const char *)send + send_offs[j], (size_t)send_counts[j], ncclUint8, j,
                         n->comm, s);
        if (recv_counts[j] && r == ncclSuccess)
            r = ncclRecv((char *)recv + recv_offs[j], (size_t)recv_counts[j], ncclUint8, j,
                         n->comm, s);
    }
    const ncclResult_t end = ncclGroupEnd(); /* always closes the group */
    ULY__TRY(uly__nccl(r, n->comm, "alltoallv: ncclSend/ncclRecv"));
    ULY__TRY(uly__nccl_ready(n->comm, end, n->timeout_s, "alltoallv: ncclGroupEnd"));
    return uly__nccl_async(n->comm, "alltoallv", NULL);
}

#if ULY_NCCL_ALLTOALL
/* Weak, so that a program built with NCCL 2.28's header still loads with an older libnccl.so.2
   under immediate binding (-z now, hardened builds), where the symbol is missing: the loader
   leaves it NULL, and uly_nccl_comm, which reads the library's version, never calls it. */
#pragma weak ncclAlltoAll
static uly_status uly__nccl_alltoall(void *ctx, const void *send, void *recv, int64_t bytes,
                                     void *stream) {
    uly_nccl *n = (uly_nccl *)ctx;
    int P = 0;
    ULY__TRY(uly__nccl(ncclCommCount(n->comm, &P), n->comm, "alltoall: ncclCommCount"));
    const int64_t all = uly__mul(P, bytes);
    ULY__CHECK(bytes >= 0 && all >= 0 && ((send && recv) || !bytes), ULY_EINVAL, "alltoall: "
               "bytes (%lld) must be >= 0 and %d times it fit int64, and send and recv not NULL",
               ULY__LL(bytes), P);
    ULY__CHECK(!uly__meet(send, all, recv, all), ULY_EINVAL, "alltoall: send and recv (%lld "
               "bytes each) overlap: an exchange cannot run in place", ULY__LL(all));
    ULY__TRY(uly__nccl_ready(n->comm, ncclAlltoAll(send, recv, (size_t)bytes, ncclUint8, n->comm,
                                                   (cudaStream_t)stream),
                             n->timeout_s, "alltoall: ncclAlltoAll"));
    return uly__nccl_async(n->comm, "alltoall", NULL);
}
#endif

/* what: the uly_comm call it serves, for the messages. */
static uly_status uly__nccl_sum(uly_nccl *n, double *dev, int64_t count, cudaStream_t s,
                                const char *what) {
    char call[64];
    snprintf(call, sizeof call, "%s: ncclAllReduce", what);
    const ncclResult_t r = ncclAllReduce(dev, dev, (size_t)count, ncclFloat64, ncclSum, n->comm, s);
    ULY__TRY(uly__nccl_ready(n->comm, r, n->timeout_s, call));
    return uly__nccl_async(n->comm, what, NULL);
}

/* Device memory in place; host memory through scratch, a chunk at a time, waiting for each. */
static uly_status uly__nccl_allreduce(void *ctx, double *buf, int64_t count, void *stream) {
    uly_nccl *n = (uly_nccl *)ctx;
    cudaStream_t s = (cudaStream_t)(stream ? stream : n->stream);
    int device = 0;
    ULY__TRY(uly__sum_buffer(buf, count, &device));
    if (!count || device) return uly__nccl_sum(n, buf, count, s, "allreduce_sum");
    ULY__CHECK(n->scratch, ULY_EUNSUPPORTED, "allreduce_sum of host memory: uly_nccl.scratch is "
               "NULL (it needs %d doubles of device memory)", (int)ULY_NCCL_SCRATCH);
    /* A copy of pageable memory waits for the stream before it starts, and a collective stuck
       on a dead peer never lets it finish: wait here, where the timeout applies. */
    ULY__TRY(uly__named("allreduce_sum", uly__nccl_wait(n->comm, s, n->timeout_s)));
    for (int64_t at = 0; at < count; at += ULY_NCCL_SCRATCH) {
        const size_t bytes = (size_t)uly__min(ULY_NCCL_SCRATCH, count - at) * sizeof(double);
        ULY__TRY(uly__cuda(cudaMemcpyAsync(n->scratch, buf + at, bytes, cudaMemcpyHostToDevice,
                                           s), "allreduce_sum"));
        ULY__TRY(uly__nccl_sum(n, n->scratch, (int64_t)(bytes / sizeof(double)), s,
                               "allreduce_sum"));
        /* Likewise before the copy back. */
        ULY__TRY(uly__named("allreduce_sum", uly__nccl_wait(n->comm, s, n->timeout_s)));
        ULY__TRY(uly__cuda(cudaMemcpyAsync(buf + at, n->scratch, bytes, cudaMemcpyDeviceToHost,
                                           s), "allreduce_sum"));
        ULY__TRY(uly__cuda(cudaStreamSynchronize(s), "allreduce_sum"));
    }
    return uly__ok();
}

/* A one-value allreduce, waited for, on the stream of calls given none. */
static uly_status uly__nccl_barrier(void *ctx) {
    uly_nccl *n = (uly_nccl *)ctx;
    cudaStream_t s = (cudaStream_t)n->stream;
    ULY__CHECK(n->scratch, ULY_EUNSUPPORTED, "barrier: uly_nccl.scratch is NULL (it needs %d "
               "doubles of device memory)", (int)ULY_NCCL_SCRATCH);
    ULY__TRY(uly__nccl_sum(n, n->scratch, 1, s, "barrier"));
    return uly__named("barrier", uly__nccl_wait(n->comm, s, n->timeout_s));
}

static uly_status uly__nccl_comm(uly_nccl *n, uly_comm *out) {
    ULY__CHECK(n && n->comm && out, ULY_EINVAL, "%s is NULL", !n ? "n" : !out ? "out" : "n->comm");
    memset(out, 0, sizeof *out);
    ULY__CHECK(n->stream, ULY_EINVAL, "n->stream is NULL: calls given no stream need one of "
               "comm's device (cudaStreamPerThread is another stream to NCCL's own thread)");
    /* A non-blocking communicator may still be joining its peers (ncclCommInitRankConfig, a
       split): wait until it is ready. */
    ULY__TRY(uly__nccl_ready(n->comm, ncclInProgress, n->timeout_s, "n->comm's init"));
    ULY__TRY(uly__nccl(ncclCommCount(n->comm, &out->size), n->comm, "ncclCommCount"));
    ULY__TRY(uly__nccl(ncclCommUserRank(n->comm, &out->rank), n->comm, "ncclCommUserRank"));
    out->alltoallv = uly__nccl_alltoallv;
#if ULY_NCCL_ALLTOALL
    /* The library loaded, not the header: an older libnccl.so.2 has no ncclAlltoAll. Without
       alltoall the layer uses alltoallv. */
    int version = 0;
    ULY__TRY(uly__nccl(ncclGetVersion(&version), n->comm, "ncclGetVersion"));
    if (version >= NCCL_VERSION(2, 28, 0)) out->alltoall = uly__nccl_alltoall;
#endif
    out->allreduce_sum = uly__nccl_allreduce;
    out->barrier = uly__nccl_barrier;
    out->ctx = n;
    out->device = 1;
    return uly__ok();
}

ULYDEF uly_status uly_nccl_comm(uly_nccl *n, uly_comm *out) {
    return uly__named("uly_nccl_comm", uly__nccl_comm(n, out));
}

static uly_status uly__nccl_split(ncclComm_t world, int sp_size, double timeout_s,
                                  ncclComm_t *sp, ncclComm_t *dp) {
    int size = 0, rank = 0;
    ULY__CHECK(world && sp && dp, ULY_EINVAL, "%s is NULL", !world ? "world" : !sp ? "sp" : "dp");
    *sp = *dp = NULL;
    /* A non-blocking world may still be joining its peers (ncclCommInitRankConfig). */
    ULY__TRY(uly__nccl_ready(world, ncclInProgress, timeout_s, "world's init"));
    ULY__TRY(uly__nccl(ncclCommCount(world, &size), world, "ncclCommCount"));
    ULY__TRY(uly__nccl(ncclCommUserRank(world, &rank), world, "ncclCommUserRank"));
    ULY__CHECK(sp_size >= 1 && size % sp_size == 0, ULY_EINVAL,
               "sp_size (%d) must divide the world's size (%d)", sp_size, size);
    /* A non-blocking world's splits are in progress when they return: world must be ready for
       the next call; the new communicators are waited for by uly_nccl_comm. */
    ULY__TRY(uly__nccl_ready(world, ncclCommSplit(world, rank / sp_size, rank % sp_size, sp, NULL),
                             timeout_s, "ncclCommSplit (SP)"));
    return uly__nccl_ready(world, ncclCommSplit(world, rank % sp_size, rank / sp_size, dp, NULL),
                           timeout_s, "ncclCommSplit (DP)");
}

ULYDEF uly_status uly_nccl_split(ncclComm_t world, int sp_size, double timeout_s, ncclComm_t *sp,
                                 ncclComm_t *dp) {
    return uly__named("uly_nccl_split", uly__nccl_split(world, sp_size, timeout_s, sp, dp));
}

ULYDEF uly_status uly_nccl_wait(ncclComm_t comm, void *stream, double timeout_s) {
    return uly__named("uly_nccl_wait", uly__nccl_wait(comm, stream, timeout_s));
}

#endif /* ULYSSES_NCCL */

/* ---------------------------------------------------------------------------------------------
   Reference attention: the contract's formulas, one thread per row, fp32 */

enum { ULY__REF_MAX_D = 256, ULY__REF_THREADS = 64 };

struct uly__ref_params {
    uly_tensor q, k, v, o, dout, dq, dk, dv;
    float *lse, *dsum; /* [B, H, Sq] */
    float scale;
    int causal;
    int64_t q_head0, group;
};

template <typename T> __device__ float uly__ref_dot(const T *a, const T *b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += uly__widen(a[i]) * uly__widen(b[i]);
    return s;
}

/* Query row i keeps keys [0, kept): the causal mask is bottom-right aligned. */
__device__ __forceinline__ int64_t uly__ref_kept(const uly__ref_params &p, int64_t i) {
    return p.causal ? min(p.k.s, max((int64_t)0, i + p.k.s - p.q.s + 1)) : p.k.s;
}

/* Grid (query rows, H, B). lse and o of a row that keeps no key: +inf and 0. */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_fwd(const uly__ref_params p) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (i >= p.q.s) return;
    const int64_t hk = uly__kv_head(p.q_head0, p.group, h), n = uly__ref_kept(p, i), D = p.q.d;
    const T *q = uly__row<T>(p.q, b, i, h);
    float m = -INFINITY, l = 0.f, acc[ULY__REF_MAX_D];
    for (int64_t j = 0; j < n; j++)
        m = fmaxf(m, p.scale * uly__ref_dot(q, uly__row<T>(p.k, b, j, hk), D));
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const float e = expf(p.scale * uly__ref_dot(q, uly__row<T>(p.k, b, j, hk), D) - m);
        const T *v = uly__row<T>(p.v, b, j, hk);
        l += e;
        for (int64_t d = 0; d < D; d++) acc[d] += e * uly__widen(v[d]);
    }
    T *o = uly__row<T>(p.o, b, i, h);
    for (int64_t d = 0; d < D; d++) o[d] = uly__round<T>(n ? acc[d] / l : 0.f);
    p.lse[(b * p.q.h + h) * p.q.s + i] = n ? m + logf(l) : INFINITY;
}

/* Grid (query rows, H, B): Dsum = rowsum(dout * o), and dq = scale * sum_j dS_ij k_j with
   P_ij = exp(s_ij - lse_i), dS_ij = P_ij (dout_i . v_j - Dsum_i). */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_bwd_q(const uly__ref_params p) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (i >= p.q.s) return;
    const int64_t hk = uly__kv_head(p.q_head0, p.group, h), n = uly__ref_kept(p, i), D = p.q.d;
    const int64_t row = (b * p.q.h + h) * p.q.s + i;
    const T *q = uly__row<T>(p.q, b, i, h), *dout = uly__row<T>(p.dout, b, i, h);
    const float dsum = uly__ref_dot(dout, uly__row<T>(p.o, b, i, h), D), lse = p.lse[row];
    float acc[ULY__REF_MAX_D];
    p.dsum[row] = dsum;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const T *k = uly__row<T>(p.k, b, j, hk), *v = uly__row<T>(p.v, b, j, hk);
        const float pr = expf(p.scale * uly__ref_dot(q, k, D) - lse);
        const float ds = pr * (uly__ref_dot(dout, v, D) - dsum);
        for (int64_t d = 0; d < D; d++) acc[d] += ds * uly__widen(k[d]);
    }
    T *dq = uly__row<T>(p.dq, b, i, h);
    for (int64_t d = 0; d < D; d++) dq[d] = uly__round<T>(p.scale * acc[d]);
}

/* Grid (key rows, Hkv, B), after uly__ref_bwd_q wrote Dsum: dv = sum P_ij dout_i and
   dk = scale * sum dS_ij q_i over the query rows that keep key j, of every query head of the
   kv head's group. */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_bwd_kv(const uly__ref_params p) {
    const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (j >= p.k.s) return;
    const int64_t D = p.q.d;
    const uly__head_span heads = uly__q_heads(p.q_head0, p.group, hk, p.q.h);
    const int64_t i_begin = p.causal ? max((int64_t)0, j - p.k.s + p.q.s) : 0;
    const T *k = uly__row<T>(p.k, b, j, hk), *v = uly__row<T>(p.v, b, j, hk);
    float dk[ULY__REF_MAX_D], dv[ULY__REF_MAX_D];
    for (int64_t d = 0; d < D; d++) dk[d] = dv[d] = 0.f;
    for (int64_t h = heads.first; h < heads.end; h++)
        for (int64_t i = i_begin; i < p.q.s; i++) {
            const int64_t row = (b * p.q.h + h) * p.q.s + i;
            const T *q = uly__row<T>(p.q, b, i, h), *dout = uly__row<T>(p.dout, b, i, h);
            const float pr = expf(p.scale * uly__ref_dot(q, k, D) - p.lse[row]);
            const float ds = pr * (uly__ref_dot(dout, v, D) - p.dsum[row]);
            for (int64_t d = 0; d < D; d++) {
                dv[d] += pr * uly__widen(dout[d]);
                dk[d] += ds * uly__widen(q[d]);
            }
        }
    T *dk_out = uly__row<T>(p.dk, b, j, hk), *dv_out = uly__row<T>(p.dv, b, j, hk);
    for (int64_t d = 0; d < D; d++) {
        dk_out[d] = uly__round<T>(p.scale * dk[d]);
        dv_out[d] = uly__round<T>(dv[d]);
    }
}

static int64_t uly__ref_workspace(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    return a ? uly__mul(uly__mul(uly__mul(a->q.b, a->q.h), a->q.s), 4) : -1; /* Dsum */
}

/* The contract's checks, then the parameters every kernel reads. */
static uly_status uly__ref_params_of(const uly_attn_args *a, int backward, uly__ref_params *p) {
    ULY__TRY(uly__attn_check(a, backward));
    ULY__CHECK(a->q.d <= ULY__REF_MAX_D, ULY_EUNSUPPORTED, "reference attention: q.d (%lld) > "
               "%d", ULY__LL(a->q.d), ULY__REF_MAX_D);
    ULY__CHECK(a->q.b <= 65535 && a->q.h <= 65535 && a->k.h <= 65535, ULY_EUNSUPPORTED,
               "reference attention: q.b (%lld), q.h (%lld) and k.h (%lld) must be <= 65535 "
               "(grid dims)", ULY__LL(a->q.b), ULY__LL(a->q.h), ULY__LL(a->k.h));
    if (backward) ULY__TRY(uly__check_workspace(a, uly__ref_workspace(NULL, a), 4)); /* Dsum */
    p->q = a->q, p->k = a->k, p->v = a->v, p->o = a->o;
    p->dout = a->dout, p->dq = a->dq, p->dk = a->dk, p->dv = a->dv;
    p->lse = a->lse;
    p->dsum = (float *)a->workspace;
    p->scale = uly__scale(a);
    p->causal = a->causal;
    p->q_head0 = a->q_head0;
    p->group = uly__group(a);
    return uly__ok();
}

static dim3 uly__ref_grid(int64_t rows, int64_t heads, int64_t batch) {
    return dim3((unsigned)((rows + ULY__REF_THREADS - 1) / ULY__REF_THREADS), (unsigned)heads,
                (unsigned)batch);
}

static uly_status uly__ref_fwd_call(void *ctx, const uly_attn_args *a) {
    uly__ref_params p;
    (void)ctx;
    ULY__TRY(uly__ref_params_of(a, 0, &p));
    return uly__by_dtype(a->q.dtype, [&](auto tag) {
        typedef decltype(tag) T;
        ULY_LAUNCH(uly__ref_fwd<T>, uly__ref_grid(p.q.s, p.q.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, (cudaStream_t)a->stream, p);
        return uly__cuda(cudaGetLastError(), "reference attention forward");
    });
}

static uly_status uly__ref_bwd_call(void *ctx, const uly_attn_args *a) {
    uly__ref_params p;
    (void)ctx;
    ULY__TRY(uly__ref_params_of(a, 1, &p));
    return uly__by_dtype(a->q.dtype, [&](auto tag) {
        typedef decltype(tag) T;
        cudaStream_t s = (cudaStream_t)a->stream;
        ULY_LAUNCH(uly__ref_bwd_q<T>, uly__ref_grid(p.q.s, p.q.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, s, p);
        ULY_LAUNCH(uly__ref_bwd_kv<T>, uly__ref_grid(p.k.s, p.k.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, s, p);
        return uly__cuda(cudaGetLastError(), "reference attention backward");
    });
}

static uly_status uly__ref_check(void *ctx, const uly_attn_args *a, int backward) {
    uly__ref_params p;
    (void)ctx;
    return uly__ref_params_of(a, backward, &p);
}

ULYDEF uly_attn uly_cuda_reference_attention(void) {
    uly_attn a = {uly__ref_fwd_call, uly__ref_bwd_call, uly__ref_workspace, NULL, uly__ref_check,
                  1};
    return a;
}

/* ---------------------------------------------------------------------------------------------
   Flash attention: tile sizes, parameters, grid order */

/* Tile sizes per head dim, in one place, named as the kernels. fwd and bwd_q (the deterministic
   dQ kernel): a block owns BM query rows (16*MT per warp) and streams BN keys. bwd_kv: a block
   owns BN keys and streams BM query rows (its warp grids are in uly__flash_bwd_kv). */
template <int D> struct uly__fa_traits;
template <> struct uly__fa_traits<64> {
    struct fwd { enum { BM = 128, BN = 64, WARPS = 4 }; };
    struct bwd_kv { enum { BM = 64, BN = 128, WARPS = 8 }; };
    struct bwd_q { enum { BM = 64, BN = 128, WARPS = 4 }; };
};
template <> struct uly__fa_traits<128> {
    struct fwd { enum { BM = 128, BN = 64, WARPS = 4 }; };
    struct bwd_kv { enum { BM = 64, BN = 128, WARPS = 8 }; };
    struct bwd_q { enum { BM = 64, BN = 64, WARPS = 4 }; };
};

/* Dynamic shared memory of each kernel, in bytes (the layouts are in the kernels). */
template <int D> constexpr size_t uly__fa_fwd_smem() {
    using F = typename uly__fa_traits<D>::fwd;
    return (size_t)(F::BM + 2 * F::BN) * D * 2;
}
template <int D> constexpr size_t uly__fa_bwd_kv_smem() {
    using B = typename uly__fa_traits<D>::bwd_kv;
    return (size_t)(2 * B::BN * D + 4 * B::BM * D + 2 * B::BM * B::BN) * 2 +
           4 * B::BM * sizeof(float);
}
template <int D> constexpr size_t uly__fa_bwd_q_smem() {
    using Q = typename uly__fa_traits<D>::bwd_q;
    return (size_t)(2 * Q::BM + 4 * Q::BN) * D * 2;
}

/* Everything a kernel needs, by value in its parameters. Tensors are uly_tensor views; for
   varlen, b is 0 and rows are offset by cu_seqlens. lse, Dsum and the dQ accumulator are indexed
   by query row (uly__fa_qrow). */
struct uly__fa_params {
    uly_tensor q, k, v, o, dout, dq, dk, dv;
    float *lse;
    float *dsum, *dq_acc;         /* backward workspace */
    int64_t lse_sb, lse_sh;
    const int32_t *cu_q, *cu_k;   /* varlen, or NULL */
    int sq, sk;                   /* dense lengths; varlen: q's and k's rows, all documents */
    int64_t q_head0, kv_group;
    float scale, scale_log2;      /* softmax_scale and softmax_scale * log2(e) */
    int causal;
    int y0, z0, nz;               /* this launch's slice of the grid (uly__fa_launch) */
};

/* One sequence of the batch: tensor batch index, first query and key row, lengths. */
struct uly__fa_seq {
    int64_t b, q0, k0;
    int sq, sk;
};

__device__ __forceinline__ uly__fa_seq uly__fa_seq_of(const uly__fa_params &p, int b) {
    if (!p.cu_q) return {b, 0, 0, p.sq, p.sk};
    const int q0 = p.cu_q[b], k0 = p.cu_k[b];
    return {0, q0, k0, p.cu_q[b + 1] - q0, p.cu_k[b + 1] - k0};
}

/* Whether document b of the batch-long cu_seqlens cu is one of a packing of n rows: it starts
   at 0 if first, ends at n if last, does not end before it starts and is at most max long.
   Every document passing makes the packing nondecreasing from 0 to n, so within bounds. */
__device__ __forceinline__ bool uly__fa_doc_ok(const int32_t *cu, int b, int batch, int n,
                                               int max) {
    const int x0 = cu[b], x1 = cu[b + 1];
    return (b > 0 || x0 == 0) && (b < batch - 1 || x1 == n) && x0 <= x1 && x1 - x0 <= max;
}

/* cu_seqlens is device data the host never reads, and a bad one would make the flash kernels
   read and write out of bounds or leave rows unwritten. This block runs before them on the
   stream: at the first bad document it says why and traps (a launch failure at the next sync,
   as a device-side assert), so they never run. A kernel of its own, so the flash kernels spend
   no registers on it. */
static __global__ void __launch_bounds__(256)
    uly__fa_check_docs(const int32_t *cu_q, const int32_t *cu_k, int batch, int nq, int nk,
                       int max_q, int max_k) {
    __shared__ int bad;
    if (threadIdx.x == 0) bad = batch;
    __syncthreads();
    for (int b = (int)threadIdx.x; b < batch; b += (int)blockDim.x)
        if (!uly__fa_doc_ok(cu_q, b, batch, nq, max_q) ||
            !uly__fa_doc_ok(cu_k, b, batch, nk, max_k))
            atomicMin(&bad, b);
    __syncthreads();
    if (threadIdx.x == 0 && bad < batch) {
        const int b = bad;
        printf("ulysses: varlen document %d of %d: cu_seqlens_q [%d, %d) of %d rows, max_seqlen_q "
               "%d; cu_seqlens_k [%d, %d) of %d rows, max_seqlen_k %d. cu_seqlens must start at 0, "
               "not decrease, end at the rows, and keep each document within max_seqlen\n",
               b, batch, cu_q[b], cu_q[b + 1], nq, max_q, cu_k[b], cu_k[b + 1], nk, max_k);
        __trap();
    }
}

/* Query row `row` of head h in the fp32 per-row arrays: lse and Dsum (times D: the dQ
   accumulator). */
__device__ __forceinline__ int64_t uly__fa_qrow(const uly__fa_params &p, const uly__fa_seq &s,
                                                int64_t h, int row) {
    return s.b * p.lse_sb + h * p.lse_sh + s.q0 + row;
}

/* The flash grids are (heads, sequences, blocks). Blocks start in linear index order, x
   fastest, so the i-th block of every (head, sequence) starts before any's (i+1)-th, and each
   kernel orders its blocks longest first under a causal mask (the last query blocks see the most
   keys, the first key blocks the most queries): the whole grid starts longest first and ends on
   short blocks. With (blocks, heads, sequences) the grid would run head by head and start the
   last heads' long blocks last: for 16 heads of 128 causal query blocks on an H100's 264
   forward slots (2 per SM), a list schedule then ends at 89% of the ideal time, against 99.6%
   this way (bench/RESULTS.md). The row passes (Dsum, dQ's conversion) keep (rows, heads,
   sequences): their blocks are alike.
   A grid past CUDA's 65535 blocks along y or z (a sequence of more than 65535 blocks, more
   sequences or heads) runs as slices, launched in the order one grid would start its blocks
   (uly__fa_launch); a block finds its place in the whole grid from p.y0 and p.z0, where its
   slice starts, and p.nz, the whole grid's z. */
__device__ __forceinline__ int uly__fa_y(const uly__fa_params &p) { return p.y0 + (int)blockIdx.y; }
__device__ __forceinline__ int uly__fa_z(const uly__fa_params &p) { return p.z0 + (int)blockIdx.z; }

/* The query block a block of the forward and dQ grids owns: the last first. */
__device__ __forceinline__ int uly__fa_query_block(const uly__fa_params &p) {
    return p.nz - 1 - uly__fa_z(p);
}

/* ---------------------------------------------------------------------------------------------
   Tile primitives. A shared tile holds R rows of W 16-bit elements, row-major, with its 16-byte
   chunks XOR-swizzled by row (chunk c of row r is stored at c ^ (r % 8)): the 8 row addresses of
   one ldmatrix matrix, and the chunks one cp.async round writes, fall in distinct banks. */

template <int W> __device__ __forceinline__ uint32_t uly__swz(int r, int c) {
    static_assert(W % 64 == 0, "tile rows are whole 128-byte lines");
    return (uint32_t)(r * W * 2 + ((c ^ (r & 7)) << 4));
}

/* The chunks a thread moves between a tile and global memory: rounds of THREADS threads cover
   THREADS / CH whole rows (a multiple of 8, so the swizzle of a thread's chunk is the same in every
   round), and a thread keeps one chunk column. */
template <int R, int W, int THREADS> struct uly__tile_split {
    enum { CH = W / 8, ROWS = THREADS / CH, ROUNDS = R / ROWS };
    static_assert(THREADS % CH == 0 && ROWS % 8 == 0 && R % ROWS == 0, "whole swizzle periods");
};

/* cp.async rows g, g + stride, ... into the tile at s; rows at or past `valid` (>= 1) read
   nothing and are zero-filled. The block's THREADS threads share the work. */
template <int R, int W, int THREADS, typename T>
__device__ __forceinline__ void uly__tile_load(uint32_t s, const T *g, int64_t stride, int valid) {
    using S = uly__tile_split<R, W, THREADS>;
    const int r = (int)threadIdx.x / S::CH, c = (int)threadIdx.x % S::CH;
    const T *src = g + r * stride + c * 8;
    s += uly__swz<W>(r, c);
#pragma unroll
    for (int i = 0; i < S::ROUNDS; i++, src += S::ROWS * stride) {
        const bool ok = r + i * S::ROWS < valid;
        uly_cp_async<16>(s + i * S::ROWS * W * 2, ok ? src : g, ok ? 16 : 0);
    }
}

/* The tile at s to global rows g, g + stride, ..., the first `valid` of them. */
template <int R, int W, int THREADS, typename T>
__device__ __forceinline__ void uly__tile_store(T *g, int64_t stride, int valid,
                                                const unsigned char *s) {
    using S = uly__tile_split<R, W, THREADS>;
    const int r = (int)threadIdx.x / S::CH, c = (int)threadIdx.x % S::CH;
    T *dst = g + r * stride + c * 8;
    s += uly__swz<W>(r, c);
#pragma unroll
    for (int i = 0; i < S::ROUNDS; i++, dst += S::ROWS * stride)
        if (r + i * S::ROWS < valid) *(uint4 *)dst = *(const uint4 *)(s + i * S::ROWS * W * 2);
}

template <typename T> __device__ __forceinline__ uint32_t uly__pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t uly__pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
template <> __device__ __forceinline__ uint32_t uly__pack2<__half>(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

/* The two 16-bit elements of a 32-bit word as floats, low first: the inverse of uly__pack2. */
template <typename T> __device__ __forceinline__ float2 uly__unpack2(uint32_t u) {
    typename std::conditional<std::is_same<T, __half>::value, __half_raw, __nv_bfloat16_raw>::type
        lo, hi;
    lo.x = (unsigned short)u, hi.x = (unsigned short)(u >> 16);
    return make_float2((float)T(lo), (float)T(hi));
}

/* The mma.sync m16n8k16 fragments of a warp (lane = 4 * g + t): C element i of an m16n8 tile is
   row g + 8 * (i / 2), column 2 * t + i % 2. acc[MT][NT][4] is a warp's 16*MT x 8*NT block. */
__device__ __forceinline__ int uly__frag_row(int i) {
    return (int)(uly_lane_id() >> 2) + 8 * (i >> 1);
}
__device__ __forceinline__ int uly__frag_col(int i) {
    return 2 * (int)(uly_lane_id() & 3) + (i & 1);
}

/* Writes the warp's fragments as T to the W-wide tile at s, the block at rows r0, columns c0. */
template <typename T, int W, int MT, int NT>
__device__ __forceinline__ void uly__frag_store(unsigned char *s, int r0, int c0,
                                                const float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const int r = r0 + 16 * mt + uly__frag_row(i), c = c0 + 8 * nt + uly__frag_col(i);
                *(uint32_t *)(s + uly__swz<W>(r, c >> 3) + (c & 7) * 2) =
                    uly__pack2<T>(acc[mt][nt][i], acc[mt][nt][i + 1]);
            }
}

/* ldmatrix.x4 of the 16 x 16 block at (r0, c0) of a W-wide tile. ROWS_FIRST orders the four
   8 x 8 matrices (r0, c0), (r0 + 8, c0), (r0, c0 + 8), (r0 + 8, c0 + 8); else columns first. */
template <int W, bool TRANS, bool ROWS_FIRST>
__device__ __forceinline__ void uly__ldsm(uint32_t f[4], uint32_t s, int r0, int c0) {
    const int l = (int)uly_lane_id();
    const int r = ROWS_FIRST ? (l & 15) : (l & 7) + ((l >> 4) << 3);
    const int c = ROWS_FIRST ? (l >> 4) : ((l >> 3) & 1);
    uly_ldmatrix<4, TRANS>(f, s + uly__swz<W>(r0 + r, (c0 >> 3) + c));
}

/* The A fragment (rows m0.., k k0..k0+15) of a tile stored [m][k], or [k][m] if A_T. */
template <int W, bool A_T>
__device__ __forceinline__ void uly__frag_a(uint32_t f[4], uint32_t s, int m0, int k0) {
    if (A_T) uly__ldsm<W, true, false>(f, s, k0, m0);
    else uly__ldsm<W, false, true>(f, s, m0, k0);
}

/* The B fragments of n-tiles n0 (f[0..1]) and n0 + 8 (f[2..3]), k k0..k0+15, of a tile stored
   [n][k], or [k][n] if B_T. */
template <int W, bool B_T>
__device__ __forceinline__ void uly__frag_b(uint32_t f[4], uint32_t s, int n0, int k0) {
    if (B_T) uly__ldsm<W, true, true>(f, s, k0, n0);
    else uly__ldsm<W, false, false>(f, s, n0, k0);
}

/* acc[q] += A_q * B_q over k in [0, K) for the NP products q: A_q's rows m0.. from the WA-wide
   tile at sa + q * da, B_q's columns n0.. from the WB-wide tile at sb + q * db. Products of one
   shape share their fragment addresses, and a warp has NP times the independent MMAs in
   flight. U k-steps are unrolled (all by default); fewer keep fewer fragment addresses live,
   where a kernel's accumulators leave little room. each(j) runs after k-step j: work to
   interleave with the MMAs. */
struct uly__no_step {
    __device__ void operator()(int) const {}
};
template <typename T, int NP, int MT, int NT, int K, int WA, bool A_T, int WB, bool B_T,
          int U = K / 16, typename Step = uly__no_step>
__device__ __forceinline__ void uly__mma_ss_n(float (&acc)[NP][MT][NT][4], uint32_t sa,
                                              uint32_t da, int m0, uint32_t sb, uint32_t db,
                                              int n0, Step each = Step()) {
    static_assert(NT % 2 == 0 && K % 16 == 0, "whole ldmatrix.x4 blocks");
#pragma unroll (U)
    for (int k = 0; k < K; k += 16) {
        uint32_t a[NP][MT][4];
#pragma unroll
        for (int q = 0; q < NP; q++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                uly__frag_a<WA, A_T>(a[q][mt], sa + q * da, m0 + 16 * mt, k);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            uint32_t b[NP][4];
#pragma unroll
            for (int q = 0; q < NP; q++) uly__frag_b<WB, B_T>(b[q], sb + q * db, n0 + 8 * nt, k);
#pragma unroll
            for (int q = 0; q < NP; q++)
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    uly_mma_m16n8k16<T>(acc[q][mt][nt], a[q][mt], b[q], acc[q][mt][nt]);
                    uly_mma_m16n8k16<T>(acc[q][mt][nt + 1], a[q][mt], b[q] + 2,
                                        acc[q][mt][nt + 1]);
                }
        }
        each(k / 16);
    }
}

/* acc += A * B: one product of uly__mma_ss_n. */
template <typename T, int MT, int NT, int K, int WA, bool A_T, int WB, bool B_T, int U = K / 16>
__device__ __forceinline__ void uly__mma_ss(float (&acc)[MT][NT][4], uint32_t sa, int m0,
                                            uint32_t sb, int n0) {
    uly__mma_ss_n<T, 1, MT, NT, K, WA, A_T, WB, B_T, U>(
        reinterpret_cast<float (&)[1][MT][NT][4]>(acc), sa, 0, m0, sb, 0, n0);
}

/* A warp's fp32 C fragments (16*MT x 8*NT) rounded to T as A fragments: the C fragments of
   n-tiles 2j and 2j + 1 are exactly the A fragment of k-step j. */
template <typename T, int MT, int NT>
__device__ __forceinline__ void uly__frag_to_a(uint32_t (&a)[MT][NT / 2][4],
                                               const float (&c)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NT / 2; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                a[mt][j][i] = uly__pack2<T>(c[mt][2 * j + i / 2][i % 2 * 2],
                                            c[mt][2 * j + i / 2][i % 2 * 2 + 1]);
}

/* acc += A * B over K values of k, A in registers (from uly__frag_to_a), B's rows k0.. and
   columns n0.. from a WB-wide tile stored [k][n]. */
template <typename T, int MT, int NT, int K, int WB>
__device__ __forceinline__ void uly__mma_rs(float (&acc)[MT][NT][4],
                                            const uint32_t (&a)[MT][K / 16][4], uint32_t sb,
                                            int n0, int k0) {
    static_assert(NT % 2 == 0 && K % 16 == 0, "whole ldmatrix.x4 blocks");
#pragma unroll
    for (int j = 0; j < K / 16; j++)
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            uint32_t b[4];
            uly__frag_b<WB, true>(b, sb, n0 + 8 * nt, k0 + 16 * j);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uly_mma_m16n8k16<T>(acc[mt][nt], a[mt][j], b, acc[mt][nt]);
                uly_mma_m16n8k16<T>(acc[mt][nt + 1], a[mt][j], b + 2, acc[mt][nt + 1]);
            }
        }
}

template <int MT, int NT>
__device__ __forceinline__ void uly__frag_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.f;
}

/* Sets to -inf the elements whose (row, column) `masked` rejects; r0, c0 are the positions of
   the warp's block. */
template <int MT, int NT, typename Pred>
__device__ __forceinline__ void uly__mask(float (&s)[MT][NT][4], int r0, int c0, Pred masked) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (masked(r0 + 16 * mt + uly__frag_row(i), c0 + 8 * nt + uly__frag_col(i)))
                    s[mt][nt][i] = -INFINITY;
}

/* The four lanes of a quad hold one row's columns. */
__device__ __forceinline__ float uly__quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float uly__quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* FlashAttention's online softmax over the 2*MT rows this thread holds (row h of m-tile mt is
   C elements 2h, 2h + 1): running max m of the raw logits, running sum l of this lane's columns
   (the quad's partial sums are added once, in finish). */
template <int MT> struct uly__online_softmax {
    float m[MT][2], l[MT][2];

    __device__ __forceinline__ uly__online_softmax() {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) m[mt][h] = -INFINITY, l[mt][h] = 0.f;
    }

    /* s (a key block's logits, masked ones -inf) becomes P = exp(scale * (s - m)); o, the output
       so far, is rescaled by exp(scale * (m_old - m_new)). */
    template <int NS, int NO>
    __device__ __forceinline__ void update(float (&s)[MT][NS][4], float (&o)[MT][NO][4],
                                           float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float mx = m[mt][h];
#pragma unroll
                for (int nt = 0; nt < NS; nt++)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                mx = uly__quad_max(mx);
                /* A row with no key so far keeps m = -inf: subtract 0 so exp2 gives 0, not NaN. */
                const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
                const float corr = uly_ex2(m[mt][h] * scale_log2 - base);
                m[mt][h] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NS; nt++)
#pragma unroll
                    for (int i = 2 * h; i < 2 * h + 2; i++) {
                        s[mt][nt][i] = uly_ex2(fmaf(s[mt][nt][i], scale_log2, -base));
                        sum += s[mt][nt][i];
                    }
                l[mt][h] = l[mt][h] * corr + sum;
#pragma unroll
                for (int nt = 0; nt < NO; nt++)
                    o[mt][nt][2 * h] *= corr, o[mt][nt][2 * h + 1] *= corr;
            }
    }

    /* o /= l; lse = scale * m + log(l), or o = 0 and lse = +inf for a row with no key. */
    template <int NO>
    __device__ __forceinline__ void finish(float (&o)[MT][NO][4], float scale,
                                           float (&lse)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float l_row = uly__quad_sum(l[mt][h]);
                const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
                lse[mt][h] = l_row > 0.f ? m[mt][h] * scale + logf(l_row) : INFINITY;
#pragma unroll
                for (int nt = 0; nt < NO; nt++)
                    o[mt][nt][2 * h] *= inv, o[mt][nt][2 * h + 1] *= inv;
            }
    }
};

/* The softmax backward, in place: s (logits) becomes P = exp(scale * s - lse) and dp becomes
   dS = P * (dP - Dsum). query(mt, nt, i) gives the (lse * log2(e), Dsum) of element i's query;
   lse = +inf (a fully masked row, or a row past the end) gives P = 0 and dS = 0. */
template <int MT, int NT, typename Query>
__device__ __forceinline__ void uly__softmax_grad(float (&s)[MT][NT][4], float (&dp)[MT][NT][4],
                                                  float scale_log2, Query query) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 q = query(mt, nt, i);
                const float p = uly_ex2(fmaf(s[mt][nt][i], scale_log2, -q.x));
                s[mt][nt][i] = p;
                dp[mt][nt][i] = p * (dp[mt][nt][i] - q.y);
            }
}

template <int MT, int NT>
__device__ __forceinline__ void uly__frag_scale(float (&acc)[MT][NT][4], float x) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][nt][i] *= x;
}

/* The causal mask is bottom-right aligned: row i of a sequence of sq queries and sk keys keeps
   keys j <= i + diag, diag = sk - sq. The helpers take plain values: given the parameter and
   sequence structs instead, nvcc spilled registers in the D = 64 forward. */

/* Key blocks of BN that query rows [m0, m0 + BM) see: all, or (causal) those up to the last
   row's diagonal. */
template <int BM, int BN>
__device__ __forceinline__ int uly__fa_key_blocks(bool causal, int sk, int diag, int m0) {
    const int n_end = causal ? min(sk, m0 + BM + diag) : sk;
    return n_end > 0 ? (n_end + BN - 1) / BN : 0;
}

/* The logits of query rows from m0 and keys [n0, n0 + BN), of which this warp holds the block
   at (r0, c0): keys past the sequence and (causal) past a row's diagonal become -inf. A block
   that reaches neither is left as it is. */
template <int BN, int MT, int NT>
__device__ __forceinline__ void uly__fa_mask(float (&sc)[MT][NT][4], bool causal, int sk,
                                             int diag, int m0, int n0, int r0, int c0) {
    if (n0 + BN > sk || (causal && n0 + BN - 1 > m0 + diag))
        uly__mask(sc, r0, c0, [=](int r, int c) { return c >= sk || (causal && c > r + diag); });
}

/* The block's output rows [m0, m0 + BM) of head h, from each warp's fragments (its rows from
   wm): staged as T over the Q tile at smem once every warp is done with it, then stored as
   whole rows. */
template <typename T, int BM, int D, int THREADS, int MT>
__device__ __forceinline__ void uly__fa_store_rows(const float (&acc)[MT][D / 8][4],
                                                   const uly_tensor &t, const uly__fa_seq &s,
                                                   int64_t h, int m0, int wm,
                                                   unsigned char *smem) {
    uly_cp_async_wait_all();
    __syncthreads(); /* every warp is done with Q */
    uly__frag_store<T, D>(smem, wm, 0, acc);
    __syncthreads();
    uly__tile_store<BM, D, THREADS>(uly__row<T>(t, s.b, s.q0 + m0, h), t.ss, s.sq - m0, smem);
}

#define ULY__LOG2E 1.4426950408889634f

/* ---------------------------------------------------------------------------------------------
   Flash attention kernels */

/* Forward. Grid (H, B, query blocks). */
template <typename T, int D>
__global__ void __launch_bounds__(uly__fa_traits<D>::fwd::WARPS * 32)
    uly__flash_fwd(const uly__fa_params p) {
    using C = typename uly__fa_traits<D>::fwd;
    constexpr int BM = C::BM, BN = C::BN, THREADS = C::WARPS * 32, MT = BM / (16 * C::WARPS);
    const uly__fa_seq s = uly__fa_seq_of(p, uly__fa_y(p));
    const int m0 = uly__fa_query_block(p) * BM;
    if (m0 >= s.sq) return;
    const int64_t h = blockIdx.x, hk = uly__kv_head(p.q_head0, p.kv_group, h);
    const T *k = uly__row<T>(p.k, s.b, s.k0, hk), *v = uly__row<T>(p.v, s.b, s.k0, hk);

    ULY_DYN_SMEM(unsigned char, smem); /* Q [BM][D], K [BN][D], V [BN][D] */
    const uint32_t sQ = uly_smem_addr(smem), sK = sQ + BM * D * 2, sV = sK + BN * D * 2;
    const int wm = (int)(threadIdx.x / 32) * 16 * MT; /* this warp's first row */
    const int diag = s.sk - s.sq;
    const int n_blocks = uly__fa_key_blocks<BM, BN>(p.causal, s.sk, diag, m0);

    uly__tile_load<BM, D, THREADS>(sQ, uly__row<T>(p.q, s.b, s.q0 + m0, h), p.q.ss, s.sq - m0);
    if (n_blocks > 0) {
        const int n0 = (n_blocks - 1) * BN;
        uly__tile_load<BN, D, THREADS>(sK, k + n0 * p.k.ss, p.k.ss, s.sk - n0);
    }
    uly_cp_async_commit();

    float o[MT][D / 8][4];
    uly__frag_zero(o);
    uly__online_softmax<MT> softmax;
    for (int j = n_blocks - 1; j >= 0; j--) {
        const int n0 = j * BN;
        uly_cp_async_wait_all();
        __syncthreads(); /* K[j] is in; every warp is done with V[j + 1] */
        uly__tile_load<BN, D, THREADS>(sV, v + n0 * p.v.ss, p.v.ss, s.sk - n0);
        uly_cp_async_commit();

        float sc[MT][BN / 8][4];
        uly__frag_zero(sc);
        uly__mma_ss<T, MT, BN / 8, D, D, false, D, false>(sc, sQ, wm, sK, 0);
        uly__fa_mask<BN>(sc, p.causal, s.sk, diag, m0, n0, m0 + wm, n0);
        softmax.update(sc, o, p.scale_log2);

        uly_cp_async_wait_all();
        __syncthreads(); /* V[j] is in; every warp is done with K[j] */
        if (j > 0)
            uly__tile_load<BN, D, THREADS>(sK, k + (n0 - BN) * p.k.ss, p.k.ss, s.sk - n0 + BN);
        uly_cp_async_commit();
        uint32_t pa[MT][BN / 16][4];
        uly__frag_to_a<T>(pa, sc);
        uly__mma_rs<T, MT, D / 8, BN, D>(o, pa, sV, 0, 0);
    }

    float lse[MT][2];
    softmax.finish(o, p.scale, lse);
    if ((uly_lane_id() & 3) == 0)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = wm + 16 * mt + uly__frag_row(2 * hf);
                if (m0 + r < s.sq) p.lse[uly__fa_qrow(p, s, h, m0 + r)] = lse[mt][hf];
            }
    uly__fa_store_rows<T, BM, D, THREADS>(o, p.o, s, h, m0, wm, smem);
}

/* The row passes (the backward's pre- and post-pass): one warp a query row, ULY__ROW_WARPS rows
   a block, grid (query rows / ULY__ROW_WARPS, H, sequences). They move rows in 16-byte chunks
   (D % 8 == 0: uly__fa_setup and uly__lt_check require it). */
enum { ULY__ROW_WARPS = 4 };

/* Backward pre-pass: Dsum = rowsum(dout * out) in fp32, and the row's dQ accumulator cleared
   (when there is one). */
template <typename T>
__global__ void __launch_bounds__(ULY__ROW_WARPS * 32) uly__flash_bwd_pre(const uly__fa_params p) {
    const uly__fa_seq s = uly__fa_seq_of(p, uly__fa_z(p));
    const int row = (int)(blockIdx.x * ULY__ROW_WARPS + threadIdx.x / 32);
    const int lane = (int)(threadIdx.x & 31);
    if (row >= s.sq) return;
    const int64_t h = uly__fa_y(p), d = p.q.d, i = uly__fa_qrow(p, s, h, row);
    const T *o = uly__row<T>(p.o, s.b, s.q0 + row, h);
    const T *dout = uly__row<T>(p.dout, s.b, s.q0 + row, h);
    float acc = 0.f;
    for (int64_t c = 8 * lane; c < d; c += 256) {
        const uint4 ua = *(const uint4 *)(o + c), ub = *(const uint4 *)(dout + c);
        const uint32_t wa[4] = {ua.x, ua.y, ua.z, ua.w}, wb[4] = {ub.x, ub.y, ub.z, ub.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 a = uly__unpack2<T>(wa[e]), b = uly__unpack2<T>(wb[e]);
            acc = fmaf(a.y, b.y, fmaf(a.x, b.x, acc));
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) p.dsum[i] = acc;
    if (p.dq_acc)
        for (int64_t c = 4 * lane; c < d; c += 128)
            *(float4 *)(p.dq_acc + i * d + c) = make_float4(0.f, 0.f, 0.f, 0.f);
}

/* Backward post-pass: dq = scale * dQ accumulator, in T. */
template <typename T>
__global__ void __launch_bounds__(ULY__ROW_WARPS * 32) uly__flash_bwd_post(const uly__fa_params p) {
    const uly__fa_seq s = uly__fa_seq_of(p, uly__fa_z(p));
    const int row = (int)(blockIdx.x * ULY__ROW_WARPS + threadIdx.x / 32);
    const int lane = (int)(threadIdx.x & 31);
    if (row >= s.sq) return;
    const int64_t h = uly__fa_y(p), d = p.q.d, i = uly__fa_qrow(p, s, h, row);
    T *dq = uly__row<T>(p.dq, s.b, s.q0 + row, h);
    for (int64_t c = 8 * lane; c < d; c += 256) {
        const float4 x = *(const float4 *)(p.dq_acc + i * d + c);
        const float4 y = *(const float4 *)(p.dq_acc + i * d + c + 4);
        float v[8];
        uint32_t w[4];
        memcpy(v, &x, 16);
        memcpy(v + 4, &y, 16);
#pragma unroll
        for (int e = 0; e < 4; e++)
            w[e] = uly__pack2<T>(v[2 * e] * p.scale, v[2 * e + 1] * p.scale);
        *(uint4 *)(dq + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* Backward main kernel: a block owns BN keys of one kv head; grid (Hkv, B, key blocks), which
   starts the longest blocks first (above uly__fa_query_block). For each query head of the kv
   head's group and each query block that sees these keys:
       S = Q K^T and dP = dO V^T, then P and dS = P * (dP - Dsum) into shared memory;
       (DQ_ATOMIC) dQ = dS K, added into the fp32 accumulator while
       dV += P^T dO and dK += dS^T Q run (in registers).
   Each product has its own warp grid of 32-row blocks (S and dP over (m, n), dK and dV over
   (n, d), dQ over (m, d)), so each operand tile is read by few warps. The alternative, keys as
   the rows of every product so that P^T and dS^T feed dV and dK from registers, has every warp
   read all of Q and dO: at D = 128 that is 1664 ldmatrix.x4 per query block against 1152 here
   plus 2 * BM * BN stores, and shared-memory traffic is the larger of this kernel's two floors
   (bench/RESULTS.md). */
template <typename T, int D, bool DQ_ATOMIC>
__global__ void __launch_bounds__(uly__fa_traits<D>::bwd_kv::WARPS * 32)
    uly__flash_bwd_kv(const uly__fa_params p) {
    using C = typename uly__fa_traits<D>::bwd_kv;
    constexpr int BM = C::BM, BN = C::BN, THREADS = C::WARPS * 32;
    constexpr int SW = BM / 32, SN = BN * SW / C::WARPS; /* S, dP: SW warps along m, SN keys each */
    constexpr int KW = BN / 32, KN = D * KW / C::WARPS;  /* dK, dV: KW warps along n, KN dims */
    constexpr int QW = BM / 32, QN = D * QW / C::WARPS;  /* dQ: QW warps along m, QN dims each */
    static_assert(SN % 16 == 0 && KN % 16 == 0 && QN % 16 == 0, "whole ldmatrix.x4 blocks");
    static_assert(BM <= THREADS, "a thread loads at most one query row's lse and Dsum");
    const uly__fa_seq s = uly__fa_seq_of(p, uly__fa_y(p));
    const int n0 = uly__fa_z(p) * BN; /* the first key block first */
    if (n0 >= s.sk) return;
    const int64_t hk = blockIdx.x;
    const uly__head_span heads = uly__q_heads(p.q_head0, p.kv_group, hk, p.q.h);
    const int64_t h_begin = heads.first, h_end = heads.end;
    const int diag = s.sk - s.sq;
    const int m_begin = p.causal ? max(0, n0 - diag) / BM * BM : 0; /* first row seeing key n0 */
    const int m_blocks = s.sq > m_begin ? (s.sq - m_begin + BM - 1) / BM : 0;
    /* query blocks, head by head; none for a kv head that no local query head reads */
    const int64_t iters = max((int64_t)0, h_end - h_begin) * m_blocks;

    ULY_DYN_SMEM(unsigned char, smem); /* K, V [BN][D]; Q [2][BM][D]; dO [2][BM][D]; P, dS
                                          [BM][BN]; lse, Dsum [2][2][BM] (stage, which, row) */
    const uint32_t sK = uly_smem_addr(smem), sV = sK + BN * D * 2;
    const uint32_t sQ0 = sV + BN * D * 2, sdO0 = sQ0 + 2 * BM * D * 2, sP = sdO0 + 2 * BM * D * 2;
    const uint32_t sdS = sP + BM * BN * 2, sRows = sdS + BM * BN * 2;
    unsigned char *P_tile = smem + (sP - sK), *dS_tile = P_tile + BM * BN * 2;
    const float *rows = (const float *)(dS_tile + BM * BN * 2); /* [2][2][BM] */
    const int warp = (int)(threadIdx.x / 32);
    const int sm = warp % SW * 32, sn = warp / SW * SN;
    const int kn = warp % KW * 32, kd = warp / KW * KN;
    const int qm = warp % QW * 32, qd = warp / QW * QN;

    auto load_queries = [&](int64_t h, int m0, int stage) {
        uly__tile_load<BM, D, THREADS>(sQ0 + stage * BM * D * 2,
                                       uly__row<T>(p.q, s.b, s.q0 + m0, h), p.q.ss, s.sq - m0);
        uly__tile_load<BM, D, THREADS>(sdO0 + stage * BM * D * 2,
                                       uly__row<T>(p.dout, s.b, s.q0 + m0, h), p.dout.ss,
                                       s.sq - m0);
        /* lse and Dsum by cp.async too, one row a thread (BM <= THREADS): a plain load would stall
           its warp for the whole memory latency before the next MMA. Rows past the end read
           nothing; the row table below gives them lse = +inf. */
        const int r = (int)threadIdx.x;
        if (r < BM) {
            const bool ok = m0 + r < s.sq;
            const int64_t i = uly__fa_qrow(p, s, h, ok ? m0 + r : m0);
            const uint32_t at = sRows + (stage * 2 * BM + r) * 4;
            uly_cp_async<4>(at, p.lse + i, ok ? 4 : 0);
            uly_cp_async<4>(at + BM * 4, p.dsum + i, ok ? 4 : 0);
        }
    };

    uly__tile_load<BN, D, THREADS>(sK, uly__row<T>(p.k, s.b, s.k0 + n0, hk), p.k.ss, s.sk - n0);
    uly__tile_load<BN, D, THREADS>(sV, uly__row<T>(p.v, s.b, s.k0 + n0, hk), p.v.ss, s.sk - n0);
    if (iters > 0) load_queries(h_begin, m_begin, 0);
    uly_cp_async_commit();

    float dvk[2][2][KN / 8][4]; /* dV, dK */
    uly__frag_zero(dvk[0]);
    uly__frag_zero(dvk[1]);
    int64_t h = h_begin; /* this iteration's query block (h, m0), then the next one's */
    int m0 = m_begin;
    for (int64_t it = 0; it < iters; it++) {
        const int stage = (int)(it & 1);
        const bool wrap = m0 + BM >= s.sq;
        const int64_t h_next = wrap ? h + 1 : h;
        const int m_next = wrap ? m_begin : m0 + BM;
        const uint32_t sQ = sQ0 + stage * BM * D * 2, sdO = sdO0 + stage * BM * D * 2;
        const float *lse = rows + stage * 2 * BM, *dsum = lse + BM;
        uly_cp_async_wait_all();
        __syncthreads(); /* this stage is in; every warp is done with the other one, P and dS */
        if (it + 1 < iters) load_queries(h_next, m_next, stage ^ 1);
        uly_cp_async_commit();

        /* S and dP, then dV and dK, as pairs of products that share their fragment addresses.
           At D = 128 dK and dV take 128 of the 255 registers and S and dP 64, so S and dP (and
           dQ) unroll 4 of their 8 k-steps: the other steps' fragment addresses are recomputed
           rather than held, and D = 128 fits without spills. */
        float sdp[2][2][SN / 8][4];
        uly__frag_zero(sdp[0]);
        uly__frag_zero(sdp[1]);
        uly__mma_ss_n<T, 2, 2, SN / 8, D, D, false, D, false, 4>(sdp, sQ, sdO - sQ, sm, sK,
                                                                  sV - sK, sn);
        float(&sc)[2][SN / 8][4] = sdp[0];
        float(&dp)[2][SN / 8][4] = sdp[1];
        uly__fa_mask<BN>(sc, p.causal, s.sk, diag, m0, n0, m0 + sm, n0 + sn);
        float2 row[2][2]; /* (lse * log2(e), Dsum) of this thread's rows; past the end P = 0 */
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = sm + 16 * mt + uly__frag_row(2 * hf);
                row[mt][hf] = m0 + r < s.sq ? make_float2(lse[r] * ULY__LOG2E, dsum[r])
                                            : make_float2(INFINITY, 0.f);
            }
        uly__softmax_grad(sc, dp, p.scale_log2,
                          [&](int mt, int, int i) { return row[mt][i >> 1]; });
        uly__frag_store<T, BN>(P_tile, sm, sn, sc);
        uly__frag_store<T, BN>(dS_tile, sm, sn, dp);
        __syncthreads(); /* P and dS are complete */
        auto dv_dk = [&](auto each) {
            uly__mma_ss_n<T, 2, 2, KN / 8, BM, BN, true, D, true>(dvk, sP, sdS - sP, kn, sdO,
                                                                  sQ - sdO, kd, each);
        };
        if constexpr (DQ_ATOMIC) {
            /* dQ = dS K into the fp32 accumulator, by REDs spread over dV and dK's k-steps:
               issued back to back they filled the memory pipe's queue, and the ldmatrix behind
               them waited. Every add is an immediate offset from one base. */
            float dq[2][QN / 8][4];
            uly__frag_zero(dq);
            uly__mma_ss<T, 2, QN / 8, BN, BN, false, D, true, 4>(dq, sdS, qm, sK, qd);
            const int r = qm + uly__frag_row(0);
            float *acc = p.dq_acc + (uly__fa_qrow(p, s, h, m0) + r) * D + qd + uly__frag_col(0);
            static_assert(BM / 16 == 4, "one k-step of dV and dK per row group of dQ");
            dv_dk([&](int j) { /* the warp's rows 8 j .. 8 j + 7, this thread's r + 8 j */
                const int mt = j >> 1, hf = j & 1;
                const bool on = m0 + r + 16 * mt + 8 * hf < s.sq;
#pragma unroll
                for (int nt = 0; nt < QN / 8; nt++)
                    uly_red_add2(acc + (16 * mt + 8 * hf) * D + 8 * nt, dq[mt][nt][2 * hf],
                                 dq[mt][nt][2 * hf + 1], on);
            });
        } else {
            dv_dk(uly__no_step());
        }
        h = h_next, m0 = m_next;
    }

    uly__frag_scale(dvk[1], p.scale);
    uly_cp_async_wait_all();
    __syncthreads(); /* every warp is done with K and V: stage dK and dV there */
    uly__frag_store<T, D>(smem, kn, kd, dvk[1]);
    uly__frag_store<T, D>(smem + BN * D * 2, kn, kd, dvk[0]);
    __syncthreads();
    uly__tile_store<BN, D, THREADS>(uly__row<T>(p.dk, s.b, s.k0 + n0, hk), p.dk.ss, s.sk - n0,
                                    smem);
    uly__tile_store<BN, D, THREADS>(uly__row<T>(p.dv, s.b, s.k0 + n0, hk), p.dv.ss, s.sk - n0,
                                    smem + BN * D * 2);
}

/* Deterministic dQ: a block owns BM query rows; grid (H, B, query blocks). Over the key blocks
   in order: S = Q K^T, dP = dO V^T, P and dS, dQ += dS K, in registers; dq = scale * dQ. */
template <typename T, int D>
__global__ void __launch_bounds__(uly__fa_traits<D>::bwd_q::WARPS * 32)
    uly__flash_bwd_q(const uly__fa_params p) {
    using C = typename uly__fa_traits<D>::bwd_q;
    constexpr int BM = C::BM, BN = C::BN, THREADS = C::WARPS * 32, MT = BM / (16 * C::WARPS);
    const uly__fa_seq s = uly__fa_seq_of(p, uly__fa_y(p));
    const int m0 = uly__fa_query_block(p) * BM;
    if (m0 >= s.sq) return;
    const int64_t h = blockIdx.x, hk = uly__kv_head(p.q_head0, p.kv_group, h);
    const T *k = uly__row<T>(p.k, s.b, s.k0, hk), *v = uly__row<T>(p.v, s.b, s.k0, hk);

    ULY_DYN_SMEM(unsigned char, smem); /* Q, dO [BM][D]; K [2][BN][D]; V [2][BN][D] */
    const uint32_t sQ = uly_smem_addr(smem), sdO = sQ + BM * D * 2, sK0 = sdO + BM * D * 2;
    const uint32_t sV0 = sK0 + 2 * BN * D * 2;
    const int wm = (int)(threadIdx.x / 32) * 16 * MT;
    const int diag = s.sk - s.sq;
    const int n_blocks = uly__fa_key_blocks<BM, BN>(p.causal, s.sk, diag, m0);

    float lse2[MT][2], dsum[MT][2]; /* of this thread's rows */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int r = m0 + wm + 16 * mt + uly__frag_row(2 * hf);
            const int64_t i = uly__fa_qrow(p, s, h, r);
            lse2[mt][hf] = r < s.sq ? p.lse[i] * ULY__LOG2E : INFINITY;
            dsum[mt][hf] = r < s.sq ? p.dsum[i] : 0.f;
        }

    auto load_keys = [&](int j, int stage) {
        const int n0 = j * BN;
        uly__tile_load<BN, D, THREADS>(sK0 + stage * BN * D * 2, k + n0 * p.k.ss, p.k.ss,
                                       s.sk - n0);
        uly__tile_load<BN, D, THREADS>(sV0 + stage * BN * D * 2, v + n0 * p.v.ss, p.v.ss,
                                       s.sk - n0);
    };
    uly__tile_load<BM, D, THREADS>(sQ, uly__row<T>(p.q, s.b, s.q0 + m0, h), p.q.ss, s.sq - m0);
    uly__tile_load<BM, D, THREADS>(sdO, uly__row<T>(p.dout, s.b, s.q0 + m0, h), p.dout.ss,
                                   s.sq - m0);
    if (n_blocks > 0) load_keys(0, 0);
    uly_cp_async_commit();

    float dq[MT][D / 8][4];
    uly__frag_zero(dq);
    for (int j = 0; j < n_blocks; j++) {
        const int stage = j & 1, n0 = j * BN;
        const uint32_t sK = sK0 + stage * BN * D * 2, sV = sV0 + stage * BN * D * 2;
        uly_cp_async_wait_all();
        __syncthreads(); /* this stage is in; every warp is done with the other one */
        if (j + 1 < n_blocks) load_keys(j + 1, stage ^ 1);
        uly_cp_async_commit();

        float sc[MT][BN / 8][4], dp[MT][BN / 8][4];
        uly__frag_zero(sc);
        uly__frag_zero(dp);
        uly__mma_ss<T, MT, BN / 8, D, D, false, D, false>(sc, sQ, wm, sK, 0);
        uly__mma_ss<T, MT, BN / 8, D, D, false, D, false>(dp, sdO, wm, sV, 0);
        uly__fa_mask<BN>(sc, p.causal, s.sk, diag, m0, n0, m0 + wm, n0);
        uly__softmax_grad(sc, dp, p.scale_log2, [&](int mt, int, int i) {
            return make_float2(lse2[mt][i >> 1], dsum[mt][i >> 1]);
        });
        uint32_t dsa[MT][BN / 16][4];
        uly__frag_to_a<T>(dsa, dp);
        uly__mma_rs<T, MT, D / 8, BN, D>(dq, dsa, sK, 0, 0);
    }

    uly__frag_scale(dq, p.scale);
    uly__fa_store_rows<T, BM, D, THREADS>(dq, p.dq, s, h, m0, wm, smem);
}

/* ---------------------------------------------------------------------------------------------
   Flash attention launchers */

/* Dsum (fp32, one per query row and head), then the fp32 dQ accumulator unless deterministic.
   A varlen batch is one sequence of total_q rows, so the same count serves both. -1 where a
   size overflows int64. */
static int64_t uly__fa_rows(const uly_attn_args *a) {
    return uly__mul(uly__mul(a->q.b, a->q.h), a->q.s);
}
static int64_t uly__fa_dsum_bytes(const uly_attn_args *a) {
    return uly__align(uly__mul(uly__fa_rows(a), 4));
}
static int64_t uly__fa_workspace(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    if (!a) return -1;
    const int64_t acc = uly__align(uly__mul(uly__mul(uly__fa_rows(a), a->q.d), 4));
    return uly__add(uly__fa_dsum_bytes(a), a->deterministic ? 0 : acc);
}

/* The flash kernels and the backward pre- and post-passes move 16-byte chunks of rows. The
   stride of a dim of extent 1 is never applied (a decode step's [B, 1, H, D] view may have any
   ss), so only the others must keep rows aligned. */
static uly_status uly__fa_rows16(const uly_tensor &t, const char *name) {
    ULY__CHECK((uintptr_t)t.data % 16 == 0 && (t.b == 1 || t.sb % 8 == 0) &&
                   (t.s == 1 || t.ss % 8 == 0) && (t.h == 1 || t.sh % 8 == 0),
               ULY_EUNSUPPORTED, "%s: rows move in 16-byte chunks: the address must be 16-byte "
               "aligned and the strides (of dims longer than 1) multiples of 8 elements", name);
    return uly__ok();
}

/* Whether the current GPU gives a block the shared memory of the call's largest kernel (the
   dK/dV kernel's, backward; the dQ kernel's is less): a GPU with less refuses the call before
   anything runs, and the layer's check before anything is exchanged. */
static_assert(uly__fa_bwd_q_smem<64>() <= uly__fa_bwd_kv_smem<64>() &&
                  uly__fa_bwd_q_smem<128>() <= uly__fa_bwd_kv_smem<128>(),
              "the dK/dV kernel needs the most shared memory of the backward");
static uly_status uly__fa_smem_fits(int64_t d, int backward) {
    const char *name = backward ? "uly__flash_bwd_kv" : "uly__flash_fwd";
    const size_t need = backward ? (d == 64 ? uly__fa_bwd_kv_smem<64>()
                                            : uly__fa_bwd_kv_smem<128>())
                                 : (d == 64 ? uly__fa_fwd_smem<64>() : uly__fa_fwd_smem<128>());
    if (need <= 48 * 1024) return uly__ok(); /* every GPU gives a block that much */
    int device = 0, most = 0;
    ULY__TRY(uly__cuda(cudaGetDevice(&device), name));
    ULY__TRY(uly__cuda(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                              device), name));
    ULY__CHECK(need <= (size_t)most, ULY_EUNSUPPORTED, "%s needs %zu bytes of shared memory per "
               "block and this GPU has %d (A100 and H100 have 163 KB and 227 KB; elsewhere "
               "uly_cublaslt_attention covers this head dim)", name, need, most);
    return uly__ok();
}

/* The kernels count a sequence's rows, and varlen's documents, in int and add two such counts
   (a row and the causal diagonal, a row and a tile), so each is at most 2^30. */
enum { ULY__FA_MAX_ROWS = 1 << 30 };

/* The contract's checks and the kernels' own (dtype, head dim, 16-byte rows, grid limits,
   varlen, shared memory), then *p: the parameters every kernel reads. */
static uly_status uly__fa_setup(const uly_attn_args *a, const uly_varlen *vl, int backward,
                                uly__fa_params *p) {
    ULY__TRY(uly__attn_check(a, backward));
    ULY__CHECK(a->q.dtype == ULY_BF16 || a->q.dtype == ULY_F16, ULY_EUNSUPPORTED,
               "dtype %s: the flash kernels take bf16 or fp16", uly__dtype_name(a->q.dtype));
    ULY__CHECK(a->q.d == 64 || a->q.d == 128, ULY_EUNSUPPORTED,
               "q.d (%lld): the flash kernels take head dims 64 and 128 (uly_cublaslt_attention "
               "takes any D <= 256, D %% 8 == 0)", ULY__LL(a->q.d));
    const uly_tensor *ts[8] = {&a->q, &a->k, &a->v, &a->o, &a->dout, &a->dq, &a->dk, &a->dv};
    const char *names[8] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < (backward ? 8 : 4); i++) ULY__TRY(uly__fa_rows16(*ts[i], names[i]));
    ULY__CHECK(a->q.s <= ULY__FA_MAX_ROWS && a->k.s <= ULY__FA_MAX_ROWS, ULY_EUNSUPPORTED,
               "q.s (%lld), k.s (%lld): at most 2^30 rows (the kernels count rows in int)",
               ULY__LL(a->q.s), ULY__LL(a->k.s));
    /* Heads are the flash grids' x, at most 2^31 - 1 blocks; sequences are counted in int. */
    ULY__CHECK(a->q.b <= INT_MAX && a->q.h <= INT_MAX && a->k.h <= INT_MAX, ULY_EUNSUPPORTED,
               "q.b (%lld), q.h (%lld), k.h (%lld): at most 2^31 - 1 each", ULY__LL(a->q.b),
               ULY__LL(a->q.h), ULY__LL(a->k.h));
    ULY__CHECK(a->softmax_scale >= 0 && isfinite(uly__scale(a) * ULY__LOG2E), ULY_EUNSUPPORTED,
               "softmax_scale (%g): the flash kernels take a scale >= 0 (0: 1/sqrt(D)) whose "
               "product with log2(e) is a finite float", (double)a->softmax_scale);
    if (backward) ULY__TRY(uly__check_workspace(a, uly__fa_workspace(NULL, a), 16));
    ULY__CHECK(!vl || ((uintptr_t)vl->cu_seqlens_q % 4 == 0 &&
                       (uintptr_t)vl->cu_seqlens_k % 4 == 0),
               ULY_EINVAL, "varlen: cu_seqlens_q and cu_seqlens_k must be 4-byte aligned (int32)");
    ULY__CHECK(!vl || (a->q.b == 1 && vl->batch >= 1 && vl->cu_seqlens_q && vl->cu_seqlens_k &&
                       vl->max_seqlen_q >= 0 && vl->max_seqlen_q <= a->q.s &&
                       vl->max_seqlen_k >= 0 && vl->max_seqlen_k <= a->k.s &&
                       vl->batch <= ULY__FA_MAX_ROWS),
               ULY_EINVAL,
               "varlen: q.b must be 1, batch in [1, 2^30], cu_seqlens_q/k set, max_seqlen_q/k "
               "within q.s/k.s");
    ULY__TRY(uly__fa_smem_fits(a->q.d, backward));
    memset(p, 0, sizeof *p);
    p->q = a->q, p->k = a->k, p->v = a->v, p->o = a->o;
    if (backward) p->dout = a->dout, p->dq = a->dq, p->dk = a->dk, p->dv = a->dv;
    p->lse = a->lse;
    p->lse_sb = a->q.h * a->q.s;
    p->lse_sh = a->q.s;
    p->cu_q = vl ? vl->cu_seqlens_q : NULL;
    p->cu_k = vl ? vl->cu_seqlens_k : NULL;
    p->sq = (int)a->q.s;
    p->sk = (int)a->k.s;
    p->q_head0 = a->q_head0;
    p->kv_group = uly__group(a);
    p->scale = uly__scale(a);
    p->scale_log2 = p->scale * ULY__LOG2E;
    p->causal = a->causal;
    if (backward) {
        p->dsum = (float *)a->workspace;
        if (!a->deterministic)
            p->dq_acc = (float *)((char *)a->workspace + uly__fa_dsum_bytes(a));
    }
    return uly__ok();
}

template <typename T> struct uly__fa_type { typedef T type; };
template <int D> struct uly__fa_dim { enum { value = D }; };

/* Calls f(uly__fa_type<T>, uly__fa_dim<D>) for the run-time dtype and head dim. */
template <typename F> static uly_status uly__fa_dispatch(uly_dtype t, int64_t d, F f) {
    if (t == ULY_BF16)
        return d == 64 ? f(uly__fa_type<__nv_bfloat16>(), uly__fa_dim<64>())
                       : f(uly__fa_type<__nv_bfloat16>(), uly__fa_dim<128>());
    return d == 64 ? f(uly__fa_type<__half>(), uly__fa_dim<64>())
                   : f(uly__fa_type<__half>(), uly__fa_dim<128>());
}

/* A grid's block count: int, as rows are at most ULY__FA_MAX_ROWS (2^30). */
static int uly__fa_cdiv(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

/* The row passes' grid (uly__flash_bwd_pre). */
static dim3 uly__fa_row_grid(int64_t heads, int batch, int64_t max_sq) {
    return dim3(uly__fa_cdiv(max_sq, ULY__ROW_WARPS), (unsigned)heads, batch);
}

/* The most blocks a launch takes along y and z: CUDA's limit. (test_flash's emulated build
   lowers it, so that its cases run in slices.) */
#ifndef ULY__FA_GRID_YZ
#define ULY__FA_GRID_YZ 65535
#endif

/* Launches kernel on grid (nothing for an empty grid) with the dynamic shared memory it asks
   (uly__fa_setup made sure the device has it); above 48 KB the kernel opts in. A grid past
   ULY__FA_GRID_YZ along y or z goes as slices, z outer and y inner: the order in which one
   grid would start its blocks. */
template <typename... P>
static uly_status uly__fa_launch(void (*kernel)(P...), const char *name, dim3 grid, int threads,
                                 size_t smem, cudaStream_t stream, uly__fa_params p) {
    if (!grid.x || !grid.y || !grid.z) return uly__ok();
    if (smem > 48 * 1024)
        ULY__TRY(uly__cuda(cudaFuncSetAttribute((const void *)kernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)smem), name));
    p.nz = (int)grid.z;
    for (int64_t z0 = 0; z0 < grid.z; z0 += ULY__FA_GRID_YZ)
        for (int64_t y0 = 0; y0 < grid.y; y0 += ULY__FA_GRID_YZ) {
            const dim3 slice(grid.x, (unsigned)uly__min(grid.y - y0, ULY__FA_GRID_YZ),
                             (unsigned)uly__min(grid.z - z0, ULY__FA_GRID_YZ));
            p.y0 = (int)y0, p.z0 = (int)z0;
            ULY_LAUNCH(kernel, slice, dim3(threads), smem, stream, p);
            ULY__TRY(uly__cuda(cudaGetLastError(), name));
        }
    return uly__ok();
}

template <typename T, int D>
static uly_status uly__fa_fwd_run(const uly__fa_params &p, int batch, int64_t max_sq, int64_t,
                                  cudaStream_t stream) {
    using F = typename uly__fa_traits<D>::fwd;
    return uly__fa_launch(uly__flash_fwd<T, D>, "uly__flash_fwd",
                          dim3((unsigned)p.q.h, batch, uly__fa_cdiv(max_sq, F::BM)), F::WARPS * 32,
                          uly__fa_fwd_smem<D>(), stream, p);
}

/* Pre-pass, then either the dK/dV kernel that also adds dQ atomically and the post-pass, or
   (deterministic) the dK/dV kernel and the dQ kernel. */
template <typename T, int D>
static uly_status uly__fa_bwd_run(const uly__fa_params &p, int batch, int64_t max_sq,
                                  int64_t max_sk, cudaStream_t stream) {
    using B = typename uly__fa_traits<D>::bwd_kv;
    using Q = typename uly__fa_traits<D>::bwd_q;
    const bool atomic = p.dq_acc != NULL;
    const dim3 rows = uly__fa_row_grid(p.q.h, batch, max_sq);
    const dim3 keys((unsigned)p.k.h, batch, uly__fa_cdiv(max_sk, B::BN));
    const size_t kv_smem = uly__fa_bwd_kv_smem<D>();
    ULY__TRY(uly__fa_launch(uly__flash_bwd_pre<T>, "uly__flash_bwd_pre", rows,
                            ULY__ROW_WARPS * 32, 0, stream, p));
    if (atomic) {
        ULY__TRY(uly__fa_launch(uly__flash_bwd_kv<T, D, true>, "uly__flash_bwd_kv", keys,
                                B::WARPS * 32, kv_smem, stream, p));
        return uly__fa_launch(uly__flash_bwd_post<T>, "uly__flash_bwd_post", rows,
                              ULY__ROW_WARPS * 32, 0, stream, p);
    }
    ULY__TRY(uly__fa_launch(uly__flash_bwd_kv<T, D, false>, "uly__flash_bwd_kv", keys,
                            B::WARPS * 32, kv_smem, stream, p));
    return uly__fa_launch(uly__flash_bwd_q<T, D>, "uly__flash_bwd_q",
                          dim3((unsigned)p.q.h, batch, uly__fa_cdiv(max_sq, Q::BM)), Q::WARPS * 32,
                          uly__fa_bwd_q_smem<D>(), stream, p);
}

/* Both directions, dense (vl NULL) or varlen. */
static uly_status uly__fa_run(const uly_attn_args *a, const uly_varlen *vl, int backward) {
    uly__fa_params p;
    ULY__TRY(uly__fa_setup(a, vl, backward, &p));
    const int batch = (int)(vl ? vl->batch : a->q.b);
    const int64_t max_sq = vl ? vl->max_seqlen_q : a->q.s, max_sk = vl ? vl->max_seqlen_k : a->k.s;
    cudaStream_t stream = (cudaStream_t)a->stream;
    if (vl) {
        ULY_LAUNCH(uly__fa_check_docs, dim3(1), dim3(256), 0, stream, p.cu_q, p.cu_k, batch, p.sq,
                   p.sk, (int)max_sq, (int)max_sk);
        ULY__TRY(uly__cuda(cudaGetLastError(), "uly__fa_check_docs"));
    }
    return uly__fa_dispatch(a->q.dtype, a->q.d, [&](auto t, auto d) {
        using T = typename decltype(t)::type;
        constexpr int D = decltype(d)::value;
        return (backward ? uly__fa_bwd_run<T, D> : uly__fa_fwd_run<T, D>)(p, batch, max_sq, max_sk,
                                                                          stream);
    });
}

static uly_status uly__fa_fwd(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    return uly__fa_run(a, NULL, 0);
}
static uly_status uly__fa_bwd(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    return uly__fa_run(a, NULL, 1);
}
static uly_status uly__fa_check(void *ctx, const uly_attn_args *a, int backward) {
    uly__fa_params p;
    (void)ctx;
    return uly__fa_setup(a, NULL, backward, &p);
}

ULYDEF uly_attn uly_flash_attention(void) {
    uly_attn at = {uly__fa_fwd, uly__fa_bwd, uly__fa_workspace, NULL, uly__fa_check, 1};
    return at;
}

static uly_status uly__fa_has_varlen(const uly_varlen *v) {
    ULY__CHECK(v, ULY_EINVAL, "varlen: the uly_varlen is NULL");
    return uly__ok();
}
static uly_status uly__fa_varlen(const uly_attn_args *a, const uly_varlen *v, int backward) {
    ULY__TRY(uly__fa_has_varlen(v));
    return uly__fa_run(a, v, backward);
}
ULYDEF uly_status uly_flash_varlen_fwd(const uly_attn_args *a, const uly_varlen *v) {
    return uly__named("uly_flash_varlen_fwd", uly__fa_varlen(a, v, 0));
}
ULYDEF uly_status uly_flash_varlen_bwd(const uly_attn_args *a, const uly_varlen *v) {
    return uly__named("uly_flash_varlen_bwd", uly__fa_varlen(a, v, 1));
}

/* The varlen calls as a uly_attn: ctx is the uly_varlen. */
static uly_status uly__fa_varlen_fwd(void *ctx, const uly_attn_args *a) {
    return uly__fa_varlen(a, (const uly_varlen *)ctx, 0);
}
static uly_status uly__fa_varlen_bwd(void *ctx, const uly_attn_args *a) {
    return uly__fa_varlen(a, (const uly_varlen *)ctx, 1);
}
static uly_status uly__fa_varlen_check(void *ctx, const uly_attn_args *a, int backward) {
    uly__fa_params p;
    ULY__TRY(uly__fa_has_varlen((const uly_varlen *)ctx));
    return uly__fa_setup(a, (const uly_varlen *)ctx, backward, &p);
}

ULYDEF uly_attn uly_flash_varlen_attention(const uly_varlen *v) {
    uly_attn at = {uly__fa_varlen_fwd, uly__fa_varlen_bwd, uly__fa_workspace, (void *)v,
                   uly__fa_varlen_check, 1};
    return at;
}

/* ---------------------------------------------------------------------------------------------
   The unfused cuBLASLt attention */

#ifdef ULYSSES_CUBLASLT

/* Score blocks are [rows, sk] with rows ld apart (uly__lt_ld): row r is query row r % sq of the
   block's head r / sq. */

/* The elementwise kernels' blocks; their grid-stride loops cover what the capped grid (many
   times any GPU's SMs) does not. */
enum { ULY__LT_THREADS = 256, ULY__LT_MAX_BLOCKS = 65535 * 16 };

/* Forward softmax, one warp per row as the flash row passes: p = exp(scale * s - lse) in T (0
   where masked), and lse unless NULL (the backward recomputes P). */
template <typename T>
__global__ void __launch_bounds__(ULY__ROW_WARPS * 32)
    uly__lt_softmax(const float *s, T *p, float *lse, int64_t lse_sh, int rows, int sq, int sk,
                    int64_t ld, float scale, int causal) {
    const int r = (int)(blockIdx.x * ULY__ROW_WARPS + threadIdx.x / 32);
    const int lane = (int)(threadIdx.x & 31);
    if (r >= rows) return;
    const int i = r % sq, keep = causal ? min(sk, i + sk - sq + 1) : sk;
    const float *row = s + r * ld;
    float mx = -INFINITY, sum = 0.f;
    for (int j = lane; j < keep; j += 32) mx = fmaxf(mx, row[j] * scale);
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    for (int j = lane; j < keep; j += 32) sum += expf(row[j] * scale - mx);
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float l = sum > 0.f ? mx + logf(sum) : INFINITY;
    for (int j = lane; j < sk; j += 32)
        p[r * ld + j] = (T)(j < keep ? expf(row[j] * scale - l) : 0.f);
    if (lane == 0 && lse) lse[r / sq * lse_sh + i] = l;
}

/* Backward softmax, elementwise over n = rows * sk: ds = scale * p * (dp - Dsum) in T. */
template <typename T>
__global__ void __launch_bounds__(ULY__LT_THREADS)
    uly__lt_softmax_grad(const T *p, const float *dp, const float *dsum, int64_t dsum_sh, T *ds,
                         int64_t n, int sq, int sk, int64_t ld, float scale) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += step) {
        const int64_t r = e / sk, at = r * ld + e % sk;
        ds[at] = (T)(scale * (float)p[at] * (dp[at] - dsum[r / sq * dsum_sh + r % sq]));
    }
}

/* fp32 [rows, d] to the rows y, y + ss, ... in T. */
template <typename T>
__global__ void __launch_bounds__(ULY__LT_THREADS)
    uly__lt_store(const float *x, T *y, int64_t ss, int64_t rows, int64_t d) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < rows * d; e += step)
        y[e / d * ss + e % d] = (T)x[e];
}

/* Blocks of ULY__LT_THREADS for n elements. */
static dim3 uly__lt_grid(int64_t n) {
    return dim3((unsigned)min((n + ULY__LT_THREADS - 1) / ULY__LT_THREADS,
                              (int64_t)ULY__LT_MAX_BLOCKS));
}

static uly_status uly__lt(cublasStatus_t e, const char *what) {
    const int unsupported = e == CUBLAS_STATUS_NOT_SUPPORTED || e == CUBLAS_STATUS_ARCH_MISMATCH;
    ULY__CHECK(e == CUBLAS_STATUS_SUCCESS, unsupported ? ULY_EUNSUPPORTED : ULY_ECUDA, "%s: %s",
               what, cublasLtGetStatusString(e));
    return uly__ok();
}

/* A row-major operand: rows x cols with leading dimension ld, batch stride in elements. */
struct uly__lt_mat {
    const void *p;
    cudaDataType_t t;
    int64_t rows, cols, ld, stride;
};

enum { ULY__LT_WS = 32 << 20 }; /* cuBLASLt's own workspace */

/* Bytes of an element: fp32, or bf16 and fp16. */
static int64_t uly__lt_size(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

/* The alignment, in bytes, that a kernel may assume of a matrix: the largest power of two up to
   256 dividing its address, leading dimension and (batched) stride. cuBLASLt's search assumes
   256 unless told, and score rows of odd length or a head's offset leave far less. */
static uint32_t uly__lt_align(const uly__lt_mat *m, int64_t ld, int batch) {
    const int64_t es = uly__lt_size(m->t);
    uint64_t x = (uint64_t)(uintptr_t)m->p | 256u | (uint64_t)(ld * es);
    if (batch > 1) x |= (uint64_t)(m->stride * es);
    return (uint32_t)(x & (~x + 1));
}

/* The search's best kernel for a product whose operands A, B and C = D (l, as cublasLtMatmul
   names them) are aligned to align[] bytes, with partial sums of a split K kept in fp32 (not in
   a 16-bit D, which would round O and dQ more than once). */
static uly_status uly__lt_search(cublasLtHandle_t lt, cublasLtMatmulDesc_t desc,
                                 cublasLtMatrixLayoutOpaque_t (&l)[3], const uint32_t (&align)[3],
                                 cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreferenceOpaque_t pref; /* descriptors live here, not in cuBLASLt's heap */
    cublasLtMatmulHeuristicResult_t best;
    int found = 0;
    const uint64_t ws_bytes = ULY__LT_WS;
    const uint32_t schemes =
        CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    const struct {
        cublasLtMatmulPreferenceAttributes_t attr;
        const void *v;
        size_t n;
    } set[] = {{CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes},
               {CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], sizeof align[0]},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], sizeof align[1]},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], sizeof align[2]},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2], sizeof align[2]}};
    ULY__TRY(uly__lt(cublasLtMatmulPreferenceInit(&pref), "cublasLtMatmulPreferenceInit"));
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++)
        ULY__TRY(uly__lt(cublasLtMatmulPreferenceSetAttribute(&pref, set[i].attr, set[i].v,
                                                              set[i].n),
                         "cublasLtMatmulPreferenceSetAttribute"));
    ULY__TRY(uly__lt(cublasLtMatmulAlgoGetHeuristic(lt, desc, &l[0], &l[1], &l[2], &l[2], &pref,
                                                    1, &best, &found),
                     "cublasLtMatmulAlgoGetHeuristic"));
    ULY__CHECK(found >= 1 && best.state == CUBLAS_STATUS_SUCCESS, ULY_EUNSUPPORTED,
               "cuBLASLt has no kernel for a product whose operands are aligned to %u, %u and %u "
               "bytes", align[0], align[1], align[2]);
    *algo = best.algo;
    return uly__ok();
}

/* D = alpha * op(A) op(B) + beta * D for `batch` row-major matrices (op transposes when t*).
   cuBLASLt is column-major, where a row-major X is X^T: so it computes D^T = op(B)^T op(A)^T. */
static uly_status uly__lt_gemm(cublasLtHandle_t lt, uly__lt_mat a, int ta, uly__lt_mat b, int tb,
                               uly__lt_mat d, float alpha, float beta, int batch, void *ws,
                               cudaStream_t stream) {
    cublasLtMatmulDescOpaque_t desc; /* descriptors live here, not in cuBLASLt's heap */
    cublasLtMatrixLayoutOpaque_t l[3];
    cublasLtMatmulAlgo_t algo;
    uint32_t align[3];
    const uly__lt_mat *m[3] = {&b, &a, &d};
    const cublasOperation_t op[2] = {tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     ta ? CUBLAS_OP_T : CUBLAS_OP_N};
    ULY__TRY(uly__lt(cublasLtMatmulDescInit(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescInit"));
    ULY__TRY(uly__lt(cublasLtMatmulDescSetAttribute(&desc, CUBLASLT_MATMUL_DESC_TRANSA, &op[0],
                                                    sizeof op[0]), "TRANSA"));
    ULY__TRY(uly__lt(cublasLtMatmulDescSetAttribute(&desc, CUBLASLT_MATMUL_DESC_TRANSB, &op[1],
                                                    sizeof op[1]), "TRANSB"));
    for (int i = 0; i < 3; i++) {
        /* cuBLASLt wants ld >= a row's length even for one row, whose ld is never applied
           (a decode step's query may have any row stride): there the length rounded up to 16
           bytes, so that an odd one does not keep the search from tensor-core kernels. */
        const int64_t w = 16 / uly__lt_size(m[i]->t);
        const int64_t ld = m[i]->rows > 1 ? m[i]->ld : (m[i]->cols + w - 1) / w * w;
        align[i] = uly__lt_align(m[i], ld, batch);
        ULY__TRY(uly__lt(cublasLtMatrixLayoutInit(&l[i], m[i]->t, (uint64_t)m[i]->cols,
                                                  (uint64_t)m[i]->rows, ld),
                         "cublasLtMatrixLayoutInit"));
        ULY__TRY(uly__lt(cublasLtMatrixLayoutSetAttribute(&l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                          &batch, sizeof batch), "BATCH_COUNT"));
        ULY__TRY(uly__lt(cublasLtMatrixLayoutSetAttribute(
                             &l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &m[i]->stride,
                             sizeof m[i]->stride), "STRIDED_BATCH_OFFSET"));
    }
    ULY__TRY(uly__lt_search(lt, &desc, l, align, &algo));
    return uly__lt(cublasLtMatmul(lt, &desc, &alpha, b.p, &l[0], a.p, &l[1], &beta, d.p, &l[2],
                                  (void *)d.p, &l[2], &algo, ws, ULY__LT_WS, stream),
                   "cublasLtMatmul");
}

/* The scratch of one kv head's group, then Dsum, dK and dV in fp32, and cuBLASLt's. */
struct uly__lt_ws {
    float *s;          /* S, then dP: [g, Sq, Sk] fp32 */
    void *p, *ds;      /* P and dS: [g, Sq, Sk] in T */
    float *dsum;       /* [B, H, Sq] */
    float *dk, *dv;    /* [Sk, D] */
    void *lt;
};

/* The most query heads of one kv head here: the rows of a score block are this times Sq. */
static int64_t uly__lt_group(const uly_attn_args *a) { return min(uly__group(a), a->q.h); }

/* A score row's stride: Sk rounded up to 8 elements, so that every row of S (fp32), P and dS
   (16-bit) starts 16-byte aligned, the alignment cuBLASLt documents as best for its
   tensor-core kernels. */
static int64_t uly__lt_ld(const uly_attn_args *a) { return (a->k.s + 7) & ~(int64_t)7; }

/* The workspace's parts in bytes, in uly__lt_ws's order, each to start 256-byte aligned: S, P,
   dS, Dsum, dK, dV, cuBLASLt's. -1 for a part whose size overflows int64. */
enum { ULY__LT_PARTS = 7 };
static void uly__lt_parts(const uly_attn_args *a, int64_t (&n)[ULY__LT_PARTS]) {
    const int64_t blk = uly__mul(uly__mul(uly__lt_group(a), a->q.s), uly__lt_ld(a));
    const int64_t kd = uly__mul(uly__mul(a->k.s, a->q.d), 4);
    const int64_t part[ULY__LT_PARTS] = {uly__mul(blk, 4), uly__mul(blk, 2), uly__mul(blk, 2),
                                         uly__fa_dsum_bytes(a), kd, kd, ULY__LT_WS};
    for (int i = 0; i < ULY__LT_PARTS; i++) n[i] = uly__align(part[i]);
}

static int64_t uly__lt_workspace(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    int64_t n[ULY__LT_PARTS], sum = 0;
    if (!a) return -1;
    uly__lt_parts(a, n);
    for (int i = 0; i < ULY__LT_PARTS; i++) sum = uly__add(sum, n[i]);
    return sum;
}

static uly__lt_ws uly__lt_carve(const uly_attn_args *a) {
    int64_t n[ULY__LT_PARTS];
    char *at[ULY__LT_PARTS], *w = (char *)a->workspace;
    uly__lt_parts(a, n);
    for (int i = 0; i < ULY__LT_PARTS; i++) at[i] = w, w += n[i];
    uly__lt_ws r;
    r.s = (float *)at[0], r.p = at[1], r.ds = at[2], r.dsum = (float *)at[3];
    r.dk = (float *)at[4], r.dv = (float *)at[5], r.lt = at[6];
    return r;
}

/* The contract, and what the GEMMs and the Dsum pre-pass (the flash one) add to it. */
static uly_status uly__lt_check(void *ctx, const uly_attn_args *a, int backward) {
    ULY__TRY(uly__attn_check(a, backward));
    ULY__CHECK(a->q.dtype == ULY_BF16 || a->q.dtype == ULY_F16, ULY_EUNSUPPORTED,
               "dtype %s: the cuBLASLt attention takes bf16 or fp16", uly__dtype_name(a->q.dtype));
    ULY__CHECK(a->q.d <= 256 && a->q.d % 8 == 0, ULY_EUNSUPPORTED,
               "q.d (%lld): the cuBLASLt attention takes D <= 256, D %% 8 == 0", ULY__LL(a->q.d));
    /* 256: cudaMalloc's alignment, which the fp32 scores and cuBLASLt's own part need */
    ULY__TRY(uly__check_workspace(a, uly__lt_workspace(ctx, a), 256));
    ULY__CHECK(a->q.b <= INT_MAX && a->q.h <= INT_MAX, ULY_EUNSUPPORTED, "q.b (%lld), q.h (%lld): "
               "at most 2^31 - 1 each (the Dsum pass's grid)", ULY__LL(a->q.b), ULY__LL(a->q.h));
    ULY__CHECK(uly__mul(uly__lt_group(a), a->q.s) <= INT_MAX && a->k.s <= INT_MAX,
               ULY_EUNSUPPORTED, "q.s (%lld) x %lld heads a kv head, k.s (%lld): a GEMM's "
               "dims are int", ULY__LL(a->q.s), ULY__LL(uly__lt_group(a)), ULY__LL(a->k.s));
    if (backward) {
        ULY__TRY(uly__fa_rows16(a->o, "o"));
        ULY__TRY(uly__fa_rows16(a->dout, "dout"));
    }
    return uly__ok();
}

/* One batched product's work: batch b, kv head j and the local query heads [h0, h0 + n) that
   read it (n >= 1). */
struct uly__lt_job {
    int64_t b, j, h0, n;
};

static cudaDataType_t uly__lt_type(uly_dtype t) { return t == ULY_BF16 ? CUDA_R_16BF : CUDA_R_16F; }

/* Tensor t's [s, d] matrices at batch b from head h: one per head of a job, or the same one for
   all of them (shared: K and V, which every query head of the job reads). */
template <typename T>
static uly__lt_mat uly__lt_heads(const uly_tensor &t, int64_t b, int64_t h, int shared) {
    return {uly__row<const T>(t, b, 0, h), uly__lt_type(t.dtype), t.s, t.d, t.ss,
            shared ? 0 : t.sh};
}

/* A job's [Sq, Sk] score matrices of type t at x in the workspace, one per query head. */
static uly__lt_mat uly__lt_scores(const uly_attn_args *a, const void *x, cudaDataType_t t) {
    const int64_t ld = uly__lt_ld(a);
    return {x, t, a->q.s, a->k.s, ld, a->q.s * ld};
}

/* S = Q K^T and P = softmax(scale * S) of a job's query heads into the workspace, and their
   lse unless it is NULL. */
template <typename T>
static uly_status uly__lt_probs(cublasLtHandle_t lt, const uly_attn_args *a,
                                const uly__lt_ws &w, uly__lt_job g, float *lse) {
    const int rows = (int)(g.n * a->q.s);
    cudaStream_t stream = (cudaStream_t)a->stream;
    ULY__TRY(uly__lt_gemm(lt, uly__lt_heads<T>(a->q, g.b, g.h0, 0), 0,
                          uly__lt_heads<T>(a->k, g.b, g.j, 1), 1,
                          uly__lt_scores(a, w.s, CUDA_R_32F), 1.f, 0.f, (int)g.n, w.lt, stream));
    ULY_LAUNCH(uly__lt_softmax<T>, dim3(uly__fa_cdiv(rows, ULY__ROW_WARPS)),
               dim3(ULY__ROW_WARPS * 32), 0, stream, w.s, (T *)w.p, lse, a->q.s, rows,
               (int)a->q.s, (int)a->k.s, uly__lt_ld(a), uly__scale(a), a->causal);
    return uly__cuda(cudaGetLastError(), "uly__lt_softmax");
}

/* The first of a job's rows in lse and Dsum ([B, H, Sq]). */
static int64_t uly__lt_row0(const uly_attn_args *a, uly__lt_job g) {
    return (g.b * a->q.h + g.h0) * a->q.s;
}

/* S, P and lse of the job's heads (uly__lt_probs), then O = P V. */
template <typename T>
static uly_status uly__lt_fwd_job(cublasLtHandle_t lt, const uly_attn_args *a,
                                  const uly__lt_ws &w, uly__lt_job g) {
    ULY__TRY(uly__lt_probs<T>(lt, a, w, g, a->lse + uly__lt_row0(a, g)));
    return uly__lt_gemm(lt, uly__lt_scores(a, w.p, uly__lt_type(a->q.dtype)), 0,
                        uly__lt_heads<T>(a->v, g.b, g.j, 1), 0,
                        uly__lt_heads<T>(a->o, g.b, g.h0, 0), 1.f, 0.f, (int)g.n, w.lt,
                        (cudaStream_t)a->stream);
}

/* P again, dP = dO V^T, dS = scale P (dP - Dsum), dQ = dS K; then dK and dV summed over the
   job's query heads in order, in fp32, and stored once. The sums are a GEMM a head, each adding
   to the last (beta 1): one GEMM would reduce over (head, row) pairs, but q's and dO's heads lie
   within a row, so no matrix of one leading dimension holds those pairs. */
template <typename T>
static uly_status uly__lt_bwd_job(cublasLtHandle_t lt, const uly_attn_args *a,
                                  const uly__lt_ws &w, uly__lt_job g) {
    const cudaDataType_t dt = uly__lt_type(a->q.dtype);
    const int64_t Sq = a->q.s, Sk = a->k.s, D = a->q.d, ld = uly__lt_ld(a);
    cudaStream_t stream = (cudaStream_t)a->stream;
    const uly__lt_mat K = uly__lt_heads<T>(a->k, g.b, g.j, 1);
    ULY__TRY(uly__lt_probs<T>(lt, a, w, g, NULL));
    ULY__TRY(uly__lt_gemm(lt, uly__lt_heads<T>(a->dout, g.b, g.h0, 0), 0,
                          uly__lt_heads<T>(a->v, g.b, g.j, 1), 1,
                          uly__lt_scores(a, w.s, CUDA_R_32F), 1.f, 0.f, (int)g.n, w.lt, stream));
    ULY_LAUNCH(uly__lt_softmax_grad<T>, uly__lt_grid(g.n * Sq * Sk), dim3(ULY__LT_THREADS), 0,
               stream, (const T *)w.p, w.s, w.dsum + uly__lt_row0(a, g), Sq, (T *)w.ds,
               g.n * Sq * Sk, (int)Sq, (int)Sk, ld, uly__scale(a));
    ULY__TRY(uly__cuda(cudaGetLastError(), "uly__lt_softmax_grad"));
    ULY__TRY(uly__lt_gemm(lt, uly__lt_scores(a, w.ds, dt), 0, K, 0,
                          uly__lt_heads<T>(a->dq, g.b, g.h0, 0), 1.f, 0.f, (int)g.n, w.lt,
                          stream));
    const uly__lt_mat dK = {w.dk, CUDA_R_32F, Sk, D, D, 0}, dV = {w.dv, CUDA_R_32F, Sk, D, D, 0};
    for (int64_t i = 0; i < g.n; i++) {
        const uly__lt_mat dSi = {(const T *)w.ds + i * Sq * ld, dt, Sq, Sk, ld, 0};
        const uly__lt_mat Pi = {(const T *)w.p + i * Sq * ld, dt, Sq, Sk, ld, 0};
        const float beta = i ? 1.f : 0.f;
        ULY__TRY(uly__lt_gemm(lt, dSi, 1, uly__lt_heads<T>(a->q, g.b, g.h0 + i, 1), 0, dK, 1.f,
                              beta, 1, w.lt, stream));
        ULY__TRY(uly__lt_gemm(lt, Pi, 1, uly__lt_heads<T>(a->dout, g.b, g.h0 + i, 1), 0, dV,
                              1.f, beta, 1, w.lt, stream));
    }
    T *dk = uly__row<T>(a->dk, g.b, 0, g.j), *dv = uly__row<T>(a->dv, g.b, 0, g.j);
    ULY_LAUNCH(uly__lt_store<T>, uly__lt_grid(Sk * D), dim3(ULY__LT_THREADS), 0, stream,
               (const float *)w.dk, dk, a->dk.ss, Sk, D);
    ULY_LAUNCH(uly__lt_store<T>, uly__lt_grid(Sk * D), dim3(ULY__LT_THREADS), 0, stream,
               (const float *)w.dv, dv, a->dv.ss, Sk, D);
    return uly__cuda(cudaGetLastError(), "uly__lt_store");
}

/* dK and dV of kv head j in batch b as zeros: no query head of this slice reads it. */
template <typename T>
static uly_status uly__lt_zero_kv(const uly_attn_args *a, int64_t b, int64_t j) {
    const size_t row = (size_t)a->q.d * sizeof(T), rows = (size_t)a->k.s;
    cudaStream_t stream = (cudaStream_t)a->stream;
    cudaError_t e = cudaMemset2DAsync(uly__row<T>(a->dk, b, 0, j), (size_t)a->dk.ss * sizeof(T),
                                      0, row, rows, stream);
    if (!e)
        e = cudaMemset2DAsync(uly__row<T>(a->dv, b, 0, j), (size_t)a->dv.ss * sizeof(T), 0, row,
                              rows, stream);
    return uly__cuda(e, "cudaMemset2DAsync");
}

/* Forward (backward = 0) or backward, one job for every (batch, kv head): its query heads are
   one batched GEMM each (K and V have batch stride 0). */
template <typename T>
static uly_status uly__lt_run(cublasLtHandle_t lt, const uly_attn_args *a, int backward) {
    ULY__TRY(uly__lt_check(lt, a, backward));
    const int64_t B = a->q.b, H = a->q.h, Sq = a->q.s, g = uly__group(a);
    const uly__lt_ws w = uly__lt_carve(a);
    if (backward) { /* Dsum by the flash pre-pass */
        uly__fa_params p;
        memset(&p, 0, sizeof p);
        p.o = a->o, p.dout = a->dout, p.q = a->q, p.dsum = w.dsum, p.lse_sb = H * Sq, p.lse_sh = Sq;
        p.sq = (int)Sq;
        ULY__TRY(uly__fa_launch(uly__flash_bwd_pre<T>, "uly__flash_bwd_pre",
                                uly__fa_row_grid(H, (int)B, Sq), ULY__ROW_WARPS * 32, 0,
                                (cudaStream_t)a->stream, p));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < a->k.h; j++) {
            const uly__head_span heads = uly__q_heads(a->q_head0, g, j, H);
            const uly__lt_job job = {b, j, heads.first, heads.end - heads.first};
            if (job.n > 0)
                ULY__TRY(backward ? uly__lt_bwd_job<T>(lt, a, w, job)
                                  : uly__lt_fwd_job<T>(lt, a, w, job));
            else if (backward)
                ULY__TRY(uly__lt_zero_kv<T>(a, b, j));
        }
    return uly__ok();
}

static uly_status uly__lt_fwd(void *ctx, const uly_attn_args *a) {
    return a->q.dtype == ULY_F16 ? uly__lt_run<__half>((cublasLtHandle_t)ctx, a, 0)
                                 : uly__lt_run<__nv_bfloat16>((cublasLtHandle_t)ctx, a, 0);
}
static uly_status uly__lt_bwd(void *ctx, const uly_attn_args *a) {
    return a->q.dtype == ULY_F16 ? uly__lt_run<__half>((cublasLtHandle_t)ctx, a, 1)
                                 : uly__lt_run<__nv_bfloat16>((cublasLtHandle_t)ctx, a, 1);
}

ULYDEF uly_attn uly_cublaslt_attention(cublasLtHandle_t handle) {
    uly_attn at = {uly__lt_fwd, uly__lt_bwd, uly__lt_workspace, (void *)handle, uly__lt_check, 1};
    return at;
}

#endif /* ULYSSES_CUBLASLT */

/* ---------------------------------------------------------------------------------------------
   The default GPU layer */

ULYDEF uly_layer uly_cuda_layer(const uly_plan *plan, const uly_comm *comm, void *stream) {
    uly_layer l;
    memset(&l, 0, sizeof l);
    l.plan = plan;
    l.comm = comm;
    l.stream = stream;
    l.layout = uly_cuda_layout();
    l.attn = uly_flash_attention();
    return l;
}

#ifdef __GNUC__
#pragma GCC diagnostic pop
#endif
#endif /* ULYSSES_IMPLEMENTATION && !ULYSSES_CUDA_IMPLEMENTED */

/* ---------------------------------------------------------------------------------------------
   MIT License. Copyright (c) 2026 The ulysses authors. Permission is hereby granted, free of
   charge, to any person obtaining a copy of this software and associated documentation files
   (the "Software"), to deal in the Software without restriction, including without limitation
   the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of
   the Software, and to permit persons to whom the Software is furnished to do so, subject to the
   following conditions: The above copyright notice and this permission notice shall be included
   in all copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED "AS IS",
   WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES
   OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
   AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN
   ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE
   OR THE USE OR OTHER DEALINGS IN THE SOFTWARE. */
