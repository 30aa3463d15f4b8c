/* ulysses.h - Ulysses sequence parallelism for C and CUDA trainers. MIT license, see the end.

   Long-context attention runs out of memory because its activations grow with the sequence.
   Ulysses splits the SEQUENCE over the P ranks of a sequence-parallel (SP) group: each rank
   projects its own tokens to q, k, v; one all-to-all per tensor turns "my tokens, all heads" into
   "all tokens, my heads"; each rank runs ordinary attention over the full sequence for its heads;
   one more all-to-all turns the output back into "my tokens, all heads". The backward is the same
   exchanges in reverse. Per layer the forward's all-to-alls move about 4*N*h/P elements per rank
   (N = B*S tokens, h = H*D; with GQA the k and v exchanges are about max(Hkv, P)/H of that, as
   a kv head that several ranks need is sent to each), and the backward's as many again.

     rank r: q,k,v [B, S_r, H, D] --pack--> all-to-all --> [B, S, H_r, D] --attention--> o
             out   [B, S_r, H, D] <--unpack-- all-to-all <--pack-- o [B, S, H_r, D], lse [B, H_r, S]

   This file is the whole CPU side, stb-style: declarations below, and the implementation after
   them behind ULYSSES_IMPLEMENTATION. Do this in exactly one C or C++ file:

       #define ULYSSES_IMPLEMENTATION
       #include "ulysses.h"

   ulysses_cuda.cuh adds the GPU side (layout kernels, NCCL, attention kernels) on the same API.

   USAGE: one SP attention layer on rank `rank` of a world of `world` ranks (the CPU path);
   `comm` is its SP group's communicator: the one uly_local_run passes to each rank's function
   (threads), or uly_mpi_comm over uly_mpi_split's group (MPI). README.md has the whole program.

       uly_plan plan;
       uly_status st = uly_plan_init(&plan, &(uly_plan_desc){
           .world_size = world, .rank = rank, .sp_size = 4,
           .batch = 1, .seq_len = 8192, .n_heads = 16, .n_kv_heads = 4, .head_dim = 64 });
       if (st.code) { fprintf(stderr, "%s\n", st.msg); return; }  // a bad shape: on every rank
       uly_layer L = { .plan = &plan, .comm = comm, .attn = uly_cpu_attention(),
                       .layout = uly_cpu_layout(), .causal = 1 };
       L.workspace_bytes = uly_layer_workspace(&L);
       L.workspace = malloc(L.workspace_bytes);
       st = uly_layer_agree(&L);                             // once: every rank plans alike
       if (st.code) { fprintf(stderr, "%s\n", st.msg); return; }
       int64_t nsaved = uly_saved_bytes(&plan);
       void *saved = malloc(nsaved);                         // kept from forward to backward
       uly_range tok = uly_tokens(&plan, plan.sp_rank);      // this rank's tokens
       uly_tensor q = uly_dense(qbuf, ULY_F32, 1, tok.count, 16, 64);  // out, dout, dq alike
       uly_tensor k = uly_dense(kbuf, ULY_F32, 1, tok.count, 4, 64);   // Hkv heads: v, dk, dv
       st = uly_forward(&L, q, k, v, out, saved, nsaved);
       st = uly_backward(&L, dout, saved, nsaved, dq, dk, dv);

   SHARDING (everything is int64; any S >= P and any H >= P, no padding)
       sp_rank = rank % P, dp_rank = rank / P: an SP group is P consecutive ranks.
       tokens of rank r:  [s0_r, s0_r + S_r), S_r = S/P + (r < S%P), ranks in order.
       query heads:       [h0_r, h0_r + H_r), H_r = H/P + (r < H%P).
       kv heads (GQA, g = H/Hkv): rank r holds kv heads [h0_r/g, (h0_r + H_r - 1)/g]; a kv head
       several ranks need is sent to each of them, and its gradient copies are summed on return.

   LAYOUTS (row-major, the last dim contiguous; llm.c and FlashAttention order)
       sequence layout [B, S_r, H, D]; head layout [B, S, H_r, D]; fused QKV [B, S_r, H+2*Hkv, D]
       (q heads, then k, then v: llm.c's (B, T, 3, NH, HS) when Hkv == H). A uly_tensor is a
       strided view, so q, k, v may point into one fused buffer (uly_qkv_views) with no copy.
       Exchange buffers: seq->head sends [B, S_r, H_j, D] to peer j, blocks in peer order, and
       receives [P][B, S_j, H_r, D] (for B == 1 that is already [S, H_r, D]). head->seq is the
       exact inverse.

   ERRORS
       Every function that can fail returns uly_status: code 0 (ULY_OK) or an error code, and a
       message that names the call, the field and the rule, e.g.
       "uly_plan_init: sp_size (8) > n_heads (4): every rank needs at least one query head".
       The size queries (uly_layer_workspace, uly_saved_bytes, uly_send_bytes, ...) return 0,
       and the view helpers (uly_saved_lse, uly_head_slice) NULL data, for what they cannot
       size; the call that takes the result then says why. uly_local_run reports only its own
       failures (starting threads); each rank's results are the rank function's to keep.
       Nothing aborts or exits (but MPI or CUDA may: an MPI error under a handler that aborts,
       a device-side trap); sizes that overflow int64, or byte counts a communicator cannot
       carry, are errors and never truncated. Errors are per rank: what the plan refuses, every
       rank refuses alike, but a rank's own bad buffer (NULL, short, overlapping) stops that
       rank alone, before its first exchange, where its peers wait for it as in any collective
       a rank leaves (the local communicators tell them when it returns). So on an error, abort
       the communicator on every rank (MPI_Abort, ncclCommAbort).

   OPTIONS (define before including)
       ULYSSES_IMPLEMENTATION   make the implementation in this translation unit
       ULYSSES_STATIC           give every function internal linkage (embed privately)
       ULYSSES_MPI              declare and build the MPI communicator (include <mpi.h> first)
       ULYSSES_NO_THREADS       leave out the threaded local communicator (no pthreads)
       ULY_ASSERT(x)            internal invariants (default: assert)
   Link with -lm, and -lpthread unless ULYSSES_NO_THREADS.

   Nothing here allocates: buffers come from the caller, sized by the *_bytes queries. There is
   no global state; every call is reentrant, though a communicator's calls are collectives,
   which (as MPI's and NCCL's) every rank makes in the same order, one at a time. On the GPU
   every call is ordered on the caller's stream.

   VERSIONS (ULYSSES_VERSION is major * 10000 + minor * 100 + patch; ulysses_cuda.cuh goes with
   the ulysses.h of the same version)
       0.1.0  2026-11  the plan, layouts and CPU reference layer; local and MPI communicators;
                       the loss. ulysses_cuda.cuh: layout kernels, NCCL and device-local
                       communicators, flash attention forward and backward, cuBLASLt attention */
#ifndef ULYSSES_H
#define ULYSSES_H

#define ULYSSES_VERSION 100 /* 0.1.0 */

#include <stddef.h>
#include <stdint.h>

#ifdef ULYSSES_STATIC
#define ULYDEF static
#else
#define ULYDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum { ULY_MAX_SP = 256 }; /* largest SP group; count arrays live on the stack */

/* ---------------------------------------------------------------------------------------------
   Status */

typedef enum uly_code {
    ULY_OK = 0,
    ULY_EINVAL,      /* an argument breaks a rule; the message names the field and the rule */
    ULY_EOVERFLOW,   /* a size overflows int64, or a count exceeds what the communicator moves */
    ULY_ECOMM,       /* the communicator failed (threads, MPI, NCCL); its own message included */
    ULY_ECUDA,       /* a CUDA call failed */
    ULY_EUNSUPPORTED /* valid, but this implementation does not do it (dtype, head dim) */
} uly_code;

/* Every function that can fail returns one. msg leads with the name of the function the
   caller called, then says what failed inside it and why: "uly_forward: saved_bytes (1280) <
   uly_saved_bytes() (1792)", "uly_forward: alltoallv: ncclSend: ...". The functions of a
   layer's parts (uly_comm, uly_layout, uly_attn) leave the name to their caller. With code
   ULY_OK, msg is "". */
typedef struct uly_status {
    uly_code code;
    char msg[244];
} uly_status;

/* ---------------------------------------------------------------------------------------------
   Tensors: strided [b, s, h, d] views with a contiguous last dim, data aligned to the element
   size */

typedef enum uly_dtype { ULY_F32 = 0, ULY_BF16, ULY_F16 } uly_dtype;

typedef struct uly_tensor {
    void *data;
    int64_t b, s, h, d;  /* shape */
    int64_t sb, ss, sh;  /* strides in elements; d has stride 1 */
    uly_dtype dtype;
} uly_tensor;

ULYDEF int64_t uly_dtype_size(uly_dtype t);
/* A dense [b, s, h, d] tensor. One whose strides (s*h*d) overflow int64 gets strides -1.
   Every call refuses (ULY_EOVERFLOW) such a tensor, and any view whose bytes overflow int64. */
ULYDEF uly_tensor uly_dense(void *data, uly_dtype t, int64_t b, int64_t s, int64_t h, int64_t d);
/* The view of heads [h0, h0 + n) of t. */
ULYDEF uly_tensor uly_head_slice(uly_tensor t, int64_t h0, int64_t n);
/* q, k, v views of a dense fused [b, s, nq + 2*nkv, d] buffer (q heads, k heads, v heads). The
   views are checked where they are used; this fails for a NULL output, b, s or d not positive,
   nq or nkv negative, or a buffer whose bytes overflow int64. */
ULYDEF uly_status uly_qkv_views(void *qkv, uly_dtype t, int64_t b, int64_t s, int64_t nq,
                                int64_t nkv, int64_t d, uly_tensor *q, uly_tensor *k,
                                uly_tensor *v);

/* ---------------------------------------------------------------------------------------------
   The plan: who owns which tokens and heads, and how many bytes every exchange moves */

typedef struct uly_plan_desc {
    int world_size;     /* ranks in the world, a multiple of sp_size */
    int rank;           /* this rank in the world */
    int sp_size;        /* P, ranks in a sequence-parallel group; <= ULY_MAX_SP */
    int64_t batch;      /* B */
    int64_t seq_len;    /* S, the full sequence; >= sp_size */
    int64_t n_heads;    /* H, query heads; >= sp_size */
    int64_t n_kv_heads; /* Hkv; divides n_heads; 0 means n_heads */
    int64_t head_dim;   /* D */
    uly_dtype dtype;    /* of q, k, v, out and their gradients */
    /* 0, or the largest per-peer message to plan for: uly_plan_init refuses a shape that needs
       a larger one, before any communicator exists (the layer checks comm->max_bytes too). */
    int64_t max_bytes;
} uly_plan_desc;

/* Read-only once made: every call refuses a plan edited after uly_plan_init (to change a shape,
   call uly_plan_init again). */
typedef struct uly_plan {
    uly_plan_desc desc; /* as validated, n_kv_heads filled in */
    int sp_rank, dp_rank;
    int64_t group;      /* g = n_heads / n_kv_heads, query heads per kv head */
    int64_t elem_size;
    uly_plan_desc made; /* private: desc as uly_plan_init validated it */
} uly_plan;

typedef struct uly_range {
    int64_t start, count;
} uly_range;

/* The four exchanges. Q and KV go seq->head, O and DKV head->seq. The backward reuses them:
   dO goes like Q, dQ like O, dK and dV like DKV (which sums the copies of replicated kv heads). */
typedef enum uly_xchg { ULY_X_Q = 0, ULY_X_KV, ULY_X_O, ULY_X_DKV } uly_xchg;

ULYDEF uly_status uly_plan_init(uly_plan *p, const uly_plan_desc *desc);
ULYDEF uly_range uly_tokens(const uly_plan *p, int sp_rank);   /* tokens of an SP rank */
ULYDEF uly_range uly_heads(const uly_plan *p, int sp_rank);    /* its query heads */
ULYDEF uly_range uly_kv_heads(const uly_plan *p, int sp_rank); /* the kv heads it needs */
/* Per-peer byte counts and offsets of exchange x on this rank, each array of sp_size. */
ULYDEF uly_status uly_exchange_counts(const uly_plan *p, uly_xchg x, int64_t *send_counts,
                                      int64_t *send_offs, int64_t *recv_counts,
                                      int64_t *recv_offs);
/* Sums of send_counts and of recv_counts; 0 for a plan or x that is not valid. */
ULYDEF int64_t uly_send_bytes(const uly_plan *p, uly_xchg x);
ULYDEF int64_t uly_recv_bytes(const uly_plan *p, uly_xchg x);

/* ---------------------------------------------------------------------------------------------
   Communicators: one small interface, several implementations */

typedef struct uly_comm {
    int size, rank;
    /* Every rank sends send[send_offs[j], +send_counts[j]) to peer j, which receives it at
       recv[recv_offs[i], +recv_counts[i]) for sender i. Bytes; the counts of both ends must
       agree (the layer's do where every rank planned alike: uly_layer_agree). The local,
       device-local and MPI communicators check; NCCL cannot see the other end's count, and
       there a mismatch can hang or leave bytes unwritten. send's bytes, from its first block's
       start to its last block's end, must be apart from recv's (MPI's and NCCL's rule; each
       communicator here refuses an overlap). */
    uly_status (*alltoallv)(void *ctx, const void *send, const int64_t *send_counts,
                            const int64_t *send_offs, void *recv, const int64_t *recv_counts,
                            const int64_t *recv_offs, void *stream);
    /* Optional (NULL: alltoallv moves everything). The exchange in which every block of every
       rank has one size: send[j * bytes, +bytes) to peer j, received at recv[i * bytes, +bytes)
       from sender i. The layer calls it only where the plan makes that true on every rank, so
       it may be a collective that all ranks must choose alike (ncclAlltoAll); alltoallv must
       not be one, since a rank sees only its own counts. */
    uly_status (*alltoall)(void *ctx, const void *send, void *recv, int64_t bytes, void *stream);
    /* buf[0, n) = sum over ranks, in place. Host memory is read after the work queued on
       stream (a device communicator's) and holds the sum when the call returns; GPU memory may
       only have it queued on stream (NCCL's): read it after the stream. */
    uly_status (*allreduce_sum)(void *ctx, double *buf, int64_t n, void *stream);
    uly_status (*barrier)(void *ctx);
    void *ctx;
    /* The largest per-peer count it can move, 0 = no limit: the layer refuses a plan that
       needs more. Ours move any count (MPI's in chunks), so leave it 0. */
    int64_t max_bytes;
    int device; /* 1: buffers are GPU memory, 0: host memory */
} uly_comm;

#ifndef ULYSSES_NO_THREADS
/* The local communicator: P ranks as threads of one process (tests, examples, the demo). */
/* Runs fn(comm, user) on `size` threads, one per rank, and waits for all of them. The world
   (a barrier and a table of published buffers) lives on uly_local_run's stack. */
ULYDEF uly_status uly_local_run(int size, void (*fn)(const uly_comm *comm, void *user), void *user);
#endif

#ifdef ULYSSES_MPI
/* The MPI communicator over `comm` (an SP group). A peer's byte count above chunk_bytes
   (0 = INT_MAX: MPI's int counts; MPI 4's large-count calls are not in every MPI) is moved in
   messages of at most chunk_bytes, point-to-point on comm (tag 0x756c): give the library a
   communicator of its own (MPI_Comm_dup) unless nothing else receives or probes on comm while
   the layer runs. Each alltoallv first trades its counts and chunk sizes (one small all-to-all
   and a sum), so counts that do not match, chunk_bytes that differ, or bad arguments on one
   rank fail every rank alike, before any byte moves. */
typedef struct uly_mpi {
    MPI_Comm comm;
    int64_t chunk_bytes;
} uly_mpi;
/* Each call sets MPI_ERRORS_RETURN on m->comm while it runs and then puts the caller's error
   handler back, so MPI failures come back as ULY_ECOMM with MPI's message. (MPI does not
   promise that a program can go on after an error: treat the communicator as unusable and
   MPI_Abort. A derived datatype that cannot be made, past INT_MAX offsets, fails under the
   handler MPI gives such calls: MPI_COMM_SELF's since MPI 4, MPI_COMM_WORLD's before.) Any
   size: a world's for uly_loss_reduce, but alltoallv (an SP group's) takes at most ULY_MAX_SP
   ranks. out points to m, which must outlive it. out->device is 0: host buffers (MPI calls do
   not wait for a CUDA stream, so the GPU layer takes NCCL's communicator instead). */
ULYDEF uly_status uly_mpi_comm(uly_mpi *m, uly_comm *out);
/* Splits a world (a collective over it) into SP groups of sp_size consecutive ranks and DP
   groups across them; the caller frees them (MPI_Comm_free). On failure both are
   MPI_COMM_NULL. */
ULYDEF uly_status uly_mpi_split(MPI_Comm world, int sp_size, MPI_Comm *sp, MPI_Comm *dp);
#endif

