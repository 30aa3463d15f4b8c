/* ulysses.h - Ulysses sequence parallelism for C and CUDA trainers. Public domain-like: MIT, see end.

   Long-context attention runs out of memory because its activations grow with the sequence.
   Ulysses splits the SEQUENCE over the P ranks of a sequence-parallel (SP) group: each rank
   projects its own tokens to q, k, v; one all-to-all per tensor turns "my tokens, all heads" into
   "all tokens, my heads"; each rank runs ordinary attention over the full sequence for its heads;
   one more all-to-all turns the output back into "my tokens, all heads". The backward is the same
   exchanges in reverse. Per layer the all-to-alls move about 4*N*h/P elements per rank.

       rank r: q,k,v [B, S_r, H, D] --pack--> all-to-all --> [B, S, H_r, D] --attention--> o
               out   [B, S_r, H, D] <--unpack-- all-to-all <--pack-- o [B, S, H_r, D], lse [B, H_r, S]

   This file is the whole CPU side, stb-style: declarations below, and the implementation after
   them behind ULYSSES_IMPLEMENTATION. Do this in exactly one C or C++ file:

       #define ULYSSES_IMPLEMENTATION
       #include "ulysses.h"

   ulysses_cuda.cuh adds the GPU side (layout kernels, NCCL, attention kernels) on the same API.

   USAGE: one SP attention layer on rank `rank` of a world of `world` ranks (the CPU path)

       uly_plan plan;
       uly_status st = uly_plan_init(&plan, &(uly_plan_desc){
           .world_size = world, .rank = rank, .sp_size = 4,
           .batch = 1, .seq_len = 8192, .n_heads = 16, .n_kv_heads = 4, .head_dim = 64 });
       if (st.code) { fprintf(stderr, "%s\n", st.msg); return 1; }
       uly_layer L = { .plan = &plan, .comm = &comm, .attn = uly_cpu_attention(),
                       .layout = uly_cpu_layout(), .causal = 1 };
       L.workspace_bytes = uly_layer_workspace(&L);
       L.workspace = malloc(L.workspace_bytes);
       void *saved = malloc(uly_saved_bytes(&plan));        // kept from forward to backward
       uly_range tok = uly_tokens(&plan, plan.sp_rank);      // this rank's tokens
       uly_tensor q = uly_dense(qbuf, ULY_F32, 1, tok.count, 16, 64), ...;
       st = uly_forward(&L, q, k, v, out, saved);
       st = uly_backward(&L, dout, saved, dq, dk, dv);

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
       message that names the field and the rule, e.g.
       "sp_size (8) > n_heads (4): every rank needs at least one query head".
       Nothing aborts or exits; sizes that overflow int64, or byte counts a communicator cannot
       carry, are errors and never truncated.

   OPTIONS (define before including)
       ULYSSES_IMPLEMENTATION   make the implementation in this translation unit
       ULYSSES_STATIC           give every function internal linkage (embed privately)
       ULYSSES_MPI              declare and build the MPI communicator (include <mpi.h> first)
       ULYSSES_NO_THREADS       leave out the threaded local communicator (no pthreads)
       ULY_ASSERT(x)            internal invariants (default: assert)

   Nothing here allocates: buffers come from the caller, sized by the *_bytes queries. There is
   no global state; every call is reentrant. On the GPU every call is ordered on the caller's
   stream. */
#ifndef ULYSSES_H
#define ULYSSES_H

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

typedef struct uly_status {
    uly_code code;
    char msg[244];
} uly_status;

/* ---------------------------------------------------------------------------------------------
   Tensors: strided [b, s, h, d] views with a contiguous last dim */

typedef enum uly_dtype { ULY_F32 = 0, ULY_BF16, ULY_F16 } uly_dtype;

typedef struct uly_tensor {
    void *data;
    int64_t b, s, h, d;  /* shape */
    int64_t sb, ss, sh;  /* strides in elements; d has stride 1 */
    uly_dtype dtype;
} uly_tensor;

