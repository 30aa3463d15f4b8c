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
    uly_attn attn = uly_cpu_attention();
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(f->q, ULY_F32, c->B, c->S, c->H, c->D);
    a.k = uly_dense(f->k, ULY_F32, c->B, c->S, c->Hkv, c->D);
    a.v = uly_dense(f->v, ULY_F32, c->B, c->S, c->Hkv, c->D);
    a.o = uly_dense(f->out, ULY_F32, c->B, c->S, c->H, c->D);
    a.lse = f->lse;
    a.dout = uly_dense(f->dout, ULY_F32, c->B, c->S, c->H, c->D);
    a.dq = uly_dense(f->dq, ULY_F32, c->B, c->S, c->H, c->D);
    a.dk = uly_dense(f->dk, ULY_F32, c->B, c->S, c->Hkv, c->D);
    a.dv = uly_dense(f->dv, ULY_F32, c->B, c->S, c->Hkv, c->D);
    a.softmax_scale = c->scale;
    a.causal = c->causal;
    int64_t ws = attn.workspace ? attn.workspace(attn.ctx, &a) : 0;
    a.workspace = malloc((size_t)(ws > 0 ? ws : 1));
    uly_status st = attn.fwd(attn.ctx, &a);
    if (!st.code) st = attn.bwd(attn.ctx, &a);
    free(a.workspace);
    return st;
}

/* Runs the layer on this rank of `comm` (an SP group of a world of world_size ranks, this one
   being `rank`) and writes its shards into f. */
static inline uly_status sp_run_rank(const uly_comm *comm, int world_size, int rank, const sp_case *c,
                              sp_full *f) {
    uly_plan plan;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = world_size;
    d.rank = rank;
    d.sp_size = c->P;
    d.batch = c->B;
    d.seq_len = c->S;
    d.n_heads = c->H;
    d.n_kv_heads = c->Hkv;
    d.head_dim = c->D;
    d.dtype = ULY_F32;
    uly_status st = uly_plan_init(&plan, &d);
    if (st.code) return st;

    uly_range tok = uly_tokens(&plan, plan.sp_rank), hr = uly_heads(&plan, plan.sp_rank);
    int64_t Sr = tok.count, nh = c->H + 2 * c->Hkv;
    float *qkv = ref_alloc_f(c->B * Sr * nh * c->D), *dqkv = ref_alloc_f(c->B * Sr * nh * c->D);
    float *sep = ref_alloc_f(c->B * Sr * nh * c->D), *dsep = ref_alloc_f(c->B * Sr * nh * c->D);
    float *out = ref_alloc_f(c->B * Sr * c->H * c->D), *dout = ref_alloc_f(c->B * Sr * c->H * c->D);
    sp_fill_nan(qkv, c->B * Sr * nh * c->D);
    sp_fill_nan(dqkv, c->B * Sr * nh * c->D);
    sp_fill_nan(dsep, c->B * Sr * nh * c->D);
    sp_fill_nan(out, c->B * Sr * c->H * c->D);

    uly_tensor q, k, v, dq, dk, dv;
    if (c->fused) {
        uly_qkv_views(qkv, ULY_F32, c->B, Sr, c->H, c->Hkv, c->D, &q, &k, &v);
        uly_qkv_views(dqkv, ULY_F32, c->B, Sr, c->H, c->Hkv, c->D, &dq, &dk, &dv);
    } else {
        int64_t nq = c->B * Sr * c->H * c->D, nkv = c->B * Sr * c->Hkv * c->D;
        q = uly_dense(sep, ULY_F32, c->B, Sr, c->H, c->D);
        k = uly_dense(sep + nq, ULY_F32, c->B, Sr, c->Hkv, c->D);
        v = uly_dense(sep + nq + nkv, ULY_F32, c->B, Sr, c->Hkv, c->D);
        dq = uly_dense(dsep, ULY_F32, c->B, Sr, c->H, c->D);
        dk = uly_dense(dsep + nq, ULY_F32, c->B, Sr, c->Hkv, c->D);
        dv = uly_dense(dsep + nq + nkv, ULY_F32, c->B, Sr, c->Hkv, c->D);
    }
    sp_copy_tokens(q, f->q, c->S, tok.start, 0);
    sp_copy_tokens(k, f->k, c->S, tok.start, 0);
    sp_copy_tokens(v, f->v, c->S, tok.start, 0);
    uly_tensor o = uly_dense(out, ULY_F32, c->B, Sr, c->H, c->D);
    uly_tensor dO = uly_dense(dout, ULY_F32, c->B, Sr, c->H, c->D);
    sp_copy_tokens(dO, f->dout, c->S, tok.start, 0);

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
    void *saved = malloc((size_t)(uly_saved_bytes(&plan) > 0 ? uly_saved_bytes(&plan) : 1));

    st = uly_forward(&L, q, k, v, o, saved);
    if (!st.code) {
        sp_copy_tokens(o, f->out, c->S, tok.start, 1);
        const float *lse = uly_saved_lse(&plan, saved); /* [B, H_r, S] */
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t h = 0; h < hr.count; h++)
                memcpy(f->lse + (b * c->H + hr.start + h) * c->S, lse + (b * hr.count + h) * c->S,
                       (size_t)c->S * sizeof(float));
        st = uly_backward(&L, dO, saved, dq, dk, dv);
    }
    if (!st.code) {
        sp_copy_tokens(dq, f->dq, c->S, tok.start, 1);
        sp_copy_tokens(dk, f->dk, c->S, tok.start, 1);
        sp_copy_tokens(dv, f->dv, c->S, tok.start, 1);
    }
    free(L.workspace), free(saved);
    free(qkv), free(dqkv), free(sep), free(dsep), free(out), free(dout);
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
    j->st[comm->rank] = sp_run_rank(comm, j->c->P, comm->rank, j->c, j->f);
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