/* ---------------------------------------------------------------------------------------------
   Local attention: the FlashAttention contract, as a function pointer

   q [B, Sq, H, D], k and v [B, Sk, Hkv, D], o like q, lse fp32 [B, H, Sq] (natural log, scale
   included). Causal masks are bottom-right aligned: row i keeps keys j <= i + Sk - Sq. A row
   with no key kept outputs 0 and lse = +inf, and nothing is NaN. Query head i reads kv head
   (q_head0 + i) / kv_group - q_head0 / kv_group: with q_head0 = 0 that is FlashAttention's
   i / (H / Hkv); an SP rank passes its first global head so a GQA group split across ranks
   maps right. The backward reads dout, q, k, v, o, lse and writes dq, dk, dv (dk and dv summed
   over each group's query heads). */

typedef struct uly_attn_args {
    uly_tensor q, k, v, o;
    float *lse;
    uly_tensor dout, dq, dk, dv; /* backward only; all zero (data NULL) in a forward */
    float softmax_scale;         /* 0 = 1/sqrt(D) */
    int causal;
    int deterministic;           /* bitwise-identical results run to run */
    int64_t q_head0;             /* global index of q's first head; 0 for whole tensors */
    int64_t kv_group;            /* query heads per kv head; 0 = q.h / k.h */
    void *workspace;             /* workspace(ctx, args) bytes, asked with these same args,
                                    aligned as the attention requires, in its memory */
    int64_t workspace_bytes;     /* the size of workspace: one sized for other args is an
                                    error, not an overrun */
    void *stream;                /* cudaStream_t for GPU attention */
} uly_attn_args;

typedef struct uly_attn {
    uly_status (*fwd)(void *ctx, const uly_attn_args *a);
    uly_status (*bwd)(void *ctx, const uly_attn_args *a);
    /* Bytes of workspace: the layer asks on every call, with the backward's fields set, and
       passes the same buffer to fwd and bwd, so the answer must cover both. -1 when a is NULL
       or its sizes overflow. */
    int64_t (*workspace)(void *ctx, const uly_attn_args *a);
    void *ctx;
    /* Optional: what fwd (backward = 0) or bwd would refuse in a, without running. The layer
       asks before it exchanges anything, so a refusal stops every rank at the same point
       instead of one rank while its peers wait in the next collective; a limit on the rank's
       own head count (which ranks differ in by one) can still stop some ranks only. */
    uly_status (*check)(void *ctx, const uly_attn_args *a, int backward);
    int device; /* 1: its tensors are GPU memory, 0: host memory */
} uly_attn;

/* The CPU reference, fp32: plain loops a reader can check against the formulas. */
ULYDEF uly_attn uly_cpu_attention(void);
ULYDEF uly_status uly_attn_check(const uly_attn_args *a, int backward); /* the contract's rules */

/* ---------------------------------------------------------------------------------------------
   Layout: pack a tensor into an exchange's send buffer, unpack a receive buffer into a tensor

   seq->head (Q, KV): pack src [B, S_r, Hx, D] -> send blocks [B, S_r, Hx_j, D] in peer order;
                      unpack recv [P][B, S_j, Hx_r, D] -> dst [B, S, Hx_r, D].
   head->seq (O, DKV): pack src [B, S, Hx_r, D] -> send blocks [B, S_j, Hx_r, D];
                      unpack recv [P][B, S_r, Hx_j, D] -> dst [B, S_r, Hx, D], and DKV sums the
                      copies of a replicated kv head in peer order.
   Hx is H for Q and O, Hkv for KV and DKV; Hx_r the part rank r holds: its query heads, or the
   kv heads they need (uly_kv_heads). */

typedef struct uly_layout {
    uly_status (*pack)(void *ctx, const uly_plan *p, uly_xchg x, uly_tensor src, void *send,
                       void *stream);
    uly_status (*unpack)(void *ctx, const uly_plan *p, uly_xchg x, const void *recv,
                         uly_tensor dst, void *stream);
    void *ctx;
    int device; /* 1: its tensors and buffers are GPU memory, 0: host memory */
} uly_layout;

/* The CPU reference: plain copy loops, any dtype. The DKV unpack sums the gradient copies of a
   kv head shared by ranks as the CUDA kernel does: widened to fp32, added in peer order, rounded
   once to the dtype (to nearest, ties to even), so the two agree bit for bit. */
ULYDEF uly_layout uly_cpu_layout(void);

/* ---------------------------------------------------------------------------------------------
   The SP attention layer */

typedef enum uly_phase { ULY_PHASE_PACK = 0, ULY_PHASE_EXCHANGE, ULY_PHASE_ATTN, ULY_PHASE_UNPACK }
    uly_phase;

typedef struct uly_layer {
    const uly_plan *plan;
    const uly_comm *comm;   /* the SP group: size sp_size, rank sp_rank */
    uly_attn attn;          /* local attention over the full sequence */
    uly_layout layout;      /* uly_cpu_layout(), or the CUDA one */
    float softmax_scale;    /* 0 = 1/sqrt(D) */
    int causal;
    int deterministic;
    void *workspace;        /* uly_layer_workspace() bytes, in the communicator's memory. Its
                               parts start at 256-byte offsets, so a base aligned as
                               cudaMalloc's (256) meets every attention's rule (cuBLASLt 256,
                               flash 16, the CPU 4; each checks its part): malloc will do on
                               the CPU. */
    int64_t workspace_bytes;
    void *stream;
    /* Optional: called at the start (end = 0) and end (end = 1) of every phase, for timing. */
    void (*on_phase)(void *user, uly_phase phase, int end);
    void *phase_user;
} uly_layer;

/* Scratch for forward or backward; 0 when l cannot be sized (uly_forward says why). */
ULYDEF int64_t uly_layer_workspace(const uly_layer *l);
/* Head-layout q, k, v, o and lse: what the forward keeps for the backward. */
ULYDEF int64_t uly_saved_bytes(const uly_plan *p);
ULYDEF float *uly_saved_lse(const uly_plan *p, void *saved); /* [B, H_r, S] */
/* q, k, v, out in sequence layout [B, S_r, H or Hkv, D] (views into a fused buffer are fine).
   saved holds saved_bytes, at least uly_saved_bytes() (a smaller one is an error), and is
   4-byte aligned (an error otherwise: it holds the fp32 lse); its parts start at 256-byte
   offsets, so, as for the workspace, a base from malloc or cudaMalloc meets any attention's
   rule for them. saved and the workspace must not overlap each other or any tensor (an error),
   and dq, dk and dv not each other, except as consecutive slices along b, s or h of one view
   (uly_qkv_views' fused [.., H + 2 Hkv, D]) or as one view shifted into the gaps between its
   rows (heads interleaved, [.., H, 3, D]) where each of its strides spans the whole dim inside
   it (stride >= extent x inner stride); other views whose bytes interleave count as sharing
   memory, even where no element is shared. An output may be written over an input of the same
   call (out over q, dq over dout): inputs are exchanged before any output is written. */
ULYDEF uly_status uly_forward(const uly_layer *l, uly_tensor q, uly_tensor k, uly_tensor v,
                              uly_tensor out, void *saved, int64_t saved_bytes);
/* dq, dk, dv are overwritten, in sequence layout. A kv head whose query heads are on several
   ranks (always when P > Hkv; else where a rank's first query head falls inside a GQA group, as
   with H = 12, Hkv = 6, P = 4) gets a share of its dk, dv from each: a share is rounded to the
   dtype and the owner sums the shares in fp32, rounding once (uly_cpu_layout). That is one
   rounding per rank more than an unsharded backward, and never more than FlashAttention's own
   GQA backward, which rounds each query head's dk, dv before summing them. */
ULYDEF uly_status uly_backward(const uly_layer *l, uly_tensor dout, const void *saved,
                               int64_t saved_bytes, uly_tensor dq, uly_tensor dk, uly_tensor dv);
/* Checks that every rank of l->comm runs the same layer: the plan's desc (shape, dtype, world,
   max_bytes), causal and the softmax scale. An exchange cannot tell: a peer that plans another
   S sends blocks of other sizes, which MPI may take as short messages (leaving the rest of a
   buffer as it was) and NCCL may wait on forever, and a peer with another mask or scale
   computes its heads differently. A collective of two small allreduce_sums of host memory
   (NCCL's needs uly_nccl.scratch): call it once on every rank after building the layer. Every
   rank returns the same code: a rank that differs from SP rank 0 names the field, one whose
   plan is not valid or not the communicator's rank says so and still takes part (so that its
   peers fail with it instead of waiting); only a NULL layer, comm or allreduce_sum, which
   cannot take part, returns at once. */
ULYDEF uly_status uly_layer_agree(const uly_layer *l);

/* ---------------------------------------------------------------------------------------------
   What a trainer needs around the layer */

/* pos[b*S_r + i] = s0 + i: rows of wpe or RoPE tables for the local tokens. An error on every
   rank if seq_len exceeds 2^31 (some rank's positions would not fit int32). */
ULYDEF uly_status uly_positions(const uly_plan *p, int32_t *pos);
/* local[b, i] = full[b, s0 + i]: the same [B, S] sample is loaded on every SP peer. */
ULYDEF uly_status uly_shard_tokens(const uly_plan *p, const int32_t *full, int32_t *local);
/* Labels shifted over the FULL sequence before sharding, so shard edges need no fix-up:
   label of global token t is full[b, t + 1], and ignore_index for t = S - 1. */
ULYDEF uly_status uly_shard_labels(const uly_plan *p, const int32_t *full, int32_t ignore_index,
                                   int32_t *labels);
/* Cross-entropy over n local tokens of vocabulary v: adds sum of -log softmax(logits)[label]
   to *loss_sum and the count of labels != ignore_index to *count (zero them first; calls
   accumulate, e.g. over micro-batches). If dlogits is not NULL it gets the unscaled gradient
   softmax - onehot (0 for ignored tokens); scale it by uly_loss_reduce's grad_scale. A -inf
   logit is a masked class (a label on one adds +inf); a token with a NaN or +inf logit, or
   with every logit -inf, adds NaN, as it does in any framework: that is the model's failure to
   report, not this call's. */
ULYDEF uly_status uly_cross_entropy(const float *logits, const int32_t *labels, int64_t n,
                                    int64_t v, int32_t ignore_index, double *loss_sum,
                                    int64_t *count, float *dlogits);
/* One allreduce of (sum, count) over c, the whole world (every DP and SP rank: over an SP
   group alone the mean is one replica's): mean = sum_all / count_all and
   grad_scale = 1 / count_all, both 0 when no rank has a valid token (never NaN). */
ULYDEF uly_status uly_loss_reduce(const uly_comm *c, double loss_sum, int64_t count,
                                  double *mean, double *grad_scale);

#ifdef __cplusplus
}
#endif
#endif /* ULYSSES_H */

/* =============================================================================================
   Implementation */

/* Guarded of its own, so a file may include the header again after the implementation (as
   ulysses_cuda.cuh does). */
#if defined(ULYSSES_IMPLEMENTATION) && !defined(ULYSSES_IMPLEMENTED)
#define ULYSSES_IMPLEMENTED

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#ifndef ULY_ASSERT
#include <assert.h>
#define ULY_ASSERT(x) assert(x)
#endif
#ifndef ULYSSES_NO_THREADS
#include <pthread.h>
#endif

#ifdef __GNUC__
#pragma GCC diagnostic push
/* Under ULYSSES_STATIC a program calls only some of the functions. */
#pragma GCC diagnostic ignored "-Wunused-function"
#define ULY__PRINTF __attribute__((format(printf, 2, 3)))
#else
#define ULY__PRINTF
#endif

/* ---------------------------------------------------------------------------------------------
   Status and size arithmetic */

#define ULY__LL(x) ((long long)(x))
/* Returns the error from the enclosing function unless cond holds. */
#define ULY__CHECK(cond, code, ...)                                                           \
    do {                                                                                      \
        if (!(cond)) return uly__err(code, __VA_ARGS__);                                     \
    } while (0)
#define ULY__TRY(call)                                                                        \
    do {                                                                                      \
        uly_status uly__st = (call);                                                          \
        if (uly__st.code) return uly__st;                                                     \
    } while (0)

static ULY__PRINTF uly_status uly__err(uly_code code, const char *fmt, ...) {
    uly_status s;
    va_list ap;
    s.code = code;
    va_start(ap, fmt);
    vsnprintf(s.msg, sizeof s.msg, fmt, ap);
    va_end(ap);
    return s;
}

static uly_status uly__ok(void) {
    uly_status s;
    s.code = ULY_OK;
    s.msg[0] = 0;
    return s;
}

/* st as public function fn returns it: its message led by "fn: ", so that a caller who prints
   it knows which call failed, and what failed inside it (a helper, MPI, the communicator)
   follows. */
static uly_status uly__named(const char *fn, uly_status st) {
    const size_t n = strlen(fn) + 2, cap = sizeof st.msg - 1; /* fn, ": "; then the NUL */
    if (!st.code) return st;
    size_t m = strlen(st.msg);
    if (m > cap - n) m = cap - n; /* the message's end gives way */
    memmove(st.msg + n, st.msg, m);
    memcpy(st.msg, fn, n - 2);
    memcpy(st.msg + n - 2, ": ", 2);
    st.msg[n + m] = 0;
    return st;
}

/* Sizes: an overflow, or an operand that already overflowed (-1), gives -1, so a chain of them
   is checked once at its end. */
static int64_t uly__mul(int64_t a, int64_t b) {
    return a < 0 || b < 0 || (b && a > INT64_MAX / b) ? -1 : a * b;
}

static int64_t uly__add(int64_t a, int64_t b) {
    return a < 0 || b < 0 || a > INT64_MAX - b ? -1 : a + b;
}

/* Buffers inside the workspace and `saved` start on 256-byte boundaries (GPU vector loads). */
static int64_t uly__align(int64_t n) {
    return n < 0 || n > INT64_MAX - 255 ? -1 : (n + 255) & ~(int64_t)255;
}