ULYDEF int64_t uly_dtype_size(uly_dtype t);
/* A dense [b, s, h, d] tensor. */
ULYDEF uly_tensor uly_dense(void *data, uly_dtype t, int64_t b, int64_t s, int64_t h, int64_t d);
/* The view of heads [h0, h0 + n) of t. */
ULYDEF uly_tensor uly_head_slice(uly_tensor t, int64_t h0, int64_t n);
/* q, k, v views of a dense fused [b, s, nq + 2*nkv, d] buffer (q heads, k heads, v heads). */
ULYDEF void uly_qkv_views(void *qkv, uly_dtype t, int64_t b, int64_t s, int64_t nq, int64_t nkv,
                          int64_t d, uly_tensor *q, uly_tensor *k, uly_tensor *v);

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
    int64_t max_bytes;  /* largest per-peer message the communicator moves; 0 = no limit */
} uly_plan_desc;

typedef struct uly_plan {
    uly_plan_desc desc; /* as validated, n_kv_heads filled in */
    int sp_rank, dp_rank;
    int64_t group;      /* g = n_heads / n_kv_heads, query heads per kv head */
    int64_t elem_size;
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
ULYDEF void uly_exchange_counts(const uly_plan *p, uly_xchg x, int64_t *send_counts,
                                int64_t *send_offs, int64_t *recv_counts, int64_t *recv_offs);
ULYDEF int64_t uly_send_bytes(const uly_plan *p, uly_xchg x); /* sum of send_counts */
ULYDEF int64_t uly_recv_bytes(const uly_plan *p, uly_xchg x); /* sum of recv_counts */

/* ---------------------------------------------------------------------------------------------
   Communicators: one small interface, several implementations */

typedef struct uly_comm {
    int size, rank;
    /* Every rank sends send[send_offs[j], +send_counts[j]) to peer j, which receives it at
       recv[recv_offs[i], +recv_counts[i]) for sender i. Bytes; the counts of both ends agree. */
    uly_status (*alltoallv)(void *ctx, const void *send, const int64_t *send_counts,
                            const int64_t *send_offs, void *recv, const int64_t *recv_counts,
                            const int64_t *recv_offs, void *stream);
    /* buf[0, n) = sum over ranks, in place. */
    uly_status (*allreduce_sum)(void *ctx, double *buf, int64_t n, void *stream);
    uly_status (*barrier)(void *ctx);
    void *ctx;
    int64_t max_bytes; /* largest per-peer count it moves; 0 = no limit */
    int device;        /* 1: buffers are GPU memory, 0: host memory */
} uly_comm;

#ifndef ULYSSES_NO_THREADS
/* The local communicator: P ranks as threads of one process (tests, examples, the demo). */
/* Runs fn(comm, user) on `size` threads, one per rank, and waits for all of them. The world
   (a barrier and a table of published buffers) lives on uly_local_run's stack. */
ULYDEF uly_status uly_local_run(int size, void (*fn)(const uly_comm *comm, void *user), void *user);
#endif

#ifdef ULYSSES_MPI
/* The MPI communicator over `comm` (an SP group). Byte counts above INT_MAX are moved in
   messages of at most chunk_bytes (0 = INT_MAX), since MPI counts are int. */
typedef struct uly_mpi {
    MPI_Comm comm;
    int64_t chunk_bytes;
} uly_mpi;
ULYDEF uly_status uly_mpi_comm(uly_mpi *m, uly_comm *out);
/* Splits a world into SP groups of sp_size consecutive ranks and DP groups across them. */
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
    uly_tensor dout, dq, dk, dv; /* backward only */
    float softmax_scale;         /* 0 = 1/sqrt(D) */
    int causal;
    int deterministic;           /* bitwise-identical results run to run */
    int64_t q_head0;             /* global index of q's first head; 0 for whole tensors */
    int64_t kv_group;            /* query heads per kv head; 0 = q.h / k.h */
    void *workspace;             /* workspace(ctx, args) bytes, in the attention's memory */
    void *stream;                /* cudaStream_t for GPU attention */
} uly_attn_args;

