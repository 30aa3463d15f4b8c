/* sp_case.h - one SP attention layer run on one rank, for the layer tests over any communicator
   (test_layer.c: threads of uly_local_run; test_mpi.c: MPI processes).

   The full tensors [B, S, H or Hkv, D] are made from a seed on every rank. A rank copies its
   tokens into its own sequence-layout buffers (separate tensors, or views into one fused
   [B, S_r, H + 2*Hkv, D] buffer), runs uly_forward and uly_backward, and writes its shard of
   out, dq, dk, dv (its tokens, all heads) and of lse (its heads, all tokens) back into the full
   result arrays. Outputs start as NaN so anything left unwritten shows.

   Needs ulysses.h (with the implementation) and ref64.h included first. */
#ifndef ULY_SP_CASE_H
#define ULY_SP_CASE_H

#include <stdio.h>
#include <string.h>

#include "attn_call.h"

typedef struct sp_case {
    int P;
    int64_t B, S, H, Hkv, D;
    int causal;
    int fused;         /* q, k, v and dq, dk, dv as views into fused buffers */
    float scale;       /* 0 = 1/sqrt(D) */
} sp_case;

#define SP_CASE_FMT "P=%d B=%lld S=%lld H=%lld Hkv=%lld D=%lld causal=%d fused=%d"
#define SP_CASE_ARGS(c)                                                                        \
    (c)->P, (long long)(c)->B, (long long)(c)->S, (long long)(c)->H, (long long)(c)->Hkv,      \
        (long long)(c)->D, (c)->causal, (c)->fused

/* Full tensors: inputs q, k, v, dout and results out, lse [B, H, S], dq, dk, dv. */
typedef struct sp_full {
    float *q, *k, *v, *dout;
    float *out, *lse, *dq, *dk, *dv;
} sp_full;

static inline int64_t sp_nq(const sp_case *c) { return c->B * c->S * c->H * c->D; }
static inline int64_t sp_nkv(const sp_case *c) { return c->B * c->S * c->Hkv * c->D; }
static inline int64_t sp_nlse(const sp_case *c) { return c->B * c->H * c->S; }

static inline void sp_fill_nan(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
}

static inline sp_full sp_alloc(const sp_case *c, uint64_t seed) {
    sp_full f;
    f.q = ref_alloc_f(sp_nq(c));
    f.k = ref_alloc_f(sp_nkv(c));
    f.v = ref_alloc_f(sp_nkv(c));
    f.dout = ref_alloc_f(sp_nq(c));
    ref_fill(f.q, sp_nq(c), seed);
    ref_fill(f.k, sp_nkv(c), seed + 1);
    ref_fill(f.v, sp_nkv(c), seed + 2);
    ref_fill(f.dout, sp_nq(c), seed + 3);
    f.out = ref_alloc_f(sp_nq(c));
    f.lse = ref_alloc_f(sp_nlse(c));
    f.dq = ref_alloc_f(sp_nq(c));
    f.dk = ref_alloc_f(sp_nkv(c));
    f.dv = ref_alloc_f(sp_nkv(c));
    sp_fill_nan(f.out, sp_nq(c));
    sp_fill_nan(f.lse, sp_nlse(c));
    sp_fill_nan(f.dq, sp_nq(c));
    sp_fill_nan(f.dk, sp_nkv(c));
    sp_fill_nan(f.dv, sp_nkv(c));
    return f;
}

static inline void sp_free(sp_full *f) {
    free(f->q), free(f->k), free(f->v), free(f->dout);
    free(f->out), free(f->lse), free(f->dq), free(f->dk), free(f->dv);
}

/* Copy tokens [s0, s0 + t.s) of full [t.b, S, t.h, t.d] into the view t, or back (to_full). */
static inline void sp_copy_tokens(uly_tensor t, float *full, int64_t S, int64_t s0, int to_full) {
    for (int64_t b = 0; b < t.b; b++)
        for (int64_t i = 0; i < t.s; i++)
            for (int64_t h = 0; h < t.h; h++) {
                float *view = (float *)t.data + b * t.sb + i * t.ss + h * t.sh;
                float *row = full + ((b * S + s0 + i) * t.h + h) * t.d;
                if (to_full) memcpy(row, view, (size_t)t.d * sizeof(float));
                else memcpy(view, row, (size_t)t.d * sizeof(float));
            }
}