static int64_t uly__max(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t uly__min(int64_t a, int64_t b) { return a < b ? a : b; }

static void *uly__ptr(void *base, int64_t off) { return base ? (char *)base + off : NULL; }

/* ---------------------------------------------------------------------------------------------
   Tensors */

ULYDEF int64_t uly_dtype_size(uly_dtype t) {
    return t == ULY_F32 ? 4 : t == ULY_BF16 || t == ULY_F16 ? 2 : 0;
}

static const char *uly__dtype_name(uly_dtype t) {
    return t == ULY_F32 ? "f32" : t == ULY_BF16 ? "bf16" : t == ULY_F16 ? "f16" : "invalid";
}

ULYDEF uly_tensor uly_dense(void *data, uly_dtype t, int64_t b, int64_t s, int64_t h, int64_t d) {
    uly_tensor x;
    x.data = data;
    x.b = b, x.s = s, x.h = h, x.d = d;
    x.sh = d;
    x.ss = uly__mul(h, d);
    x.sb = uly__mul(s, x.ss);
    x.dtype = t;
    return x;
}

/* Address of row (b, s, h). */
static char *uly__at(uly_tensor t, int64_t b, int64_t s, int64_t h) {
    return (char *)t.data + (b * t.sb + s * t.ss + h * t.sh) * uly_dtype_size(t.dtype);
}

/* A slice out of range has no data, so whatever it is passed to rejects it. */
ULYDEF uly_tensor uly_head_slice(uly_tensor t, int64_t h0, int64_t n) {
    int ok = t.data && n >= 0 && n <= t.h && h0 >= 0 && h0 <= t.h - n &&
             uly__mul(uly__mul(h0, t.sh), uly_dtype_size(t.dtype)) >= 0;
    t.data = ok ? uly__at(t, 0, 0, h0) : NULL;
    t.h = n;
    return t;
}

static uly_tensor uly__token_slice(uly_tensor t, int64_t s0, int64_t n) {
    t.data = uly__at(t, 0, s0, 0);
    t.s = n;
    return t;
}

ULYDEF uly_status uly_qkv_views(void *qkv, uly_dtype t, int64_t b, int64_t s, int64_t nq,
                                int64_t nkv, int64_t d, uly_tensor *q, uly_tensor *k,
                                uly_tensor *v) {
    uly_tensor all = uly_dense(qkv, t, b, s, uly__add(nq, uly__mul(2, nkv)), d);
    ULY__CHECK(q && k && v, ULY_EINVAL, "uly_qkv_views: %s is NULL", !q ? "q" : !k ? "k" : "v");
    ULY__CHECK(b > 0 && s > 0 && d > 0 && nq >= 0 && nkv >= 0, ULY_EINVAL, "uly_qkv_views: b "
               "(%lld), s (%lld), d (%lld) must be > 0 and nq (%lld), nkv (%lld) >= 0",
               ULY__LL(b), ULY__LL(s), ULY__LL(d), ULY__LL(nq), ULY__LL(nkv));
    ULY__CHECK(uly__mul(uly__mul(b, all.sb), uly_dtype_size(t)) >= 0, ULY_EOVERFLOW,
               "uly_qkv_views: [%lld, %lld, %lld + 2 * %lld, %lld] overflows int64", ULY__LL(b),
               ULY__LL(s), ULY__LL(nq), ULY__LL(nkv), ULY__LL(d));
    *q = uly_head_slice(all, 0, nq);
    *k = uly_head_slice(all, nq, nkv);
    *v = uly_head_slice(all, uly__add(nq, nkv), nkv);
    return uly__ok();
}

/* Of the dims b, s, h still to visit (extent > 1), the one of the smallest stride; -1 when none
   is left. The caller visits it and sets its extent to 1. */
static int uly__next_dim(const int64_t ext[3], const int64_t str[3]) {
    int m = -1;
    for (int i = 0; i < 3; i++)
        if (ext[i] > 1 && (m < 0 || str[i] < str[m])) m = i;
    return m;
}

/* The rules of every view: data, a positive shape, strides that keep its rows of d elements
   apart, and byte offsets that fit int64. Visiting the dims from the smallest stride up, each
   stride must step over everything inside it. */
static uly_status uly__check_view(const char *name, uly_tensor t) {
    int64_t ext[3] = {t.b, t.s, t.h}, str[3] = {t.sb, t.ss, t.sh}, span = t.d;
    const char *dim[3] = {"sb", "ss", "sh"};
    ULY__CHECK(t.data, ULY_EINVAL, "%s: data is NULL", name);
    ULY__CHECK(uly_dtype_size(t.dtype), ULY_EINVAL, "%s: dtype (%d) is not a uly_dtype", name,
               (int)t.dtype);
    ULY__CHECK((uintptr_t)t.data % (uintptr_t)uly_dtype_size(t.dtype) == 0, ULY_EINVAL,
               "%s: data (%p) is not aligned to its element size (%lld bytes)", name, t.data,
               ULY__LL(uly_dtype_size(t.dtype)));
    ULY__CHECK(t.b > 0 && t.s > 0 && t.h > 0 && t.d > 0, ULY_EINVAL,
               "%s: shape [%lld, %lld, %lld, %lld] must be positive", name, ULY__LL(t.b),
               ULY__LL(t.s), ULY__LL(t.h), ULY__LL(t.d));
    ULY__CHECK((t.sb != -1 && t.ss != -1 && t.sh != -1) ||
                   uly__mul(uly__mul(uly__mul(t.b, t.s), t.h), t.d) >= 0,
               ULY_EOVERFLOW, "%s: shape [%lld, %lld, %lld, %lld] overflows int64 (uly_dense "
               "marks its strides -1)", name, ULY__LL(t.b), ULY__LL(t.s), ULY__LL(t.h),
               ULY__LL(t.d));
    ULY__CHECK(t.sb >= 0 && t.ss >= 0 && t.sh >= 0, ULY_EINVAL,
               "%s: strides (sb %lld, ss %lld, sh %lld) must be >= 0", name, ULY__LL(t.sb),
               ULY__LL(t.ss), ULY__LL(t.sh));
    for (int m; (m = uly__next_dim(ext, str)) >= 0;) {
        ULY__CHECK(str[m] >= span, ULY_EINVAL,
                   "%s: %s (%lld) < %lld: rows of the view overlap (the last dim must be "
                   "contiguous and rows apart)", name, dim[m], ULY__LL(str[m]), ULY__LL(span));
        span = uly__add(uly__mul(str[m], ext[m] - 1), span);
        ext[m] = 1;
    }
    ULY__CHECK(uly__mul(span, uly_dtype_size(t.dtype)) >= 0, ULY_EOVERFLOW,
               "%s: the view spans more bytes than int64 holds", name);
    return uly__ok();
}

/* Bytes from a checked view's data (its first byte: strides are >= 0) past its last. */
static int64_t uly__span(uly_tensor t) {
    return ((t.b - 1) * t.sb + (t.s - 1) * t.ss + (t.h - 1) * t.sh + t.d) *
           uly_dtype_size(t.dtype);
}

/* Whether bytes [a, a + an) and [b, b + bn) meet (by distances, which cannot wrap around). */
static int uly__meet(const void *a, int64_t an, const void *b, int64_t bn) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x <= y ? y - x < (uintptr_t)an : x - y < (uintptr_t)bn;
}

/* Whether view x moved on by `at` elements lands between its own rows. Visited from the
   smallest stride up, each stride must be at least the extent times the one inside it: then
   row starts lie at least the smallest stride apart, and [at, at + d) fits in each gap. */
static int uly__in_gaps(uly_tensor x, int64_t at) {
    int64_t ext[3] = {x.b, x.s, x.h}, str[3] = {x.sb, x.ss, x.sh}, inner = 0, cell = 0;
    for (int m; (m = uly__next_dim(ext, str)) >= 0;) {
        if (!inner) inner = str[m];
        else if (str[m] < cell) return 0;
        cell = uly__mul(str[m], ext[m]);
        if (cell < 0) return 0;
        ext[m] = 1;
    }
    return at >= x.d && (!inner || at <= inner - x.d);
}

/* Whether two checked views of one dtype may share an element. Views whose bytes interleave
   can still be apart: the q, k and v heads of one fused buffer take turns row by row. They are
   apart when they are two slices, one after the other, of one valid view along one of its dims
   (same strides, same extents in the other dims: uly_qkv_views' [.., H + 2 Hkv, D]), or the
   same view moved within the gaps between its rows ([.., H, 3, D]); anything else whose bytes
   meet counts as shared. */
static int uly__share(uly_tensor x, uly_tensor y) {
    if (!uly__meet(x.data, uly__span(x), y.data, uly__span(y))) return 0;
    if ((uintptr_t)y.data < (uintptr_t)x.data) {
        uly_tensor t = x;
        x = y, y = t;
    }
    const uintptr_t gap = (uintptr_t)y.data - (uintptr_t)x.data;
    const int64_t es = uly_dtype_size(x.dtype), at = (int64_t)(gap / (uintptr_t)es);
    const int64_t ex[3] = {x.b, x.s, x.h}, ey[3] = {y.b, y.s, y.h};
    int64_t str[3] = {x.sb, x.ss, x.sh}, sy[3] = {y.sb, y.ss, y.sh};
    for (int i = 0; i < 3; i++) { /* a dim of extent 1 never applies its stride: any will do */
        if (ex[i] == 1) str[i] = sy[i];
        else if (ey[i] == 1) sy[i] = str[i];
    }
    if (gap % (uintptr_t)es || x.d != y.d || memcmp(str, sy, sizeof str)) return 1;
    x.sb = str[0], x.ss = str[1], x.sh = str[2];
    if (!memcmp(ex, ey, sizeof ex) && uly__in_gaps(x, at)) return 0;
    for (int m = 0; m < 3; m++) {
        const int a = (m + 1) % 3, b = (m + 2) % 3;
        if (!str[m] || at % str[m] || at / str[m] < ex[m] || ex[a] != ey[a] || ex[b] != ey[b])
            continue;
        /* y starts at index at / str[m] along m, past x's end: both in one view, if it is valid */
        uly_tensor both = x;
        const int64_t n = uly__add(at / str[m], ey[m]);
        if (m == 0) both.b = n;
        else if (m == 1) both.s = n;
        else both.h = n;
        if (!uly__check_view("", both).code) return 0;
    }
    return 1;
}

/* t is a valid view with the shape and dtype of want. */
static uly_status uly__check_like(const char *name, uly_tensor t, uly_tensor want) {
    ULY__CHECK(t.data, ULY_EINVAL, "%s: data is NULL", name);
    ULY__CHECK(t.b == want.b && t.s == want.s && t.h == want.h && t.d == want.d, ULY_EINVAL,
               "%s: shape [%lld, %lld, %lld, %lld], want [%lld, %lld, %lld, %lld]", name,
               ULY__LL(t.b), ULY__LL(t.s), ULY__LL(t.h), ULY__LL(t.d), ULY__LL(want.b),
               ULY__LL(want.s), ULY__LL(want.h), ULY__LL(want.d));
    ULY__CHECK(t.dtype == want.dtype, ULY_EINVAL, "%s: dtype %s, want %s",
               name, uly__dtype_name(t.dtype), uly__dtype_name(want.dtype));
    return uly__check_view(name, t);
}

/* ---------------------------------------------------------------------------------------------
   The plan */

static int uly__is_kv(uly_xchg x) { return x == ULY_X_KV || x == ULY_X_DKV; }
static int uly__to_head(uly_xchg x) { return x == ULY_X_Q || x == ULY_X_KV; }

/* n items over P ranks in order, the first n % P ranks one more. */
static uly_range uly__split(int64_t n, int P, int r) {
    uly_range g;
    int64_t q = n / P, m = n % P;
    g.start = r * q + uly__min(r, m);
    g.count = q + (r < m);
    return g;
}

static uly_range uly__none(void) {
    uly_range g = {0, 0};
    return g;
}

/* The plan's rules: any S >= P and H >= P (no padding), Hkv dividing H. */
static uly_status uly__check_desc(const uly_plan_desc *d) {
    int P = d->sp_size;
    ULY__CHECK(P >= 1 && P <= ULY_MAX_SP, ULY_EINVAL, "sp_size (%d) must be in [1, %d]", P,
               ULY_MAX_SP);
    ULY__CHECK(d->world_size >= 1 && d->world_size % P == 0, ULY_EINVAL,
               "world_size (%d) must be a positive multiple of sp_size (%d)", d->world_size, P);
    ULY__CHECK(d->rank >= 0 && d->rank < d->world_size, ULY_EINVAL,
               "rank (%d) must be in [0, world_size (%d))", d->rank, d->world_size);
    ULY__CHECK(d->batch >= 1, ULY_EINVAL, "batch (%lld) must be >= 1", ULY__LL(d->batch));
    ULY__CHECK(d->seq_len >= P, ULY_EINVAL,
               "sp_size (%d) > seq_len (%lld): every rank needs at least one token", P,
               ULY__LL(d->seq_len));
    ULY__CHECK(d->n_heads >= P, ULY_EINVAL,
               "sp_size (%d) > n_heads (%lld): every rank needs at least one query head", P,
               ULY__LL(d->n_heads));
    ULY__CHECK(d->n_kv_heads >= 1 && d->n_heads % d->n_kv_heads == 0, ULY_EINVAL,
               "n_kv_heads (%lld) must divide n_heads (%lld) (0 means n_heads)",
               ULY__LL(d->n_kv_heads), ULY__LL(d->n_heads));
    ULY__CHECK(d->head_dim >= 1, ULY_EINVAL, "head_dim (%lld) must be >= 1",
               ULY__LL(d->head_dim));
    ULY__CHECK(uly_dtype_size(d->dtype), ULY_EINVAL, "dtype (%d) is not a uly_dtype",
               (int)d->dtype);
    ULY__CHECK(d->max_bytes >= 0, ULY_EINVAL, "max_bytes (%lld) must be >= 0 (0 = no limit)",
               ULY__LL(d->max_bytes));
    return uly__ok();
}

/* Bytes of a [B, tokens, heads, D] block. */
static int64_t uly__bytes(const uly_plan *p, int64_t tokens, int64_t heads) {
    int64_t n = uly__mul(p->desc.batch, tokens);
    return uly__mul(uly__mul(uly__mul(n, heads), p->desc.head_dim), p->elem_size);
}

static int uly__same_desc(const uly_plan_desc *a, const uly_plan_desc *b) {
    return a->world_size == b->world_size && a->rank == b->rank && a->sp_size == b->sp_size &&
           a->batch == b->batch && a->seq_len == b->seq_len && a->n_heads == b->n_heads &&
           a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim &&
           a->dtype == b->dtype && a->max_bytes == b->max_bytes;
}

/* p is as uly_plan_init made it: the desc it validated, the fields derived from it, and a fused
   buffer whose bytes fit int64. A plan edited afterwards would size and index buffers by fields
   that disagree, or by sizes init never checked; the rest guards a plan never made (zeroed
   memory has desc == made, and sp_size 0). */
static int uly__plan_ok(const uly_plan *p) {
    return p && uly__same_desc(&p->desc, &p->made) && !uly__check_desc(&p->desc).code &&
           p->sp_rank == p->desc.rank % p->desc.sp_size &&
           p->dp_rank == p->desc.rank / p->desc.sp_size &&
           p->group == p->desc.n_heads / p->desc.n_kv_heads &&
           p->elem_size == uly_dtype_size(p->desc.dtype) &&
           uly__bytes(p, p->desc.seq_len,
                      uly__add(p->desc.n_heads, uly__mul(2, p->desc.n_kv_heads))) >= 0;
}

ULYDEF uly_range uly_tokens(const uly_plan *p, int sp_rank) {
    if (!uly__plan_ok(p) || sp_rank < 0 || sp_rank >= p->desc.sp_size) return uly__none();
    return uly__split(p->desc.seq_len, p->desc.sp_size, sp_rank);
}

ULYDEF uly_range uly_heads(const uly_plan *p, int sp_rank) {
    if (!uly__plan_ok(p) || sp_rank < 0 || sp_rank >= p->desc.sp_size) return uly__none();
    return uly__split(p->desc.n_heads, p->desc.sp_size, sp_rank);
}

/* The kv heads of the first and the last query head of the rank, and all between. */
ULYDEF uly_range uly_kv_heads(const uly_plan *p, int sp_rank) {
    uly_range h = uly_heads(p, sp_rank), kv;
    if (!h.count) return h;
    kv.start = h.start / p->group;
    kv.count = (h.start + h.count - 1) / p->group - kv.start + 1;
    return kv;
}

/* The heads exchange x moves for an SP rank. */
static uly_range uly__xheads(const uly_plan *p, uly_xchg x, int r) {
    return uly__is_kv(x) ? uly_kv_heads(p, r) : uly_heads(p, r);
}

/* The two layouts of exchange x on this rank, as dense tensors. */
static uly_tensor uly__seq_layout(const uly_plan *p, uly_xchg x, void *data) {
    const uly_plan_desc *d = &p->desc;
    return uly_dense(data, d->dtype, d->batch, uly_tokens(p, p->sp_rank).count,
                     uly__is_kv(x) ? d->n_kv_heads : d->n_heads, d->head_dim);
}

static uly_tensor uly__head_layout(const uly_plan *p, uly_xchg x, void *data) {
    const uly_plan_desc *d = &p->desc;
    return uly_dense(data, d->dtype, d->batch, d->seq_len, uly__xheads(p, x, p->sp_rank).count,
                     d->head_dim);
}

/* For peer j, rank r holds the block [B, S_r, H_j, D] in sequence layout and [B, S_j, H_r, D]
   in head layout. seq->head sends the first and receives the second; head->seq the reverse. */
ULYDEF uly_status uly_exchange_counts(const uly_plan *p, uly_xchg x, int64_t *send_counts,
                                      int64_t *send_offs, int64_t *recv_counts,
                                      int64_t *recv_offs) {
    int64_t sent = 0, got = 0;
    ULY__CHECK(uly__plan_ok(p), ULY_EINVAL, "uly_exchange_counts: plan is NULL or not as "
               "uly_plan_init made it");
    ULY__CHECK(x >= ULY_X_Q && x <= ULY_X_DKV, ULY_EINVAL, "uly_exchange_counts: x (%d) is not "
               "a uly_xchg", (int)x);
    ULY__CHECK(send_counts && send_offs && recv_counts && recv_offs, ULY_EINVAL,
               "uly_exchange_counts: a count or offset array is NULL");
    for (int j = 0; j < p->desc.sp_size; j++) {
        int r = p->sp_rank;
        int64_t seq = uly__bytes(p, uly_tokens(p, r).count, uly__xheads(p, x, j).count);
        int64_t head = uly__bytes(p, uly_tokens(p, j).count, uly__xheads(p, x, r).count);
        send_counts[j] = uly__to_head(x) ? seq : head;
        recv_counts[j] = uly__to_head(x) ? head : seq;
        send_offs[j] = sent, recv_offs[j] = got;
        sent += send_counts[j], got += recv_counts[j];
    }
    return uly__ok();
}

/* Every block of exchange x on every rank has one size. It depends on the plan only, so every
   rank finds the same (what a collective all-to-all needs). */
static int uly__uniform(const uly_plan *p, uly_xchg x) {
    for (int j = 1; j < p->desc.sp_size; j++)
        if (uly_tokens(p, j).count != uly_tokens(p, 0).count ||
            uly__xheads(p, x, j).count != uly__xheads(p, x, 0).count)
            return 0;
    return 1;
}

/* Sums of the counts: [0] sent, [1] received. */
static void uly__xbytes(const uly_plan *p, uly_xchg x, int64_t total[2]) {
    int64_t c[4][ULY_MAX_SP];
    total[0] = total[1] = 0;
    if (uly_exchange_counts(p, x, c[0], c[1], c[2], c[3]).code) return;
    for (int j = 0; j < p->desc.sp_size; j++) total[0] += c[0][j], total[1] += c[2][j];
}

ULYDEF int64_t uly_send_bytes(const uly_plan *p, uly_xchg x) {
    int64_t t[2];
    uly__xbytes(p, x, t);
    return t[0];
}