typedef struct uly_attn {
    uly_status (*fwd)(void *ctx, const uly_attn_args *a);
    uly_status (*bwd)(void *ctx, const uly_attn_args *a);
    int64_t (*workspace)(void *ctx, const uly_attn_args *a); /* bytes fwd or bwd needs */
    void *ctx;
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
                      copies of a replicated kv head in peer order. */

typedef struct uly_layout {
    uly_status (*pack)(void *ctx, const uly_plan *p, uly_xchg x, uly_tensor src, void *send,
                       void *stream);
    uly_status (*unpack)(void *ctx, const uly_plan *p, uly_xchg x, const void *recv,
                         uly_tensor dst, void *stream);
    void *ctx;
} uly_layout;

ULYDEF uly_layout uly_cpu_layout(void); /* the CPU reference: plain copy loops, any dtype */

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
    void *workspace;        /* uly_layer_workspace() bytes, in the communicator's memory */
    int64_t workspace_bytes;
    void *stream;
    /* Optional: called at the start (end = 0) and end (end = 1) of every phase, for timing. */
    void (*on_phase)(void *user, uly_phase phase, int end);
    void *phase_user;
} uly_layer;

ULYDEF int64_t uly_layer_workspace(const uly_layer *l); /* scratch for forward or backward */
/* Head-layout q, k, v, o and lse: what the forward keeps for the backward. */
ULYDEF int64_t uly_saved_bytes(const uly_plan *p);
ULYDEF float *uly_saved_lse(const uly_plan *p, void *saved); /* [B, H_r, S] */
/* q, k, v, out in sequence layout [B, S_r, H or Hkv, D] (views into a fused buffer are fine). */
ULYDEF uly_status uly_forward(const uly_layer *l, uly_tensor q, uly_tensor k, uly_tensor v,
                              uly_tensor out, void *saved);
/* dq, dk, dv are overwritten, in sequence layout. */
ULYDEF uly_status uly_backward(const uly_layer *l, uly_tensor dout, const void *saved,
                               uly_tensor dq, uly_tensor dk, uly_tensor dv);

/* ---------------------------------------------------------------------------------------------
   What a trainer needs around the layer */

/* pos[b*S_r + i] = s0 + i: rows of wpe or RoPE tables for the local tokens. */
ULYDEF void uly_positions(const uly_plan *p, int32_t *pos);
/* local[b, i] = full[b, s0 + i]: the same [B, S] sample is loaded on every SP peer. */
ULYDEF void uly_shard_tokens(const uly_plan *p, const int32_t *full, int32_t *local);
/* Labels shifted over the FULL sequence before sharding, so shard edges need no fix-up:
   label of global token t is full[b, t + 1], and ignore_index for t = S - 1. */
ULYDEF void uly_shard_labels(const uly_plan *p, const int32_t *full, int32_t ignore_index,
                             int32_t *labels);
/* Cross-entropy over n local tokens of vocabulary v: adds sum of -log softmax(logits)[label]
   and the count of labels != ignore_index. If dlogits is not NULL it gets the unscaled gradient
   softmax - onehot (0 for ignored tokens); scale it by uly_loss_reduce's grad_scale. */
ULYDEF uly_status uly_cross_entropy(const float *logits, const int32_t *labels, int64_t n,
                                    int64_t v, int32_t ignore_index, double *loss_sum,
                                    int64_t *count, float *dlogits);
/* One allreduce of (sum, count) over the comm: mean = sum_all / count_all and
   grad_scale = 1 / count_all, both 0 when no rank has a valid token (never NaN). */
ULYDEF uly_status uly_loss_reduce(const uly_comm *c, double loss_sum, int64_t count,
                                  double *mean, double *grad_scale);

#ifdef __cplusplus
}
#endif
#endif /* ULYSSES_H */
