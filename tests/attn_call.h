/* attn_call.h - one call of uly_cpu_attention on dense fp32 buffers, for the tests: the args of a
   ref_shape over the buffers, and the forward (and backward) with the workspace it asks for.
   Include after ulysses.h and ref64.h. */
#ifndef ULY_ATTN_CALL_H
#define ULY_ATTN_CALL_H

/* q, o, dout, dq [B, Sq, H, D]; k, v, dk, dv [B, Sk, Hkv, D]; lse [B, H, Sq]. A forward may
   leave the backward's NULL. */
typedef struct attn_bufs {
    float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
} attn_bufs;

static inline uly_attn_args attn_args(const ref_shape *s, const attn_bufs *x) {
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(x->q, ULY_F32, s->B, s->Sq, s->H, s->D);
    a.k = uly_dense(x->k, ULY_F32, s->B, s->Sk, s->Hkv, s->D);
    a.v = uly_dense(x->v, ULY_F32, s->B, s->Sk, s->Hkv, s->D);
    a.o = uly_dense(x->o, ULY_F32, s->B, s->Sq, s->H, s->D);
    a.dout = uly_dense(x->dout, ULY_F32, s->B, s->Sq, s->H, s->D);
    a.dq = uly_dense(x->dq, ULY_F32, s->B, s->Sq, s->H, s->D);
    a.dk = uly_dense(x->dk, ULY_F32, s->B, s->Sk, s->Hkv, s->D);
    a.dv = uly_dense(x->dv, ULY_F32, s->B, s->Sk, s->Hkv, s->D);
    a.lse = x->lse;
    a.causal = s->causal;
    a.softmax_scale = (float)s->scale;
    return a;
}

/* uly_cpu_attention's forward, then its backward if asked; the first error. */
static inline uly_status attn_run(uly_attn_args a, int backward) {
    uly_attn attn = uly_cpu_attention();
    int64_t ws = attn.workspace(attn.ctx, &a);
    a.workspace = malloc((size_t)(ws > 0 ? ws : 1));
    a.workspace_bytes = ws;
    uly_status st = attn.fwd(attn.ctx, &a);
    if (!st.code && backward) st = attn.bwd(attn.ctx, &a);
    free(a.workspace);
    return st;
}

#endif