ULYDEF int64_t uly_recv_bytes(const uly_plan *p, uly_xchg x) {
    int64_t t[2];
    uly__xbytes(p, x, t);
    return t[1];
}

/* The largest message of any exchange goes from the rank with the most tokens to the rank
   with the most query heads: ranks 0 and 0, as the first S % P and H % P ranks get one more. A
   rank needs at most one kv head per query head, so KV and DKV blocks are no larger. */
static uly_status uly__check_peer_bytes(const uly_plan *p, int64_t max_bytes, const char *field) {
    int64_t peer = uly__bytes(p, uly_tokens(p, 0).count, uly_heads(p, 0).count);
    ULY__CHECK(!max_bytes || peer <= max_bytes, ULY_EOVERFLOW,
               "%s (%lld) < %lld bytes, the largest per-peer message (%lld tokens x %lld heads)",
               field, ULY__LL(max_bytes), ULY__LL(peer), ULY__LL(uly_tokens(p, 0).count),
               ULY__LL(uly_heads(p, 0).count));
    return uly__ok();
}

/* ---------------------------------------------------------------------------------------------
   Buffers: what the forward saves for the backward, and the layer's scratch */

/* Head-layout tensors of this rank: q and o [B, S, H_r, D], k and v [B, S, Hkv_r, D]. */
typedef struct uly__heads {
    uly_tensor q, k, v, o;
} uly__heads;

/* Lays out q, k, v, o from base, in this order (base NULL: sizes only). Returns the bytes,
   -1 on overflow. */
static int64_t uly__heads_at(const uly_plan *p, void *base, uly__heads *t) {
    int64_t nq = uly__align(uly__bytes(p, p->desc.seq_len, uly_heads(p, p->sp_rank).count));
    int64_t nkv = uly__align(uly__bytes(p, p->desc.seq_len, uly_kv_heads(p, p->sp_rank).count));
    t->q = uly__head_layout(p, ULY_X_Q, base);
    t->k = uly__head_layout(p, ULY_X_KV, uly__ptr(base, nq));
    t->v = uly__head_layout(p, ULY_X_KV, uly__ptr(base, uly__add(nq, nkv)));
    t->o = uly__head_layout(p, ULY_X_Q, uly__ptr(base, uly__add(nq, uly__mul(2, nkv))));
    return uly__mul(2, uly__add(nq, nkv));
}

/* saved = the head-layout q, k, v, o, then lse [B, H_r, S] in fp32. */
ULYDEF int64_t uly_saved_bytes(const uly_plan *p) {
    uly__heads h;
    int64_t lse;
    if (!uly__plan_ok(p)) return 0;
    lse = uly__mul(uly__mul(p->desc.batch, uly_heads(p, p->sp_rank).count), p->desc.seq_len);
    return uly__add(uly__heads_at(p, NULL, &h), uly__align(uly__mul(lse, 4)));
}

ULYDEF float *uly_saved_lse(const uly_plan *p, void *saved) {
    uly__heads h;
    if (!uly__plan_ok(p) || !saved) return NULL;
    return (float *)uly__ptr(saved, uly__heads_at(p, NULL, &h));
}

/* The layer's scratch: one send and one receive buffer, each big enough for every exchange,
   the head-layout gradients of the backward (dO in grad.o), then the attention's workspace. */
typedef struct uly__work {
    void *send, *recv, *attn;
    uly__heads grad;
} uly__work;

/* Lays out the scratch from base (NULL: sizes only); returns the bytes before the attention's
   part, -1 on overflow. */
static int64_t uly__work_at(const uly_plan *p, void *base, uly__work *w) {
    int64_t send = 0, recv = 0, at;
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++) {
        int64_t t[2];
        uly__xbytes(p, (uly_xchg)x, t);
        send = uly__max(send, t[0]), recv = uly__max(recv, t[1]);
    }
    w->send = base;
    at = uly__align(send);
    w->recv = uly__ptr(base, at);
    at = uly__add(at, uly__align(recv));
    at = uly__add(at, uly__heads_at(p, uly__ptr(base, at), &w->grad));
    w->attn = uly__ptr(base, at);
    return at;
}

/* Whether the fused QKV, saved and workspace bytes of every SP rank of q's group fit int64.
   saved and the workspace differ by rank (its heads, its largest blocks), and every rank of a
   group must refuse a shape alike, or its peers would wait for it in the first exchange. */
static int uly__sizes_fit(const uly_plan *p) {
    const uly_plan_desc *d = &p->desc;
    const int64_t heads = uly__add(d->n_heads, uly__mul(2, d->n_kv_heads));
    uly__work w;
    if (uly__bytes(p, d->seq_len, heads) < 0) return 0;
    /* Without asking each rank: no buffer of any rank exceeds F = B S H D max(elem, 4) bytes
       (a rank holds at most S tokens, H heads, as many kv heads as heads, and an exchange's
       blocks sum to at most S x H rows); saved and the workspace are at most 5 and 6 of them,
       each rounded up to 256 bytes. */
    const int64_t F = uly__mul(uly__bytes(p, d->seq_len, d->n_heads), 4 / p->elem_size);
    if (uly__mul(6, uly__add(F, 255)) >= 0) return 1;
    for (int r = 0; r < d->sp_size; r++) {
        uly_plan as = *p;
        as.sp_rank = r;
        as.desc.rank = as.made.rank = p->dp_rank * d->sp_size + r;
        if (uly_saved_bytes(&as) < 0 || uly__work_at(&as, NULL, &w) < 0) return 0;
    }
    return 1;
}

static uly_status uly__plan_init(uly_plan *p, const uly_plan_desc *desc) {
    uly_plan q;
    ULY__CHECK(p && desc, ULY_EINVAL, "%s is NULL", p ? "desc" : "p");
    memset(&q, 0, sizeof q);
    q.desc = *desc;
    if (!q.desc.n_kv_heads) q.desc.n_kv_heads = q.desc.n_heads;
    ULY__TRY(uly__check_desc(&q.desc));
    q.sp_rank = q.desc.rank % q.desc.sp_size;
    q.dp_rank = q.desc.rank / q.desc.sp_size;
    q.group = q.desc.n_heads / q.desc.n_kv_heads;
    q.elem_size = uly_dtype_size(q.desc.dtype);
    q.made = q.desc; /* the size queries below take q as made */
    /* Every size derived later, on any rank, is at most one of these: the queries need no
       checks. */
    ULY__CHECK(uly__sizes_fit(&q), ULY_EOVERFLOW,
               "batch (%lld), seq_len (%lld), heads (%lld + 2 x %lld), head_dim (%lld), "
               "%lld-byte elements: the fused QKV, saved or workspace bytes overflow int64",
               ULY__LL(q.desc.batch), ULY__LL(q.desc.seq_len), ULY__LL(q.desc.n_heads),
               ULY__LL(q.desc.n_kv_heads), ULY__LL(q.desc.head_dim), ULY__LL(q.elem_size));
    ULY__TRY(uly__check_peer_bytes(&q, q.desc.max_bytes, "max_bytes"));
    *p = q;
    return uly__ok();
}

ULYDEF uly_status uly_plan_init(uly_plan *p, const uly_plan_desc *desc) {
    return uly__named("uly_plan_init", uly__plan_init(p, desc));
}

/* ---------------------------------------------------------------------------------------------
   Communicators */

/* The local rules of an alltoallv call: arrays present, counts and offsets nonnegative, buffers
   present where bytes move, and send's bytes (first block to last) apart from recv's. */
static uly_status uly__check_counts(int P, const void *send, const int64_t *sc,
                                    const int64_t *so, const void *recv, const int64_t *rc,
                                    const int64_t *ro) {
    int64_t s0 = INT64_MAX, s1 = 0, r0 = INT64_MAX, r1 = 0; /* the bytes used: [s0, s1) */
    ULY__CHECK(sc && so && rc && ro, ULY_EINVAL, "alltoallv: a count or offset array is NULL");
    for (int j = 0; j < P; j++) {
        ULY__CHECK(uly__add(so[j], sc[j]) >= 0 && uly__add(ro[j], rc[j]) >= 0, ULY_EINVAL,
                   "alltoallv: peer %d: send %lld bytes at %lld, recv %lld at %lld: counts and "
                   "offsets must be >= 0 and their sums fit int64", j, ULY__LL(sc[j]),
                   ULY__LL(so[j]), ULY__LL(rc[j]), ULY__LL(ro[j]));
        ULY__CHECK((send || !sc[j]) && (recv || !rc[j]), ULY_EINVAL,
                   "alltoallv: %s is NULL but peer %d has bytes in it",
                   send || !sc[j] ? "recv" : "send", j);
        if (sc[j]) s0 = uly__min(s0, so[j]), s1 = uly__max(s1, so[j] + sc[j]);
        if (rc[j]) r0 = uly__min(r0, ro[j]), r1 = uly__max(r1, ro[j] + rc[j]);
    }
    ULY__CHECK(!s1 || !r1 || !uly__meet((const char *)send + s0, s1 - s0,
                                        (const char *)recv + r0, r1 - r0),
               ULY_EINVAL, "alltoallv: send[%lld, %lld) and recv[%lld, %lld) overlap in memory: "
               "an exchange cannot run in place", ULY__LL(s0), ULY__LL(s1), ULY__LL(r0),
               ULY__LL(r1));
    return uly__ok();
}

#ifndef ULYSSES_NO_THREADS
/* The local world: P threads meet at a barrier and read each other's published buffers. A rank
   that gives up, or returns from its function, breaks the world: its peers wake from the
   barrier with an error instead of waiting for it forever. */
typedef struct uly__slot { /* what a rank publishes for the collective in progress */
    const char *op;
    const char *send;
    const int64_t *send_counts, *send_offs, *recv_counts;
    double *buf;
    int64_t n;
} uly__slot;

typedef struct uly__world {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int size, arrived;
    int64_t rounds;    /* barriers completed */
    uly_status broken; /* why the world is broken; ULY_OK while whole */
    void (*fn)(const uly_comm *comm, void *user);
    void *user;
    uly__slot slot[ULY_MAX_SP];
} uly__world;

typedef struct uly__rank {
    uly__world *w;
    uly_comm comm;
    pthread_t thread;
} uly__rank;

/* Waits for every rank; fails if the world breaks first. A broken world meets no more: the
   arrivals of the ranks it woke still count, and a round completed without them would read
   slots their owners have since taken back. */
static uly_status uly__sync(uly__world *w) {
    uly_status st = uly__ok();
    pthread_mutex_lock(&w->mu);
    int64_t round = w->rounds;
    if (!w->broken.code && ++w->arrived == w->size) {
        w->arrived = 0;
        w->rounds++;
        pthread_cond_broadcast(&w->cv);
    }
    while (w->rounds == round && !w->broken.code) pthread_cond_wait(&w->cv, &w->mu);
    if (w->rounds == round) st = w->broken;
    pthread_mutex_unlock(&w->mu);
    return st;
}

static void uly__break(uly__world *w, uly_status why) {
    pthread_mutex_lock(&w->mu);
    if (!w->broken.code) w->broken = why;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* Every rank is in the same collective; reading the slots of another would go wrong. */
static uly_status uly__same_op(const uly__world *w) {
    for (int i = 1; i < w->size; i++)
        ULY__CHECK(!strcmp(w->slot[i].op, w->slot[0].op), ULY_ECOMM,
                   "local comm: rank 0 is in %s but rank %d in %s", w->slot[0].op, i,
                   w->slot[i].op);
    return uly__ok();
}

/* A rank that cannot take part breaks the world and returns its own error. */
static uly_status uly__give_up(uly__rank *me, uly_status why) {
    uly__break(me->w,
               uly__err(ULY_ECOMM, "local comm: rank %d failed: %s", me->comm.rank, why.msg));
    return why;
}

/* Publish, meet, and everyone checks the whole table (so all ranks agree on the verdict), copies
   what its peers send it, and meets again so no sender reuses its buffer while it is read. */
static uly_status uly__local_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                       const int64_t *send_offs, void *recv,
                                       const int64_t *recv_counts, const int64_t *recv_offs,
                                       void *stream) {
    uly__rank *me = (uly__rank *)ctx;
    uly__world *w = me->w;
    int P = w->size, r = me->comm.rank;
    uly_status st = uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts,
                                      recv_offs);
    (void)stream;
    if (st.code) return uly__give_up(me, st);
    w->slot[r].op = "alltoallv";
    w->slot[r].send = (const char *)send;
    w->slot[r].send_counts = send_counts;
    w->slot[r].send_offs = send_offs;
    w->slot[r].recv_counts = recv_counts;
    ULY__TRY(uly__sync(w));
    st = uly__same_op(w);
    for (int i = 0; i < P && !st.code; i++)
        for (int j = 0; j < P && !st.code; j++)
            if (w->slot[i].send_counts[j] != w->slot[j].recv_counts[i])
                st = uly__err(ULY_ECOMM, "alltoallv: rank %d sends %lld bytes to rank %d, which "
                              "expects %lld", i, ULY__LL(w->slot[i].send_counts[j]), j,
                              ULY__LL(w->slot[j].recv_counts[i]));
    for (int i = 0; i < P && !st.code; i++)
        if (recv_counts[i]) /* an empty block may have NULL buffers, which memcpy may not take */
            memcpy((char *)recv + recv_offs[i], w->slot[i].send + w->slot[i].send_offs[r],
                   (size_t)recv_counts[i]);
    uly_status done = uly__sync(w);
    return st.code ? st : done;
}

/* Rank r sums its share of the elements over the ranks in order 0..P-1 and writes the sum into
   every rank's buffer: all ranks get the bitwise-same result, and no element is read by one
   rank after another has written it. */
static uly_status uly__local_allreduce(void *ctx, double *buf, int64_t n, void *stream) {
    uly__rank *me = (uly__rank *)ctx;
    uly__world *w = me->w;
    int P = w->size, r = me->comm.rank;
    uly_status st = uly__ok();
    (void)stream;
    if (n < 0 || (n && !buf))
        return uly__give_up(me, uly__err(ULY_EINVAL, "allreduce_sum: n (%lld) must be >= 0 and "
                                         "buf not NULL", ULY__LL(n)));
    w->slot[r].op = "allreduce_sum";
    w->slot[r].buf = buf;
    w->slot[r].n = n;
    ULY__TRY(uly__sync(w));
    st = uly__same_op(w);
    for (int i = 0; i < P && !st.code; i++)
        if (w->slot[i].n != n)
            st = uly__err(ULY_ECOMM, "allreduce_sum: rank %d sums %lld values, rank %d %lld", i,
                          ULY__LL(w->slot[i].n), r, ULY__LL(n));
    uly_range mine = uly__split(st.code ? 0 : n, P, r);
    for (int64_t e = mine.start; e < mine.start + mine.count; e++) {
        double sum = w->slot[0].buf[e];
        for (int i = 1; i < P; i++) sum += w->slot[i].buf[e];
        for (int i = 0; i < P; i++) w->slot[i].buf[e] = sum;
    }
    uly_status done = uly__sync(w);
    return st.code ? st : done;
}

static uly_status uly__local_barrier(void *ctx) {
    uly__rank *me = (uly__rank *)ctx;
    me->w->slot[me->comm.rank].op = "barrier";
    ULY__TRY(uly__sync(me->w));
    uly_status st = uly__same_op(me->w), done = uly__sync(me->w);
    return st.code ? st : done;
}

static void *uly__rank_main(void *arg) {
    uly__rank *me = (uly__rank *)arg;
    me->w->fn(&me->comm, me->w->user);
    uly__break(me->w, uly__err(ULY_ECOMM, "local comm: rank %d has returned; no collective can "
                               "complete without it", me->comm.rank));
    return NULL;
}

ULYDEF uly_status uly_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                void *user) {
    uly__world w;
    uly__rank ranks[ULY_MAX_SP];
    uly_status st = uly__ok();
    int started = 0;
    ULY__CHECK(size >= 1 && size <= ULY_MAX_SP, ULY_EINVAL,
               "uly_local_run: size (%d) must be in [1, %d]", size, ULY_MAX_SP);
    ULY__CHECK(fn, ULY_EINVAL, "uly_local_run: fn is NULL");
    memset(&w, 0, sizeof w);
    ULY__CHECK(!pthread_mutex_init(&w.mu, NULL), ULY_ECOMM,
               "uly_local_run: pthread_mutex_init failed");
    if (pthread_cond_init(&w.cv, NULL)) {
        pthread_mutex_destroy(&w.mu);
        return uly__err(ULY_ECOMM, "uly_local_run: pthread_cond_init failed");
    }
    w.size = size, w.fn = fn, w.user = user;
    for (; started < size; started++) {
        uly__rank *me = &ranks[started];
        memset(me, 0, sizeof *me);
        me->w = &w;
        me->comm.size = size, me->comm.rank = started;
        me->comm.alltoallv = uly__local_alltoallv;
        me->comm.allreduce_sum = uly__local_allreduce;
        me->comm.barrier = uly__local_barrier;
        me->comm.ctx = me;
        if (pthread_create(&me->thread, NULL, uly__rank_main, me)) {
            st = uly__err(ULY_ECOMM, "uly_local_run: could not start the thread of rank %d",
                          started);
            uly__break(&w, st); /* the started ranks fail their collectives and return */
            break;
        }
    }
    for (int r = 0; r < started; r++) pthread_join(ranks[r].thread, NULL);
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    return st;
}
#endif /* ULYSSES_NO_THREADS */