/* The unsharded CPU reference: uly_cpu_attention forward and backward on the full tensors. */
static inline uly_status sp_cpu_reference(const sp_case *c, sp_full *f) {
    const ref_shape s = {c->B, c->S, c->S, c->H, c->Hkv, c->D, c->causal, c->scale};
    const attn_bufs x = {f->q, f->k, f->v, f->out, f->lse, f->dout, f->dq, f->dk, f->dv};
    return attn_run(attn_args(&s, &x), 1);
}

/* The plan of case c for `rank` of a world of world_size ranks, in dtype t. */
static inline uly_status sp_plan(const sp_case *c, int world_size, int rank, uly_dtype t,
                                 uly_plan *plan) {
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = world_size, d.rank = rank, d.sp_size = c->P;
    d.batch = c->B, d.seq_len = c->S, d.n_heads = c->H, d.n_kv_heads = c->Hkv;
    d.head_dim = c->D, d.dtype = t;
    return uly_plan_init(plan, &d);
}

/* One rank's sequence-layout tensors in fp32 host buffers (NaN until written): q, k, v and dq,
   dk, dv as views into fused [B, S_r, H + 2*Hkv, D] buffers, or one after another in them. */
typedef struct sp_shard {
    uly_range tok, heads;              /* this rank's tokens and heads */
    float *in, *grad, *out, *dout;     /* q k v, dq dk dv, out, dout */
    uly_tensor q, k, v, o, dO, dq, dk, dv;
} sp_shard;

static inline sp_shard sp_shard_alloc(const sp_case *c, const uly_plan *plan) {
    sp_shard s;
    s.tok = uly_tokens(plan, plan->sp_rank), s.heads = uly_heads(plan, plan->sp_rank);
    const int64_t B = c->B, Sr = s.tok.count, D = c->D, no = B * Sr * c->H * D;
    const int64_t nkv = B * Sr * c->Hkv * D, nqkv = no + 2 * nkv;
    s.in = ref_alloc_f(nqkv), s.grad = ref_alloc_f(nqkv);
    s.out = ref_alloc_f(no), s.dout = ref_alloc_f(no);
    sp_fill_nan(s.in, nqkv), sp_fill_nan(s.grad, nqkv), sp_fill_nan(s.out, no);
    sp_fill_nan(s.dout, no);
    if (c->fused) {
        uly_qkv_views(s.in, ULY_F32, B, Sr, c->H, c->Hkv, D, &s.q, &s.k, &s.v);
        uly_qkv_views(s.grad, ULY_F32, B, Sr, c->H, c->Hkv, D, &s.dq, &s.dk, &s.dv);
    } else {
        s.q = uly_dense(s.in, ULY_F32, B, Sr, c->H, D);
        s.k = uly_dense(s.in + no, ULY_F32, B, Sr, c->Hkv, D);
        s.v = uly_dense(s.in + no + nkv, ULY_F32, B, Sr, c->Hkv, D);
        s.dq = uly_dense(s.grad, ULY_F32, B, Sr, c->H, D);
        s.dk = uly_dense(s.grad + no, ULY_F32, B, Sr, c->Hkv, D);
        s.dv = uly_dense(s.grad + no + nkv, ULY_F32, B, Sr, c->Hkv, D);
    }
    s.o = uly_dense(s.out, ULY_F32, B, Sr, c->H, D);
    s.dO = uly_dense(s.dout, ULY_F32, B, Sr, c->H, D);
    return s;
}

static inline void sp_shard_free(sp_shard *s) {
    free(s->in), free(s->grad), free(s->out), free(s->dout);
}