#ifdef ULYSSES_MPI
/* The MPI communicator. Each call sets MPI_ERRORS_RETURN on its communicator while it runs, so
   a failure comes back as ULY_ECOMM with MPI's own message instead of aborting the job, and then
   gives the caller's error handler back (the manners the MPI standard asks of a library). */

static uly_status uly__mpi(int rc, const char *call) {
    char text[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (rc == MPI_SUCCESS) return uly__ok();
    if (MPI_Error_string(rc, text, &n) != MPI_SUCCESS) snprintf(text, sizeof text, "error %d", rc);
    return uly__err(ULY_ECOMM, "%s: %s", call, text);
}

/* The caller's error handler of comm goes to *old, and MPI_ERRORS_RETURN takes its place. */
static uly_status uly__mpi_enter(MPI_Comm comm, MPI_Errhandler *old) {
    ULY__TRY(uly__mpi(MPI_Comm_get_errhandler(comm, old), "MPI_Comm_get_errhandler"));
    const int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) MPI_Errhandler_free(old);
    return uly__mpi(rc, "MPI_Comm_set_errhandler");
}

/* Puts the caller's handler back on comm; st, or else the failure to put it back. */
static uly_status uly__mpi_leave(MPI_Comm comm, MPI_Errhandler *old, uly_status st) {
    const uly_status back =
        uly__mpi(MPI_Comm_set_errhandler(comm, *old), "MPI_Comm_set_errhandler");
    MPI_Errhandler_free(old);
    return st.code ? st : back;
}

/* The tag of the chunked messages: "ul", under the 32767 every MPI allows. */
enum { ULY__MPI_TAG = 0x756c };

/* Waits for n requests; a failure is the first failed request's own error, not
   MPI_ERR_IN_STATUS. */
static uly_status uly__mpi_wait(int n, MPI_Request *req) {
    MPI_Status status[2 * ULY_MAX_SP];
    const int rc = MPI_Waitall(n, req, status);
    for (int i = 0; rc == MPI_ERR_IN_STATUS && i < n; i++)
        if (status[i].MPI_ERROR != MPI_SUCCESS && status[i].MPI_ERROR != MPI_ERR_PENDING)
            return uly__mpi(status[i].MPI_ERROR, "MPI_Waitall");
    return uly__mpi(rc, "MPI_Waitall");
}

/* Moves the pairs whose count exceeds chunk bytes in rounds: round k carries the k-th chunk of
   each of those messages, so a round needs at most 2P requests and no message exceeds chunk. */
static uly_status uly__mpi_chunked(MPI_Comm comm, int P, int64_t chunk, const char *send,
                                   const int64_t *sc, const int64_t *so, char *recv,
                                   const int64_t *rc, const int64_t *ro) {
    MPI_Request req[2 * ULY_MAX_SP];
    for (int64_t at = 0;; at += chunk) {
        int n = 0, err = MPI_SUCCESS;
        for (int j = 0; j < P && !err; j++)
            if (rc[j] > chunk && rc[j] > at)
                err = MPI_Irecv(recv + ro[j] + at, (int)uly__min(chunk, rc[j] - at), MPI_BYTE, j,
                                ULY__MPI_TAG, comm, &req[n++]);
        for (int j = 0; j < P && !err; j++)
            if (sc[j] > chunk && sc[j] > at)
                err = MPI_Isend(send + so[j] + at, (int)uly__min(chunk, sc[j] - at), MPI_BYTE, j,
                                ULY__MPI_TAG, comm, &req[n++]);
        ULY__TRY(uly__mpi(err, "MPI_Isend/MPI_Irecv"));
        if (!n) return uly__ok();
        ULY__TRY(uly__mpi_wait(n, req));
    }
}

/* The block of n bytes at byte offset off as MPI_Alltoallw sees it: n bytes at displacement
   off, or, beyond an int displacement, one block of a type that carries its offset as an
   MPI_Aint; nothing for a pair that is empty or chunked. Each rank picks its own types (MPI
   matches type signatures, and both are n MPI_BYTEs), so no offset is out of reach and no rank
   needs to ask its peers. */
static uly_status uly__mpi_block(int64_t n, int64_t off, int64_t chunk, MPI_Datatype *type,
                                 int *count, int *at) {
    MPI_Aint far = (MPI_Aint)off;
    *type = MPI_BYTE, *count = 0, *at = 0;
    if (!n || n > chunk) return uly__ok();
    int len = (int)n; /* chunk <= INT_MAX */
    if (off <= INT_MAX) {
        *count = len, *at = (int)off;
        return uly__ok();
    }
    ULY__TRY(uly__mpi(MPI_Type_create_hindexed(1, &len, &far, MPI_BYTE, type),
                      "MPI_Type_create_hindexed"));
    *count = 1;
    return uly__mpi(MPI_Type_commit(type), "MPI_Type_commit");
}

/* Every rank tells each peer how many bytes it sends it (-1: none, as this rank's own arguments
   failed: mine) and in what chunks, and all learn whether any rank got a count it does not
   expect, or another chunk size. So bad counts or arguments on one rank fail every rank before
   a byte moves: none waits for a rank that returned, and no chunked message is left behind for
   the next call's receives to take. */
typedef struct uly__mpi_claim {
    int64_t bytes, chunk; /* what a rank sends a peer (-1: nothing, it failed), in what chunks */
} uly__mpi_claim;
static uly_status uly__mpi_agree(MPI_Comm comm, int P, uly_status mine, int64_t chunk,
                                 const int64_t *sc, const int64_t *rc) {
    uly__mpi_claim out[ULY_MAX_SP], in[ULY_MAX_SP];
    uly_status st = mine;
    int failed;
    for (int j = 0; j < P; j++) out[j].bytes = mine.code ? -1 : sc[j], out[j].chunk = chunk;
    ULY__TRY(uly__mpi(MPI_Alltoall(out, 2, MPI_INT64_T, in, 2, MPI_INT64_T, comm),
                      "MPI_Alltoall"));
    for (int i = 0; i < P && !st.code; i++) {
        if (in[i].bytes < 0)
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d failed (bad arguments) and sends nothing",
                          i);
        else if (in[i].chunk != chunk)
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d sends messages of up to %lld bytes, this "
                          "rank of up to %lld: every rank must use the same chunk_bytes", i,
                          ULY__LL(in[i].chunk), ULY__LL(chunk));
        else if (in[i].bytes != rc[i])
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d sends %lld bytes to this rank, which "
                          "expects %lld", i, ULY__LL(in[i].bytes), ULY__LL(rc[i]));
    }
    failed = st.code != 0;
    ULY__TRY(uly__mpi(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, comm),
                      "MPI_Allreduce"));
    ULY__TRY(st);
    ULY__CHECK(!failed, ULY_ECOMM, "alltoallv: %d rank(s) failed (bad arguments, or counts or "
               "chunks that do not match their senders')", failed);
    return uly__ok();
}

/* Pairs whose count fits a chunk move in one MPI_Alltoallw, larger ones in chunked messages:
   once the ranks agree on the counts, both ends of a pair see the same count and make the same
   choice. The blocks' types are made before the agreement, so that a rank which cannot make one
   fails there, with its peers, instead of leaving them in MPI_Alltoallw. */
static uly_status uly__mpi_exchange(uly_mpi *m, const void *send, const int64_t *send_counts,
                                    const int64_t *send_offs, void *recv,
                                    const int64_t *recv_counts, const int64_t *recv_offs) {
    int64_t chunk = m->chunk_bytes ? m->chunk_bytes : INT_MAX;
    int P, sn[ULY_MAX_SP], rn[ULY_MAX_SP], sd[ULY_MAX_SP], rd[ULY_MAX_SP];
    MPI_Datatype stype[ULY_MAX_SP], rtype[ULY_MAX_SP];
    uly_status st;
    ULY__TRY(uly__mpi(MPI_Comm_size(m->comm, &P), "MPI_Comm_size"));
    ULY__CHECK(P <= ULY_MAX_SP, ULY_EINVAL, "alltoallv: the communicator has %d ranks, more than "
               "ULY_MAX_SP (%d): an SP group is at most that", P, ULY_MAX_SP);
    st = uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts, recv_offs);
    for (int j = 0; j < P; j++) stype[j] = rtype[j] = MPI_BYTE;
    for (int j = 0; j < P && !st.code; j++) {
        st = uly__mpi_block(send_counts[j], send_offs[j], chunk, &stype[j], &sn[j], &sd[j]);
        if (!st.code)
            st = uly__mpi_block(recv_counts[j], recv_offs[j], chunk, &rtype[j], &rn[j], &rd[j]);
    }
    st = uly__mpi_agree(m->comm, P, st, chunk, send_counts, recv_counts);
    if (!st.code)
        st = uly__mpi(MPI_Alltoallw(send, sn, sd, stype, recv, rn, rd, rtype, m->comm),
                      "MPI_Alltoallw");
    for (int j = 0; j < P; j++) {
        if (stype[j] != MPI_BYTE) MPI_Type_free(&stype[j]);
        if (rtype[j] != MPI_BYTE) MPI_Type_free(&rtype[j]);
    }
    if (st.code) return st;
    return uly__mpi_chunked(m->comm, P, chunk, (const char *)send, send_counts, send_offs,
                            (char *)recv, recv_counts, recv_offs);
}

static uly_status uly__mpi_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                     const int64_t *send_offs, void *recv,
                                     const int64_t *recv_counts, const int64_t *recv_offs,
                                     void *stream) {
    uly_mpi *m = (uly_mpi *)ctx;
    MPI_Errhandler old;
    (void)stream;
    ULY__TRY(uly__mpi_enter(m->comm, &old));
    return uly__mpi_leave(m->comm, &old, uly__mpi_exchange(m, send, send_counts, send_offs, recv,
                                                           recv_counts, recv_offs));
}

static uly_status uly__mpi_sum(MPI_Comm comm, double *buf, int64_t n) {
    ULY__CHECK(n >= 0 && (buf || !n), ULY_EINVAL, "allreduce_sum: n (%lld) must be >= 0 and buf "
               "not NULL", ULY__LL(n));
    for (int64_t at = 0; at < n; at += INT_MAX)
        ULY__TRY(uly__mpi(MPI_Allreduce(MPI_IN_PLACE, buf + at, (int)uly__min(n - at, INT_MAX),
                                        MPI_DOUBLE, MPI_SUM, comm), "MPI_Allreduce"));
    return uly__ok();
}

static uly_status uly__mpi_allreduce(void *ctx, double *buf, int64_t n, void *stream) {
    const MPI_Comm comm = ((uly_mpi *)ctx)->comm;
    MPI_Errhandler old;
    (void)stream;
    ULY__TRY(uly__mpi_enter(comm, &old));
    return uly__mpi_leave(comm, &old, uly__mpi_sum(comm, buf, n));
}

static uly_status uly__mpi_barrier(void *ctx) {
    const MPI_Comm comm = ((uly_mpi *)ctx)->comm;
    MPI_Errhandler old;
    ULY__TRY(uly__mpi_enter(comm, &old));
    return uly__mpi_leave(comm, &old, uly__mpi(MPI_Barrier(comm), "MPI_Barrier"));
}

/* An intracommunicator's size and this process's rank in it. */
static uly_status uly__mpi_group(MPI_Comm comm, const char *name, int *size, int *rank) {
    int inter = 0;
    ULY__TRY(uly__mpi(MPI_Comm_test_inter(comm, &inter), "MPI_Comm_test_inter"));
    ULY__CHECK(!inter, ULY_EINVAL, "%s is an intercommunicator: ranks of one group exchange here",
               name);
    ULY__TRY(uly__mpi(MPI_Comm_size(comm, size), "MPI_Comm_size"));
    return uly__mpi(MPI_Comm_rank(comm, rank), "MPI_Comm_rank");
}

/* The comm keeps a pointer to m, which must outlive it. */
static uly_status uly__mpi_comm(uly_mpi *m, uly_comm *out) {
    int size, rank;
    MPI_Errhandler old;
    ULY__CHECK(m && out, ULY_EINVAL, "%s is NULL", m ? "out" : "m");
    ULY__CHECK(m->comm != MPI_COMM_NULL, ULY_EINVAL, "m->comm is MPI_COMM_NULL");
    ULY__CHECK(m->chunk_bytes >= 0 && m->chunk_bytes <= INT_MAX, ULY_EINVAL,
               "chunk_bytes (%lld) must be in [0, INT_MAX] (0 = INT_MAX)",
               ULY__LL(m->chunk_bytes));
    ULY__TRY(uly__mpi_enter(m->comm, &old));
    ULY__TRY(uly__mpi_leave(m->comm, &old, uly__mpi_group(m->comm, "m->comm", &size, &rank)));
    memset(out, 0, sizeof *out);
    out->size = size, out->rank = rank;
    out->alltoallv = uly__mpi_alltoallv;
    out->allreduce_sum = uly__mpi_allreduce;
    out->barrier = uly__mpi_barrier;
    out->ctx = m;
    return uly__ok();
}

ULYDEF uly_status uly_mpi_comm(uly_mpi *m, uly_comm *out) {
    return uly__named("uly_mpi_comm", uly__mpi_comm(m, out));
}

/* SP groups are sp_size consecutive ranks (color rank / sp_size); a DP group takes the ranks
   with the same position in each SP group (color rank % sp_size). The ranks first learn each
   other's sp_size (0 for a rank whose arguments are bad), so that all refuse alike instead of
   some waiting for the others in a split, or splitting into groups that do not fit. */
static uly_status uly__mpi_split_world(MPI_Comm world, int sp_size, MPI_Comm *sp, MPI_Comm *dp) {
    int size, rank;
    uly_status st;
    const int mine = sp && dp && sp_size >= 1 && sp_size <= ULY_MAX_SP ? sp_size : 0;
    int range[2] = {mine, -mine}; /* the world's smallest sp_size, and its largest negated */
    ULY__TRY(uly__mpi_group(world, "world", &size, &rank));
    ULY__TRY(uly__mpi(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MIN, world),
                      "MPI_Allreduce"));
    ULY__CHECK(sp && dp, ULY_EINVAL, "%s is NULL", sp ? "dp" : "sp");
    ULY__CHECK(mine, ULY_EINVAL, "sp_size (%d) must be in [1, %d]", sp_size, ULY_MAX_SP);
    ULY__CHECK(range[0] == -range[1], ULY_EINVAL, "sp_size differs between the world's ranks: "
               "from %d to %d (0: a rank's sp_size out of range, or its sp or dp NULL), %d here",
               range[0], -range[1], sp_size);
    ULY__CHECK(size % sp_size == 0, ULY_EINVAL, "sp_size (%d) must divide the world size (%d)",
               sp_size, size);
    st = uly__mpi(MPI_Comm_split(world, rank / sp_size, rank, sp), "MPI_Comm_split (sp)");
    if (!st.code) {
        st = uly__mpi(MPI_Comm_split(world, rank % sp_size, rank, dp), "MPI_Comm_split (dp)");
        if (st.code) MPI_Comm_free(sp);
    }
    if (st.code) *sp = *dp = MPI_COMM_NULL; /* MPI does not say what a failed split leaves */
    return st;
}

static uly_status uly__mpi_split(MPI_Comm world, int sp_size, MPI_Comm *sp, MPI_Comm *dp) {
    MPI_Errhandler old;
    if (sp) *sp = MPI_COMM_NULL;
    if (dp) *dp = MPI_COMM_NULL;
    ULY__CHECK(world != MPI_COMM_NULL, ULY_EINVAL, "world is MPI_COMM_NULL");
    ULY__TRY(uly__mpi_enter(world, &old));
    return uly__mpi_leave(world, &old, uly__mpi_split_world(world, sp_size, sp, dp));
}

ULYDEF uly_status uly_mpi_split(MPI_Comm world, int sp_size, MPI_Comm *sp, MPI_Comm *dp) {
    return uly__named("uly_mpi_split", uly__mpi_split(world, sp_size, sp, dp));
}
#endif /* ULYSSES_MPI */

/* ---------------------------------------------------------------------------------------------
   bf16 and fp16 <-> fp32, for the sums of the CPU layout. Widening is exact; rounding is to
   nearest, ties to even, overflow to inf, as CUDA's __float2bfloat16_rn and __float2half_rn,
   and a NaN rounds to the canonical 0x7fff as theirs do. */

static uint32_t uly__f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float uly__bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* v / 2^n rounded to nearest, ties to even; 0 < n < 32. A carry out of the mantissa steps the
   exponent, which is what rounding up to the next binade is. */
static uint32_t uly__shift_rne(uint32_t v, int n) {
    uint32_t q = v >> n, rest = v & ((1u << n) - 1), half = 1u << (n - 1);
    return q + (rest > half || (rest == half && (q & 1)));
}

/* bf16 is the top half of fp32. */
static float uly__bf16_to_f32(uint16_t h) { return uly__bits_f32((uint32_t)h << 16); }

static uint16_t uly__f32_to_bf16(float x) {
    uint32_t u = uly__f32_bits(x);
    return (u & 0x7fffffff) > 0x7f800000 ? 0x7fff : (uint16_t)uly__shift_rne(u, 16);
}

/* fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; exponent 0 is m * 2^-24. */
static float uly__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 0x3ff;
    if (e == 31) return uly__bits_f32(sign | 0x7f800000 | m << 13); /* inf, NaN */
    float v = e ? ldexpf((float)(m | 0x400), (int)e - 25) : ldexpf((float)m, -24);
    return sign ? -v : v;
}

static uint16_t uly__f32_to_f16(float x) {
    uint32_t u = uly__f32_bits(x), a = u & 0x7fffffff, e = a >> 23, h;
    if (a > 0x7f800000) return 0x7fff;                                /* NaN */
    if (a >= 0x47800000) h = 0x7c00;                                  /* 2^16 and up: inf */
    else if (e >= 113) h = uly__shift_rne(a - (112u << 23), 13);      /* normal: rebias */
    else if (e >= 102) /* subnormal: a multiple of 2^-24 */
        h = uly__shift_rne((a & 0x7fffff) | 0x800000, (int)(126 - e));
    else h = 0; /* below 2^-25, half the smallest subnormal */
    return (uint16_t)(((u >> 16) & 0x8000) | h);
}

/* The element of dtype t at x, widened to fp32, and an fp32 value rounded into one. */
static float uly__load(uly_dtype t, const char *x) {
    float f;
    uint16_t h;
    if (t == ULY_F32) {
        memcpy(&f, x, 4);
        return f;
    }
    memcpy(&h, x, 2);
    return t == ULY_BF16 ? uly__bf16_to_f32(h) : uly__f16_to_f32(h);
}

static void uly__store(uly_dtype t, char *x, float f) {
    uint16_t h;
    if (t == ULY_F32) {
        memcpy(x, &f, 4);
        return;
    }
    h = t == ULY_BF16 ? uly__f32_to_bf16(f) : uly__f32_to_f16(f);
    memcpy(x, &h, 2);
}

/* ---------------------------------------------------------------------------------------------
   CPU layout: every direction of every exchange is one strided block copy per peer, but the
   DKV unpack, which adds up the copies of a kv head that several ranks hold */

/* dst = src, two views of one shape. Heads, then tokens, that are contiguous in both views are
   copied as one run. */
static void uly__move(uly_tensor dst, uly_tensor src) {
    int64_t run = dst.d, nh = dst.h, ns = dst.s, es = uly_dtype_size(dst.dtype);
    ULY_ASSERT(dst.b == src.b && dst.s == src.s && dst.h == src.h && dst.d == src.d);
    if (nh == 1 || (dst.sh == run && src.sh == run)) {
        run *= nh, nh = 1;
        if (ns == 1 || (dst.ss == run && src.ss == run)) run *= ns, ns = 1;
    }
    for (int64_t b = 0; b < dst.b; b++)
        for (int64_t s = 0; s < ns; s++)
            for (int64_t h = 0; h < nh; h++)
                memcpy(uly__at(dst, b, s, h), uly__at(src, b, s, h), (size_t)(run * es));
}

/* Unpacking DKV: head h of t is the sum of the gradient copies of the peers that hold it
   (several when a rank's first query head is not the first of its kv group), widened to fp32,
   added in peer order and rounded once to t's dtype, as the CUDA kernel computes; a head only
   one peer holds is copied. */
static void uly__sum_kv_copies(const uly_plan *p, uly_tensor t, const char *recv) {
    uly_tensor copy[ULY_MAX_SP]; /* peer m's block: its kv heads from start[m] on */
    int64_t start[ULY_MAX_SP], es = uly_dtype_size(t.dtype);
    int P = p->desc.sp_size, j = 0;
    for (int m = 0; m < P; m++) {
        uly_range hx = uly__xheads(p, ULY_X_DKV, m);
        copy[m] = uly_dense((char *)recv, t.dtype, t.b, t.s, hx.count, t.d);
        start[m] = hx.start;
        recv += uly__bytes(p, t.s, hx.count);
    }
    for (int64_t h = 0; h < t.h; h++) {
        while (h >= start[j] + copy[j].h) j++; /* j: the first peer that holds head h */
        int k = j + 1;                         /* k - 1: the last */
        while (k < P && start[k] <= h) k++;
        if (k == j + 1) {
            uly__move(uly_head_slice(t, h, 1), uly_head_slice(copy[j], h - start[j], 1));
            continue;
        }
        for (int64_t b = 0; b < t.b; b++)
            for (int64_t s = 0; s < t.s; s++)
                for (int64_t e = 0; e < t.d; e++) {
                    float acc = uly__load(t.dtype, uly__at(copy[j], b, s, h - start[j]) + e * es);
                    for (int m = j + 1; m < k; m++)
                        acc += uly__load(t.dtype, uly__at(copy[m], b, s, h - start[m]) + e * es);
                    uly__store(t.dtype, uly__at(t, b, s, h) + e * es, acc);
                }
    }
}

/* The rules of every layout, CPU and CUDA: a plan as uly_plan_init made it, an exchange, t a
   valid view of the layout that x packs from (pack) or unpacks to, and an exchange buffer
   aligned to the element size. */
static uly_status uly__check_move(const uly_plan *p, uly_xchg x, int pack, uly_tensor t,
                                  const void *buf) {
    static const char *const names[] = {"Q", "KV", "O", "DKV"};
    char what[32];
    ULY__CHECK(uly__plan_ok(p), ULY_EINVAL,
               "layout: plan is NULL or not as uly_plan_init made it");
    ULY__CHECK(x >= ULY_X_Q && x <= ULY_X_DKV, ULY_EINVAL, "layout: x (%d) is not a uly_xchg",
               (int)x);
    snprintf(what, sizeof what, "%s %s: %s", pack ? "pack" : "unpack", names[x],
             pack ? "src" : "dst");
    ULY__TRY(uly__check_like(what, t, pack == uly__to_head(x) ? uly__seq_layout(p, x, NULL)
                                                              : uly__head_layout(p, x, NULL)));
    ULY__CHECK(buf && (uintptr_t)buf % (uintptr_t)p->elem_size == 0, ULY_EINVAL,
               "%s %s: %s (%p) is NULL or not aligned to the element size (%lld bytes)",
               pack ? "pack" : "unpack", names[x], pack ? "send" : "recv", buf,
               ULY__LL(p->elem_size));
    return uly__ok();
}

/* Moves peer blocks between tensor t and exchange buffer buf. In buf the blocks are dense, in
   peer order; in t peer j's block is the view of j's heads (sequence layout) or of j's tokens
   (head layout). */
static uly_status uly__cpu_move(const uly_plan *p, uly_xchg x, int pack, uly_tensor t, char *buf) {
    ULY__TRY(uly__check_move(p, x, pack, t, buf));
    const int seq = pack == uly__to_head(x);
    if (!pack && x == ULY_X_DKV) {
        uly__sum_kv_copies(p, t, buf);
        return uly__ok();
    }
    for (int j = 0; j < p->desc.sp_size; j++) {
        uly_range tok = uly_tokens(p, j), hx = uly__xheads(p, x, j);
        uly_tensor view = seq ? uly_head_slice(t, hx.start, hx.count)
                              : uly__token_slice(t, tok.start, tok.count);
        uly_tensor blk = uly_dense(buf, t.dtype, view.b, view.s, view.h, view.d);
        uly__move(pack ? blk : view, pack ? view : blk);
        buf += uly__bytes(p, view.s, view.h);
    }
    return uly__ok();
}

static uly_status uly__cpu_pack(void *ctx, const uly_plan *p, uly_xchg x, uly_tensor src,
                                void *send, void *stream) {
    (void)ctx, (void)stream;
    return uly__cpu_move(p, x, 1, src, (char *)send);
}

static uly_status uly__cpu_unpack(void *ctx, const uly_plan *p, uly_xchg x, const void *recv,
                                  uly_tensor dst, void *stream) {
    (void)ctx, (void)stream;
    return uly__cpu_move(p, x, 0, dst, (char *)recv); /* only read */
}

ULYDEF uly_layout uly_cpu_layout(void) {
    uly_layout l;
    l.pack = uly__cpu_pack;
    l.unpack = uly__cpu_unpack;
    l.ctx = NULL;
    l.device = 0;
    return l;
}

/* ---------------------------------------------------------------------------------------------
   CPU attention: the reference, fp32

   Row r of query head i sees keys j < n(r) (all, or bottom-right causal) with scores
   s_j = scale * q_r . k_j; p = softmax(s), o_r = p V, lse_r = log sum_j exp(s_j). Every row is
   computed by the same loops in the same order whatever tensor it sits in, so attention over a
   rank's heads is bitwise the rows of attention over all heads. K of one kv head (and, for the
   backward, V) is transposed to [D][keys] in the workspace so that the score loops run over
   contiguous keys. */

/* The scale softmax_scale stands for (0: 1/sqrt(D)). */
static float uly__scale_of(float softmax_scale, int64_t head_dim) {
    return softmax_scale != 0 ? softmax_scale : 1.0f / sqrtf((float)head_dim);
}

static float uly__scale(const uly_attn_args *a) {
    return uly__scale_of(a->softmax_scale, a->q.d);
}

/* Query heads per kv head: kv_group, or q.h / k.h where it is 0. */
static int64_t uly__group(const uly_attn_args *a) {
    return a->kv_group ? a->kv_group : a->q.h / a->k.h;
}

/* The kv head that local query head i reads. */
static int64_t uly__kv_of(const uly_attn_args *a, int64_t i) {
    const int64_t g = uly__group(a);
    return (a->q_head0 + i) / g - a->q_head0 / g;
}

/* Keys row r sees: all, or with the bottom-right causal mask j <= r + Sk - Sq. */
static int64_t uly__keys(const uly_attn_args *a, int64_t r) {
    int64_t n = a->causal ? r + 1 + a->k.s - a->q.s : a->k.s;
    return uly__max(0, uly__min(n, a->k.s));
}

/* uly_attn_check's rules, as the attentions check them (their messages name no function: the
   attention's caller does). */
static uly_status uly__attn_check(const uly_attn_args *a, int backward) {
    ULY__CHECK(a, ULY_EINVAL, "args is NULL");
    uly_tensor q = a->q, k = a->k, kv = uly_dense(NULL, q.dtype, q.b, k.s, k.h, q.d);
    ULY__TRY(uly__check_view("q", q));
    ULY__CHECK(k.b == q.b, ULY_EINVAL, "k.b (%lld) != q.b (%lld)", ULY__LL(k.b), ULY__LL(q.b));
    ULY__CHECK(k.d == q.d, ULY_EINVAL, "k.d (%lld) != q.d (%lld)", ULY__LL(k.d), ULY__LL(q.d));
    ULY__CHECK(k.h >= 1 && (a->kv_group || q.h % k.h == 0), ULY_EINVAL,
               "k.h (%lld) must be positive and, when kv_group is 0, divide q.h (%lld)",
               ULY__LL(k.h), ULY__LL(q.h));
    ULY__TRY(uly__check_like("k", k, kv));
    ULY__TRY(uly__check_like("v", a->v, kv));
    ULY__TRY(uly__check_like("o", a->o, q));
    ULY__CHECK(a->lse && (uintptr_t)a->lse % 4 == 0, ULY_EINVAL,
               "lse is NULL or not 4-byte aligned (it holds floats)");
    ULY__CHECK(isfinite(a->softmax_scale), ULY_EINVAL, "softmax_scale (%g) must be finite",
               (double)a->softmax_scale);
    ULY__CHECK(a->q_head0 >= 0 && a->q_head0 <= INT64_MAX - q.h && a->kv_group >= 0,
               ULY_EINVAL, "q_head0 (%lld) must be in [0, INT64_MAX - q.h] and kv_group (%lld) "
               ">= 0", ULY__LL(a->q_head0), ULY__LL(a->kv_group));
    const int64_t g = uly__group(a);
    ULY__CHECK(uly__mul(uly__add(a->q_head0 / g, k.h), g) >= 0, ULY_EINVAL,
               "kv_group (%lld): the query heads of kv heads %lld .. %lld overflow int64",
               ULY__LL(a->kv_group), ULY__LL(a->q_head0 / g),
               ULY__LL(a->q_head0 / g + k.h - 1));
    ULY__CHECK(uly__kv_of(a, q.h - 1) < k.h, ULY_EINVAL,
               "query head %lld reads kv head %lld (q_head0 %lld, kv_group %lld), but k.h is "
               "%lld", ULY__LL(q.h - 1), ULY__LL(uly__kv_of(a, q.h - 1)), ULY__LL(a->q_head0),
               ULY__LL(a->kv_group), ULY__LL(k.h));
    if (!backward) return uly__ok();
    ULY__TRY(uly__check_like("dout", a->dout, q));
    ULY__TRY(uly__check_like("dq", a->dq, q));
    ULY__TRY(uly__check_like("dk", a->dk, kv));
    return uly__check_like("dv", a->dv, kv);
}

ULYDEF uly_status uly_attn_check(const uly_attn_args *a, int backward) {
    return uly__named("uly_attn_check", uly__attn_check(a, backward));
}

/* The attentions' rule for their workspace: need bytes (what workspace(ctx, a) gives; -1 when
   that overflows int64), at an address aligned to align. */
static uly_status uly__check_workspace(const uly_attn_args *a, int64_t need, int align) {
    ULY__CHECK(need >= 0, ULY_EOVERFLOW, "the workspace's bytes overflow int64");
    ULY__CHECK(a->workspace && (uintptr_t)a->workspace % align == 0, ULY_EINVAL,
               "workspace is NULL or not %d-byte aligned", align);
    ULY__CHECK(a->workspace_bytes >= need, ULY_EINVAL,
               "workspace_bytes (%lld) < workspace() (%lld): sized for other args?",
               ULY__LL(a->workspace_bytes), ULY__LL(need));
    return uly__ok();
}

/* Query rows per tile, and keys whose dot products are summed together in registers. Speed
   only: any sizes give bitwise the same results, as every row sums its keys, and every key its
   rows, in ascending order. 16 floats: a 64-byte cache line, a few vector registers. */
enum { ULY__TILE = 16, ULY__KEYS = 16 };

/* The scratch, in fp32: K and V transposed to [D][sp] (sp = Sk rounded up to ULY__KEYS, zero
   past Sk), the kv group's dK and dV and one head's share of them [Sk][D] (gk, gv and hk, hv:
   adjacent pairs, each one memset and one sum), then p and dp for a tile of rows
   [ULY__TILE][sp]. The forward uses kt and p. */
typedef struct uly__scratch {
    float *kt, *vt, *gk, *gv, *hk, *hv, *p, *dp;
    int64_t sp;
} uly__scratch;

/* Lays it out from base (NULL: sizes only); returns its bytes, -1 on overflow. */
static int64_t uly__scratch_at(const uly_attn_args *a, void *base, uly__scratch *s) {
    int64_t sp = uly__add(a->k.s, ULY__KEYS - 1);
    sp = sp < 0 ? -1 : sp / ULY__KEYS * ULY__KEYS;
    int64_t t = uly__mul(a->q.d, sp), g = uly__mul(a->q.d, a->k.s), tile = uly__mul(ULY__TILE, sp);
    /* gk, gv and hk, hv adjacent: the backward clears and adds each pair as one array */
    float **part[8] = {&s->kt, &s->vt, &s->gk, &s->gv, &s->hk, &s->hv, &s->p, &s->dp};
    int64_t floats[8] = {t, t, g, g, g, g, tile, tile}, at = 0;
    for (int i = 0; i < 8; i++) {
        *part[i] = (float *)uly__ptr(base, at);
        at = uly__add(at, uly__mul(floats[i], 4));
    }
    s->sp = sp;
    return at;
}

static int64_t uly__cpu_workspace(void *ctx, const uly_attn_args *a) {
    uly__scratch s;
    (void)ctx;
    return a ? uly__scratch_at(a, NULL, &s) : -1;
}

static uly_status uly__cpu_check(void *ctx, const uly_attn_args *a, int backward) {
    (void)ctx;
    ULY__TRY(uly__attn_check(a, backward));
    ULY__CHECK(a->q.dtype == ULY_F32, ULY_EUNSUPPORTED,
               "dtype %s: the CPU attention computes in f32 only", uly__dtype_name(a->q.dtype));
    return uly__check_workspace(a, uly__cpu_workspace(ctx, a), 4);
}

static float *uly__f32(uly_tensor t, int64_t b, int64_t s, int64_t h) {
    return (float *)uly__at(t, b, s, h);
}