/* The rank's tokens of q, k, v and dout, from the full tensors. */
static inline void sp_shard_load(sp_shard *s, const sp_case *c, sp_full *f) {
    sp_copy_tokens(s->q, f->q, c->S, s->tok.start, 0);
    sp_copy_tokens(s->k, f->k, c->S, s->tok.start, 0);
    sp_copy_tokens(s->v, f->v, c->S, s->tok.start, 0);
    sp_copy_tokens(s->dO, f->dout, c->S, s->tok.start, 0);
}

/* out (and with grad, dq, dk, dv) of the rank's tokens into the full tensors. */
static inline void sp_shard_store(const sp_shard *s, const sp_case *c, sp_full *f, int grad) {
    sp_copy_tokens(s->o, f->out, c->S, s->tok.start, 1);
    if (!grad) return;
    sp_copy_tokens(s->dq, f->dq, c->S, s->tok.start, 1);
    sp_copy_tokens(s->dk, f->dk, c->S, s->tok.start, 1);
    sp_copy_tokens(s->dv, f->dv, c->S, s->tok.start, 1);
}

/* The rank's lse [B, H_r, S] (as uly_saved_lse holds it) into the full lse [B, H, S]. */
static inline void sp_shard_store_lse(const sp_shard *s, const sp_case *c, const float *lse,
                                      sp_full *f) {
    for (int64_t b = 0; b < c->B; b++)
        memcpy(f->lse + (b * c->H + s->heads.start) * c->S, lse + b * s->heads.count * c->S,
               (size_t)(s->heads.count * c->S) * sizeof(float));
}

/* Runs the layer on this rank of `comm` (an SP group of a world of world_size ranks, this one
   being `rank`) and writes its shards into f; in_place: out written over q, dq over dout. */
static inline uly_status sp_run_rank(const uly_comm *comm, int world_size, int rank,
                                     const sp_case *c, sp_full *f, int in_place) {
    uly_plan plan;
    uly_status st = sp_plan(c, world_size, rank, ULY_F32, &plan);
    if (st.code) return st;
    sp_shard s = sp_shard_alloc(c, &plan);
    sp_shard_load(&s, c, f);
    if (in_place) s.o = s.q, s.dq = s.dO;

    uly_layer L;
    memset(&L, 0, sizeof L);
    L.plan = &plan;
    L.comm = comm;
    L.attn = uly_cpu_attention();
    L.layout = uly_cpu_layout();
    L.softmax_scale = c->scale;
    L.causal = c->causal;
    L.workspace_bytes = uly_layer_workspace(&L);
    L.workspace = malloc((size_t)(L.workspace_bytes > 0 ? L.workspace_bytes : 1));
    const int64_t nsaved = uly_saved_bytes(&plan);
    void *saved = malloc((size_t)(nsaved > 0 ? nsaved : 1));

    st = uly_forward(&L, s.q, s.k, s.v, s.o, saved, nsaved);
    if (!st.code) {
        sp_shard_store(&s, c, f, 0);
        sp_shard_store_lse(&s, c, uly_saved_lse(&plan, saved), f);
        st = uly_backward(&L, s.dO, saved, nsaved, s.dq, s.dk, s.dv);
    }
    if (!st.code) sp_shard_store(&s, c, f, 1);
    free(L.workspace), free(saved);
    sp_shard_free(&s);
    return st;
}

/* Runs the layer on c->P threads of uly_local_run (the CPU layer of ulysses.h) and gathers the
   shards into f. The first error of the run or of a rank. */
typedef struct sp__local_job {
    const sp_case *c;
    sp_full *f;
    uly_status st[ULY_MAX_SP];
} sp__local_job;

static inline void sp__local_rank(const uly_comm *comm, void *user) {
    sp__local_job *j = (sp__local_job *)user;
    j->st[comm->rank] = sp_run_rank(comm, j->c->P, comm->rank, j->c, j->f, 0);
}

static inline uly_status sp_run_local(const sp_case *c, sp_full *f) {
    sp__local_job j;
    memset(&j, 0, sizeof j);
    j.c = c, j.f = f;
    uly_status st = uly_local_run(c->P, sp__local_rank, &j);
    for (int r = 0; r < c->P && !st.code; r++) st = j.st[r];
    return st;
}

#endif