/* The [1, s, 1, d] view of head h in batch b. */
static uly_tensor uly__head_of(uly_tensor t, int64_t b, int64_t h) {
    t.data = uly__at(t, b, 0, h);
    t.b = t.h = 1;
    return t;
}

/* K (or V) of kv head h in batch b, transposed to [D][sp]. */
static void uly__transpose(float *out, int64_t sp, uly_tensor k, int64_t b, int64_t h) {
    for (int64_t d = 0; d < k.d; d++)
        memset(out + d * sp + k.s, 0, (size_t)(sp - k.s) * sizeof *out);
    for (int64_t j = 0; j < k.s; j++) {
        const float *row = uly__f32(k, b, j, h);
        for (int64_t d = 0; d < k.d; d++) out[d * sp + j] = row[d];
    }
}

/* y += a x over n floats. */
static void uly__axpy(int64_t n, float a, const float *__restrict x, float *__restrict y) {
    for (int64_t e = 0; e < n; e++) y[e] += a * x[e];
}

/* Rows [r0, r0 + R) of query head i in batch b. Each row first alone (scores, softmax), then
   one sweep over the keys adds each key's terms to every row of the tile, so a row of V, dK
   or dV is read once per tile rather than once per row. Every row still sums over its keys,
   and every key over its rows, in ascending order. */
typedef struct uly__tile {
    const uly_attn_args *a;
    const uly__scratch *s;
    int64_t b, i, kh, r0, R; /* batch, query head, its kv head, first row, rows */
    int64_t n[ULY__TILE];    /* keys each row sees */
    int64_t keys;            /* keys any row sees */
} uly__tile;

static uly__tile uly__tile_at(const uly_attn_args *a, const uly__scratch *s, int64_t b,
                              int64_t i, int64_t r0) {
    uly__tile t;
    t.a = a, t.s = s, t.b = b, t.i = i, t.kh = uly__kv_of(a, i), t.r0 = r0;
    t.R = uly__min(ULY__TILE, a->q.s - r0);
    t.keys = 0;
    for (int64_t r = 0; r < t.R; r++)
        t.n[r] = uly__keys(a, r0 + r), t.keys = uly__max(t.keys, t.n[r]);
    return t;
}

/* lse [B, H, Sq] of row r of the tile. */
static float *uly__tile_lse(const uly__tile *t, int64_t r) {
    return t->a->lse + (t->b * t->a->q.h + t->i) * t->a->q.s + t->r0 + r;
}

/* out[r][j] = x_r . column j of mt [D][sp] for the tile's rows x_r and j < n[r], each summed
   over d in order: ULY__KEYS keys at a time in registers, for every row in turn while those
   columns of mt are in cache. */
static void uly__tile_dots(const uly__tile *t, uly_tensor x, const float *mt, float *out) {
    const int64_t sp = t->s->sp;
    for (int64_t j0 = 0; j0 < t->keys; j0 += ULY__KEYS)
        for (int64_t r = 0; r < t->R; r++) {
            if (j0 >= t->n[r]) continue; /* causal: this row sees none of these keys */
            const float *xr = uly__f32(x, t->b, t->r0 + r, t->i);
            float acc[ULY__KEYS] = {0};
            for (int64_t d = 0; d < x.d; d++) {
                const float xd = xr[d], *m = mt + d * sp + j0;
                for (int u = 0; u < ULY__KEYS; u++) acc[u] += xd * m[u];
            }
            memcpy(out + r * sp + j0, acc, (size_t)uly__min(ULY__KEYS, t->n[r] - j0) * sizeof *acc);
        }
}

static void uly__fwd_tile(const uly__tile *t) {
    const uly_attn_args *a = t->a;
    const int64_t D = a->q.d, sp = t->s->sp;
    const float scale = uly__scale(a);
    float l[ULY__TILE];
    uly__tile_dots(t, a->q, t->s->kt, t->s->p);
    for (int64_t r = 0; r < t->R; r++) { /* p = exp(s - max), l = sum p, lse = max + log l */
        float *p = t->s->p + r * sp, *o = uly__f32(a->o, t->b, t->r0 + r, t->i), m = -INFINITY;
        float *lse = uly__tile_lse(t, r);
        for (int64_t d = 0; d < D; d++) o[d] = 0;
        l[r] = 0;
        *lse = INFINITY; /* a row that sees no key */
        if (!t->n[r]) continue;
        for (int64_t j = 0; j < t->n[r]; j++) p[j] *= scale, m = fmaxf(m, p[j]);
        for (int64_t j = 0; j < t->n[r]; j++) p[j] = expf(p[j] - m), l[r] += p[j];
        *lse = m + logf(l[r]);
    }
    for (int64_t j = 0; j < t->keys; j++) { /* o += p_j v_j */
        const float *v = uly__f32(a->v, t->b, j, t->kh);
        for (int64_t r = 0; r < t->R; r++)
            if (j < t->n[r])
                uly__axpy(D, t->s->p[r * sp + j], v, uly__f32(a->o, t->b, t->r0 + r, t->i));
    }
    for (int64_t r = 0; r < t->R; r++) {
        float *o = uly__f32(a->o, t->b, t->r0 + r, t->i);
        for (int64_t d = 0; t->n[r] && d < D; d++) o[d] /= l[r];
    }
}

/* From the saved lse: p_j = exp(s_j - lse), dp_j = dout . v_j, ds_j = scale p_j (dp_j - Dsum)
   with Dsum = dout . o; then dq = sum_j ds_j k_j, and this head's share of dk_j += ds_j q and
   dv_j += p_j dout. A row that saw no key has no gradient (and lse = +inf). */
static void uly__bwd_tile(const uly__tile *t) {
    const uly_attn_args *a = t->a;
    const int64_t D = a->q.d, sp = t->s->sp;
    const float scale = uly__scale(a);
    uly__tile_dots(t, a->q, t->s->kt, t->s->p);
    uly__tile_dots(t, a->dout, t->s->vt, t->s->dp);
    for (int64_t r = 0; r < t->R; r++) {
        const int64_t row = t->r0 + r;
        const float *o = uly__f32(a->o, t->b, row, t->i);
        const float *dout = uly__f32(a->dout, t->b, row, t->i);
        const float lse = *uly__tile_lse(t, r);
        float *p = t->s->p + r * sp, *dp = t->s->dp + r * sp;
        float *dq = uly__f32(a->dq, t->b, row, t->i);
        float dsum = 0;
        for (int64_t d = 0; d < D; d++) dq[d] = 0, dsum += dout[d] * o[d];
        for (int64_t j = 0; j < t->n[r]; j++) /* dp_j becomes ds_j in place */
            p[j] = expf(p[j] * scale - lse), dp[j] = scale * p[j] * (dp[j] - dsum);
    }
    for (int64_t j = 0; j < t->keys; j++) {
        const float *k = uly__f32(a->k, t->b, j, t->kh);
        for (int64_t r = 0; r < t->R; r++) {
            if (j >= t->n[r]) continue;
            const int64_t row = t->r0 + r;
            const float ds = t->s->dp[r * sp + j]; /* dp holds ds now */
            uly__axpy(D, ds, k, uly__f32(a->dq, t->b, row, t->i));
            uly__axpy(D, ds, uly__f32(a->q, t->b, row, t->i), t->s->hk + j * D);
            uly__axpy(D, t->s->p[r * sp + j], uly__f32(a->dout, t->b, row, t->i), t->s->hv + j * D);
        }
    }
}

static uly_status uly__cpu_fwd(void *ctx, const uly_attn_args *a) {
    uly__scratch s;
    ULY__TRY(uly__cpu_check(ctx, a, 0));
    uly__scratch_at(a, a->workspace, &s);
    for (int64_t b = 0; b < a->q.b; b++)
        for (int64_t kh = 0; kh < a->k.h; kh++) {
            uly__transpose(s.kt, s.sp, a->k, b, kh);
            for (int64_t i = 0; i < a->q.h; i++) {
                if (uly__kv_of(a, i) != kh) continue;
                for (int64_t r0 = 0; r0 < a->q.s; r0 += ULY__TILE) {
                    uly__tile t = uly__tile_at(a, &s, b, i, r0);
                    uly__fwd_tile(&t);
                }
            }
        }
    return uly__ok();
}

/* dK and dV of a kv head are the sums over its query heads, in head order, of each head's
   share (summed over the rows in fp32). */
static uly_status uly__cpu_bwd(void *ctx, const uly_attn_args *a) {
    uly__scratch s;
    ULY__TRY(uly__cpu_check(ctx, a, 1));
    uly__scratch_at(a, a->workspace, &s);
    const int64_t D = a->q.d, Sk = a->k.s;
    uly_tensor group_k = uly_dense(s.gk, ULY_F32, 1, Sk, 1, D);
    uly_tensor group_v = uly_dense(s.gv, ULY_F32, 1, Sk, 1, D);
    for (int64_t b = 0; b < a->q.b; b++)
        for (int64_t kh = 0; kh < a->k.h; kh++) {
            uly__transpose(s.kt, s.sp, a->k, b, kh);
            uly__transpose(s.vt, s.sp, a->v, b, kh);
            memset(s.gk, 0, (size_t)(2 * D * Sk) * sizeof *s.gk); /* gk and gv */
            for (int64_t i = 0; i < a->q.h; i++) {
                if (uly__kv_of(a, i) != kh) continue;
                memset(s.hk, 0, (size_t)(2 * D * Sk) * sizeof *s.hk); /* hk and hv */
                for (int64_t r0 = 0; r0 < a->q.s; r0 += ULY__TILE) {
                    uly__tile t = uly__tile_at(a, &s, b, i, r0);
                    uly__bwd_tile(&t);
                }
                uly__axpy(2 * D * Sk, 1.0f, s.hk, s.gk); /* gk, gv += hk, hv */
            }
            uly__move(uly__head_of(a->dk, b, kh), group_k);
            uly__move(uly__head_of(a->dv, b, kh), group_v);
        }
    return uly__ok();
}

ULYDEF uly_attn uly_cpu_attention(void) {
    uly_attn at;
    at.fwd = uly__cpu_fwd;
    at.bwd = uly__cpu_bwd;
    at.workspace = uly__cpu_workspace;
    at.ctx = NULL;
    at.check = uly__cpu_check;
    at.device = 0;
    return at;
}

/* ---------------------------------------------------------------------------------------------
   The SP attention layer. The driver only does pointer arithmetic and calls the layout, the
   attention and the communicator through their function pointers, so the same code runs on
   host and device memory (ulysses_cuda.cuh plugs in the GPU ones). */

static void uly__phase(const uly_layer *l, uly_phase phase, int end) {
    if (l->on_phase) l->on_phase(l->phase_user, phase, end);
}

/* The attention over this rank's heads; grad NULL for the forward. q_head0 and kv_group map a
   GQA group that is split across ranks. */
static uly_attn_args uly__args(const uly_layer *l, const uly__heads *h, float *lse,
                               const uly__heads *grad, void *workspace, int64_t workspace_bytes) {
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = h->q, a.k = h->k, a.v = h->v, a.o = h->o, a.lse = lse;
    if (grad) a.dout = grad->o, a.dq = grad->q, a.dk = grad->k, a.dv = grad->v;
    a.softmax_scale = l->softmax_scale;
    a.causal = l->causal;
    a.deterministic = l->deterministic;
    a.q_head0 = uly_heads(l->plan, l->plan->sp_rank).start;
    a.kv_group = l->plan->group;
    a.workspace = workspace;
    a.workspace_bytes = workspace_bytes;
    a.stream = l->stream;
    return a;
}

/* The layer's scratch and then the attention's, which it sizes from shapes alone. -1 when l
   cannot be sized. */
static int64_t uly__layer_bytes(const uly_layer *l) {
    uly__work w;
    uly__heads h;
    int64_t attn = 0;
    if (!l || !uly__plan_ok(l->plan)) return -1;
    const int64_t layer = uly__work_at(l->plan, NULL, &w);
    if (l->attn.workspace) {
        uly__heads_at(l->plan, NULL, &h);
        uly_attn_args a = uly__args(l, &h, NULL, &w.grad, NULL, 0);
        attn = l->attn.workspace(l->attn.ctx, &a);
    }
    return uly__add(layer, attn);
}

/* 0 when l cannot be sized; uly_forward says why. */
ULYDEF int64_t uly_layer_workspace(const uly_layer *l) {
    return uly__max(0, uly__layer_bytes(l));
}

/* The layer's plan is as uly_plan_init made it, and its comm (not NULL) is the plan's SP
   group. */
static uly_status uly__check_group(const uly_layer *l) {
    const uly_plan *p = l->plan;
    const uly_comm *c = l->comm;
    ULY__CHECK(uly__plan_ok(p), ULY_EINVAL, "layer.plan is NULL or not as uly_plan_init made it");
    ULY__CHECK(c->size == p->desc.sp_size && c->rank == p->sp_rank, ULY_EINVAL,
               "layer.comm is rank %d of %d, the plan's sp rank %d of %d", c->rank, c->size,
               p->sp_rank, p->desc.sp_size);
    return uly__ok();
}

/* The layer's fields and its workspace; *need gets uly_layer_workspace(). */
static uly_status uly__check_layer(const uly_layer *l, int backward, int64_t *need) {
    ULY__CHECK(l, ULY_EINVAL, "layer is NULL");
    ULY__CHECK(l->comm, ULY_EINVAL, "layer.comm is NULL");
    ULY__TRY(uly__check_group(l));
    const uly_plan *p = l->plan;
    const uly_comm *c = l->comm;
    ULY__CHECK(c->alltoallv, ULY_EINVAL, "layer.comm->alltoallv is NULL");
    ULY__TRY(uly__check_peer_bytes(p, c->max_bytes, "layer.comm->max_bytes"));
    ULY__CHECK(backward ? l->attn.bwd != NULL : l->attn.fwd != NULL, ULY_EINVAL,
               "layer.attn.%s is NULL", backward ? "bwd" : "fwd");
    ULY__CHECK(l->layout.pack && l->layout.unpack, ULY_EINVAL, "layer.layout.%s is NULL",
               l->layout.pack ? "unpack" : "pack");
    ULY__CHECK(l->layout.device == c->device && l->attn.device == c->device, ULY_EINVAL,
               "layer: comm->device (%d), layout.device (%d) and attn.device (%d) differ: the "
               "three must all work on host memory (0) or all on GPU memory (1)", c->device,
               l->layout.device, l->attn.device);
    *need = uly__layer_bytes(l);
    ULY__CHECK(*need >= 0, ULY_EOVERFLOW,
               "layer workspace: its size overflows int64, or layer.attn.workspace failed");
    ULY__CHECK(l->workspace, ULY_EINVAL, "layer.workspace is NULL (uly_layer_workspace() is %lld "
               "bytes)", ULY__LL(*need));
    ULY__CHECK(l->workspace_bytes >= *need, ULY_EINVAL,
               "layer.workspace_bytes (%lld) < uly_layer_workspace() (%lld)",
               ULY__LL(l->workspace_bytes), ULY__LL(*need));
    return uly__ok();
}

/* Moves src to dst through exchange x: pack, all-to-all, unpack. With B == 1 the head layout
   [1, S, H_r, D] is the exchange buffer [P][1, S_j, H_r, D] itself, so that side needs no copy:
   seq->head receives straight into dst, head->seq sends straight from src. */
static uly_status uly__exchange(const uly_layer *l, uly_xchg x, uly_tensor src, uly_tensor dst,
                                const uly__work *w) {
    const uly_plan *p = l->plan;
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
    const int direct = p->desc.batch == 1, to_head = uly__to_head(x);
    const int pack = !direct || to_head, unpack = !direct || !to_head;
    void *send = pack ? w->send : src.data;
    void *recv = unpack ? w->recv : dst.data;
    uly_status st;
    if (pack) {
        uly__phase(l, ULY_PHASE_PACK, 0);
        st = l->layout.pack(l->layout.ctx, p, x, src, send, l->stream);
        uly__phase(l, ULY_PHASE_PACK, 1);
        if (st.code) return st;
    }
    uly_exchange_counts(p, x, sc, so, rc, ro);
    uly__phase(l, ULY_PHASE_EXCHANGE, 0);
    st = l->comm->alltoall && uly__uniform(p, x)
             ? l->comm->alltoall(l->comm->ctx, send, recv, sc[0], l->stream)
             : l->comm->alltoallv(l->comm->ctx, send, sc, so, recv, rc, ro, l->stream);
    uly__phase(l, ULY_PHASE_EXCHANGE, 1);
    if (st.code || !unpack) return st;
    uly__phase(l, ULY_PHASE_UNPACK, 0);
    st = l->layout.unpack(l->layout.ctx, p, x, recv, dst, l->stream);
    uly__phase(l, ULY_PHASE_UNPACK, 1);
    return st;
}

static uly_status uly__attend(const uly_layer *l, const uly_attn_args *a, int backward) {
    uly__phase(l, ULY_PHASE_ATTN, 0);
    uly_status st = backward ? l->attn.bwd(l->attn.ctx, a) : l->attn.fwd(l->attn.ctx, a);
    uly__phase(l, ULY_PHASE_ATTN, 1);
    return st;
}

/* A forward or backward under way: the head-layout views in `saved`, the scratch, and the
   attention's arguments. */
typedef struct uly__pass {
    uly__heads h;
    uly__work w;
    uly_attn_args a;
} uly__pass;

/* saved is there and big enough, and what a pass writes does not share memory with what it
   reads or writes after: saved and the workspace are apart from each other and from the
   tensors, and the three gradients from each other. An output may alias an input (out over q,
   dq over dout): the inputs are exchanged before any output is written. ws: the workspace's
   bytes in use. */
static uly_status uly__check_buffers(const uly_layer *l, int backward, const void *saved,
                                     int64_t saved_bytes, int64_t ws, const char *const names[4],
                                     const uly_tensor t[4]) {
    const int64_t sv = uly_saved_bytes(l->plan);
    ULY__CHECK(saved, ULY_EINVAL, "saved is NULL (uly_saved_bytes() is %lld bytes)",
               ULY__LL(sv));
    ULY__CHECK(saved_bytes >= sv, ULY_EINVAL, "saved_bytes (%lld) < uly_saved_bytes() (%lld)",
               ULY__LL(saved_bytes), ULY__LL(sv));
    ULY__CHECK((uintptr_t)saved % 4 == 0, ULY_EINVAL,
               "saved (%p) is not 4-byte aligned: it holds the fp32 lse", saved);
    ULY__CHECK(!uly__meet(saved, sv, l->workspace, ws), ULY_EINVAL,
               "saved (%lld bytes) and layer.workspace (%lld bytes) overlap", ULY__LL(sv),
               ULY__LL(ws));
    for (int i = 0; i < 4; i++) {
        const int64_t n = uly__span(t[i]);
        const int in_saved = uly__meet(t[i].data, n, saved, sv);
        ULY__CHECK(!in_saved && !uly__meet(t[i].data, n, l->workspace, ws), ULY_EINVAL,
                   "%s overlaps %s: saved, layer.workspace and the tensors must be apart",
                   names[i], in_saved ? "saved" : "layer.workspace");
        for (int j = 1; backward && j < i; j++)
            ULY__CHECK(!uly__share(t[j], t[i]), ULY_EINVAL,
                       "%s and %s share memory: each gradient needs elements of its own",
                       names[j], names[i]);
    }
    return uly__ok();
}

/* Checks the layer, saved and the four sequence-layout tensors t of a forward (q, k, v, out) or
   backward (dout, dq, dk, dv), each against the exchange it goes through, then lays out s. */
static uly_status uly__begin(const uly_layer *l, int backward, void *saved, int64_t saved_bytes,
                             const char *const names[4], const uly_tensor t[4], uly__pass *s) {
    static const uly_xchg fwd[4] = {ULY_X_Q, ULY_X_KV, ULY_X_KV, ULY_X_O};
    static const uly_xchg bwd[4] = {ULY_X_Q, ULY_X_O, ULY_X_DKV, ULY_X_DKV};
    int64_t ws = 0;
    ULY__TRY(uly__check_layer(l, backward, &ws));
    const uly_plan *p = l->plan;
    for (int i = 0; i < 4; i++)
        ULY__TRY(uly__check_like(names[i], t[i],
                                 uly__seq_layout(p, (backward ? bwd : fwd)[i], NULL)));
    ULY__TRY(uly__check_buffers(l, backward, saved, saved_bytes, ws, names, t));
    uly__heads_at(p, saved, &s->h);
    const int64_t attn_at = uly__work_at(p, l->workspace, &s->w);
    s->a = uly__args(l, &s->h, uly_saved_lse(p, saved), backward ? &s->w.grad : NULL,
                     s->w.attn, l->workspace_bytes - attn_at);
    return l->attn.check ? l->attn.check(l->attn.ctx, &s->a, backward) : uly__ok();
}

static uly_status uly__forward(const uly_layer *l, uly_tensor q, uly_tensor k, uly_tensor v,
                               uly_tensor out, void *saved, int64_t saved_bytes) {
    static const char *const names[4] = {"q", "k", "v", "out"};
    const uly_tensor t[4] = {q, k, v, out};
    uly__pass s;
    ULY__TRY(uly__begin(l, 0, saved, saved_bytes, names, t, &s));
    ULY__TRY(uly__exchange(l, ULY_X_Q, q, s.h.q, &s.w));
    ULY__TRY(uly__exchange(l, ULY_X_KV, k, s.h.k, &s.w));
    ULY__TRY(uly__exchange(l, ULY_X_KV, v, s.h.v, &s.w));
    ULY__TRY(uly__attend(l, &s.a, 0));
    return uly__exchange(l, ULY_X_O, s.h.o, out, &s.w);
}

static uly_status uly__backward(const uly_layer *l, uly_tensor dout, const void *saved,
                                int64_t saved_bytes, uly_tensor dq, uly_tensor dk,
                                uly_tensor dv) {
    static const char *const names[4] = {"dout", "dq", "dk", "dv"};
    const uly_tensor t[4] = {dout, dq, dk, dv};
    uly__pass s;
    ULY__TRY(uly__begin(l, 1, (void *)saved /* only read */, saved_bytes, names, t, &s));
    ULY__TRY(uly__exchange(l, ULY_X_Q, dout, s.w.grad.o, &s.w));
    ULY__TRY(uly__attend(l, &s.a, 1));
    ULY__TRY(uly__exchange(l, ULY_X_O, s.w.grad.q, dq, &s.w));
    ULY__TRY(uly__exchange(l, ULY_X_DKV, s.w.grad.k, dk, &s.w));
    return uly__exchange(l, ULY_X_DKV, s.w.grad.v, dv, &s.w);
}

ULYDEF uly_status uly_forward(const uly_layer *l, uly_tensor q, uly_tensor k, uly_tensor v,
                              uly_tensor out, void *saved, int64_t saved_bytes) {
    return uly__named("uly_forward", uly__forward(l, q, k, v, out, saved, saved_bytes));
}

ULYDEF uly_status uly_backward(const uly_layer *l, uly_tensor dout, const void *saved,
                               int64_t saved_bytes, uly_tensor dq, uly_tensor dk, uly_tensor dv) {
    return uly__named("uly_backward", uly__backward(l, dout, saved, saved_bytes, dq, dk, dv));
}

/* What every rank of a layer must hold alike, and how a message shows each value: the scale
   travels as its float's bits. */
typedef enum uly__shown { ULY__SHOWN_INT, ULY__SHOWN_DTYPE, ULY__SHOWN_FLOAT } uly__shown;
static const struct {
    const char *name;
    uly__shown shown;
} uly__agreed_fields[] = {
    {"world_size", ULY__SHOWN_INT}, {"sp_size", ULY__SHOWN_INT},   {"batch", ULY__SHOWN_INT},
    {"seq_len", ULY__SHOWN_INT},    {"n_heads", ULY__SHOWN_INT},   {"n_kv_heads", ULY__SHOWN_INT},
    {"head_dim", ULY__SHOWN_INT},   {"dtype", ULY__SHOWN_DTYPE},   {"max_bytes", ULY__SHOWN_INT},
    {"causal", ULY__SHOWN_INT},     {"softmax_scale", ULY__SHOWN_FLOAT}};
enum { ULY__AGREED = sizeof uly__agreed_fields / sizeof uly__agreed_fields[0] };

static void uly__agreed(const uly_layer *l, int64_t v[ULY__AGREED]) {
    const uly_plan_desc *d = &l->plan->desc;
    const float scale = uly__scale_of(l->softmax_scale, d->head_dim);
    uint32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    const int64_t all[ULY__AGREED] = {/* in uly__agreed_fields' order */
                                      d->world_size, d->sp_size, d->batch, d->seq_len,
                                      d->n_heads, d->n_kv_heads, d->head_dim, d->dtype,
                                      d->max_bytes, l->causal != 0, bits};
    memcpy(v, all, sizeof all);
}

/* Value v of field f, as its message shows it. */
static const char *uly__agreed_text(int f, int64_t v, char text[32]) {
    const uint32_t bits = (uint32_t)v;
    float x;
    memcpy(&x, &bits, sizeof x);
    switch (uly__agreed_fields[f].shown) {
    case ULY__SHOWN_FLOAT: snprintf(text, 32, "%g", x); break;
    case ULY__SHOWN_DTYPE: snprintf(text, 32, "%s", uly__dtype_name((uly_dtype)v)); break;
    default: snprintf(text, 32, "%lld", ULY__LL(v));
    }
    return text;
}

/* SP rank 0's values reach every rank as a sum to which the others add 0, each int64 in two
   32-bit halves that a double holds exactly, with whether rank 0 could tell them; a second sum
   counts the ranks that differ or failed alone. Every rank that can call the communicator takes
   part in both, so all of them return alike. */
static uly_status uly__layer_agree(const uly_layer *l) {
    ULY__CHECK(l && l->comm && l->comm->allreduce_sum, ULY_EINVAL, "%s is NULL",
               !l ? "layer" : !l->comm ? "layer.comm" : "layer.comm->allreduce_sum");
    const uly_comm *c = l->comm;
    const uly_status alone = uly__check_group(l); /* what it can tell alone */
    int64_t mine[ULY__AGREED] = {0}, first = 0;
    double sum[2 * ULY__AGREED + 1] = {0}; /* rank 0's halves, then 1 if it had a layer */
    if (!alone.code) uly__agreed(l, mine);
    for (int f = 0; c->rank == 0 && f < ULY__AGREED; f++) {
        sum[2 * f] = (double)((uint64_t)mine[f] >> 32);
        sum[2 * f + 1] = (double)((uint64_t)mine[f] & 0xffffffffu);
    }
    sum[2 * ULY__AGREED] = c->rank == 0 && !alone.code;
    ULY__TRY(c->allreduce_sum(c->ctx, sum, 2 * ULY__AGREED + 1, NULL));
    const int rank0 = sum[2 * ULY__AGREED] == 1;
    int f = 0; /* the first field that differs from rank 0's, ULY__AGREED if none */
    for (; f < ULY__AGREED; f++) {
        first = (int64_t)((uint64_t)sum[2 * f] << 32 | (uint64_t)sum[2 * f + 1]);
        if (first != mine[f]) break;
    }
    double differ = alone.code || !rank0 || f < ULY__AGREED;
    ULY__TRY(c->allreduce_sum(c->ctx, &differ, 1, NULL));
    char a[32], b[32];
    if (alone.code) return alone;
    ULY__CHECK(rank0, ULY_EINVAL, "sp rank 0 has no valid layer (its message says why)");
    ULY__CHECK(f == ULY__AGREED, ULY_EINVAL, "%s is %s on this rank (sp rank %d), %s on sp rank 0",
               uly__agreed_fields[f].name, uly__agreed_text(f, mine[f], a), c->rank,
               uly__agreed_text(f, first, b));
    ULY__CHECK(differ == 0, ULY_EINVAL, "%d of %d sp ranks run another layer than sp rank 0 or "
               "have none (each of them says why)", (int)differ, c->size);
    return uly__ok();
}

ULYDEF uly_status uly_layer_agree(const uly_layer *l) {
    return uly__named("uly_layer_agree", uly__layer_agree(l));
}

/* ---------------------------------------------------------------------------------------------
   Around the layer: positions, token and label shards, the loss */

static uly_status uly__check_shard(const char *fn, const uly_plan *p, const void *in,
                                   const void *out) {
    ULY__CHECK(uly__plan_ok(p), ULY_EINVAL, "%s: plan is NULL or not as uly_plan_init made it",
               fn);
    ULY__CHECK(in && out, ULY_EINVAL, "%s: a buffer is NULL", fn);
    return uly__ok();
}

ULYDEF uly_status uly_positions(const uly_plan *p, int32_t *pos) {
    ULY__TRY(uly__check_shard("uly_positions", p, pos, pos));
    uly_range t = uly_tokens(p, p->sp_rank);
    ULY__CHECK(p->desc.seq_len <= (int64_t)INT32_MAX + 1, ULY_EOVERFLOW, "uly_positions: seq_len "
               "(%lld) has positions beyond int32", ULY__LL(p->desc.seq_len));
    for (int64_t b = 0; b < p->desc.batch; b++)
        for (int64_t i = 0; i < t.count; i++) pos[b * t.count + i] = (int32_t)(t.start + i);
    return uly__ok();
}

ULYDEF uly_status uly_shard_tokens(const uly_plan *p, const int32_t *full, int32_t *local) {
    ULY__TRY(uly__check_shard("uly_shard_tokens", p, full, local));
    uly_range t = uly_tokens(p, p->sp_rank);
    for (int64_t b = 0; b < p->desc.batch; b++)
        memcpy(local + b * t.count, full + b * p->desc.seq_len + t.start,
               (size_t)t.count * sizeof *local);
    return uly__ok();
}

ULYDEF uly_status uly_shard_labels(const uly_plan *p, const int32_t *full, int32_t ignore_index,
                                   int32_t *labels) {
    ULY__TRY(uly__check_shard("uly_shard_labels", p, full, labels));
    uly_range t = uly_tokens(p, p->sp_rank);
    for (int64_t b = 0; b < p->desc.batch; b++)
        for (int64_t i = 0; i < t.count; i++) {
            int64_t next = t.start + i + 1; /* the label of a token is the token after it */
            labels[b * t.count + i] =
                next < p->desc.seq_len ? full[b * p->desc.seq_len + next] : ignore_index;
        }
    return uly__ok();
}

ULYDEF uly_status uly_cross_entropy(const float *logits, const int32_t *labels, int64_t n,
                                    int64_t v, int32_t ignore_index, double *loss_sum,
                                    int64_t *count, float *dlogits) {
    ULY__CHECK(((logits && labels) || !n) && loss_sum && count, ULY_EINVAL,
               "uly_cross_entropy: logits and labels (unless n is 0), loss_sum and count must "
               "not be NULL");
    ULY__CHECK(n >= 0 && v >= 1, ULY_EINVAL,
               "uly_cross_entropy: n (%lld) must be >= 0 and v (%lld) >= 1", ULY__LL(n),
               ULY__LL(v));
    ULY__CHECK(uly__mul(n, v) >= 0, ULY_EOVERFLOW,
               "uly_cross_entropy: n (%lld) x v (%lld) overflows int64", ULY__LL(n), ULY__LL(v));
    for (int64_t i = 0; i < n; i++)
        ULY__CHECK(labels[i] == ignore_index || (labels[i] >= 0 && labels[i] < v), ULY_EINVAL,
                   "uly_cross_entropy: labels[%lld] (%d) is neither in [0, v (%lld)) nor "
                   "ignore_index (%d)", ULY__LL(i), (int)labels[i], ULY__LL(v), (int)ignore_index);
    for (int64_t i = 0; i < n; i++) {
        const float *x = logits + i * v;
        float *dx = dlogits ? dlogits + i * v : NULL;
        if (labels[i] == ignore_index) {
            if (dx) memset(dx, 0, (size_t)v * sizeof *dx);
            continue;
        }
        float m = x[0];
        double z = 0;
        for (int64_t c = 1; c < v; c++) m = fmaxf(m, x[c]);
        for (int64_t c = 0; c < v; c++) z += exp((double)x[c] - m);
        /* m - x first: next to a logit of 1e15 or more, log(z) <= log(v) would vanish. */
        *loss_sum += log(z) + ((double)m - x[labels[i]]);
        *count += 1;
        for (int64_t c = 0; dx && c < v; c++)
            dx[c] = (float)(exp((double)x[c] - m) / z) - (c == labels[i]);
    }
    return uly__ok();
}

static uly_status uly__loss_reduce(const uly_comm *c, double loss_sum, int64_t count,
                                   double *mean, double *grad_scale) {
    ULY__CHECK(c && c->allreduce_sum, ULY_EINVAL, "%s is NULL",
               c ? "comm->allreduce_sum" : "comm");
    ULY__CHECK(mean && grad_scale, ULY_EINVAL, "mean and grad_scale must not be NULL");
    ULY__CHECK(count >= 0, ULY_EINVAL, "count (%lld) must be >= 0", ULY__LL(count));
    double all[2] = {loss_sum, (double)count};
    ULY__TRY(c->allreduce_sum(c->ctx, all, 2, NULL));
    *mean = all[1] > 0 ? all[0] / all[1] : 0;
    *grad_scale = all[1] > 0 ? 1 / all[1] : 0;
    return uly__ok();
}

ULYDEF uly_status uly_loss_reduce(const uly_comm *c, double loss_sum, int64_t count,
                                  double *mean, double *grad_scale) {
    return uly__named("uly_loss_reduce", uly__loss_reduce(c, loss_sum, count, mean, grad_scale));
}

#ifdef __GNUC__
#pragma GCC diagnostic pop
#endif
#endif /* ULYSSES_IMPLEMENTATION && !ULYSSES_IMPLEMENTED */

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
