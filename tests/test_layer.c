/* test_layer.c - the SP attention layer over the local communicator (P ranks as threads).

   Each case runs uly_forward and uly_backward on P threads and gathers the shards. The layer
   only moves data: per head it must run the same attention on the same numbers as an unsharded
   run, so
     - the forward (out and lse) is bit-identical to uly_cpu_attention on the full tensors,
     - the backward is within 1e-6 of it (copies of a replicated kv head are summed in another
       order),
     - and both are within 1e-5 of the fp64 reference of ref64.h (inputs uniform in [-1, 1)).
   The attention itself is also checked against fp64 directly, including Sq != Sk and rows
   with no key kept. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"
#include "sp_case.h"
#include "attn_call.h"

/* P, B, S, H, Hkv, D, causal, fused */
static const sp_case cases[] = {
    {1, 1, 5, 2, 2, 8, 0, 0, 0},    /* one rank: the layer is plain attention */
    {1, 2, 7, 4, 2, 8, 1, 1, 0},
    {2, 1, 16, 4, 4, 8, 1, 0, 0},   /* MHA, even split */
    {2, 1, 7, 3, 1, 8, 1, 0, 0},    /* MQA, uneven S and H */
    {3, 2, 17, 3, 3, 8, 1, 0, 0},   /* uneven S, B > 1 */
    {3, 2, 17, 3, 3, 8, 1, 1, 0},
    {3, 1, 13, 5, 5, 16, 0, 0, 0},  /* uneven H */
    {3, 2, 11, 6, 2, 8, 1, 0, 0},   /* g = 3: a GQA group split across ranks */
    {3, 2, 11, 6, 2, 8, 0, 1, 0},
    {3, 1, 7, 8, 2, 8, 1, 0, 0},    /* g = 4 over H_r = 3, 3, 2: rank 1 holds 3 heads of 2 kv */
    {4, 2, 67, 8, 2, 16, 1, 0, 0},  /* GQA g = 4, Hkv < P: replicated kv heads */
    {4, 2, 67, 8, 2, 16, 1, 1, 0},
    {4, 3, 31, 4, 1, 8, 1, 0, 0},   /* MQA, Hkv = 1 < P, B = 3 */
    {4, 3, 31, 4, 1, 8, 0, 1, 0},
    {4, 1, 9, 6, 3, 8, 1, 0, 0},    /* uneven H with g = 2: H_r = 2,2,1,1 */
    {4, 2, 4, 4, 4, 8, 1, 0, 0.3f}, /* S = P, explicit scale */
    {8, 1, 67, 8, 8, 8, 1, 0, 0},
    {8, 2, 8, 8, 2, 8, 0, 0, 0},    /* S = P, Hkv < P */
    {8, 1, 23, 16, 4, 16, 1, 1, 0}, /* g = 4, two heads per rank */
    {8, 2, 29, 11, 1, 8, 1, 0, 0},  /* prime S and H, MQA */
};
enum { NCASES = sizeof cases / sizeof *cases };

/* ---------------------------------------------------------------------------------------------
   Running a case (once; every test reads the same results) */

typedef struct job {
    const sp_case *c;
    sp_full *f;
    int in_place;
    uly_status st[8];
} job;

static void rank_main(const uly_comm *comm, void *user) {
    job *j = (job *)user;
    j->st[comm->rank] = sp_run_rank(comm, j->c->P, comm->rank, j->c, j->f, j->in_place);
}

typedef struct result {
    int done;
    sp_full sp, cpu;         /* the layer's gathered shards; uly_cpu_attention unsharded */
    double *o, *lse, *dq, *dk, *dv; /* fp64 */
    char err[300];           /* the first failure of a run, if any */
} result;

static result results[NCASES];

static result *run_case(int i) {
    result *r = &results[i];
    if (r->done) return r;
    const sp_case *c = &cases[i];
    r->done = 1;
    r->sp = sp_alloc(c, 1000 + (uint64_t)i);
    r->cpu = sp_alloc(c, 1000 + (uint64_t)i);
    job j;
    memset(&j, 0, sizeof j);
    j.c = c;
    j.f = &r->sp;
    uly_status st = uly_local_run(c->P, rank_main, &j);
    if (st.code) snprintf(r->err, sizeof r->err, "uly_local_run: %s", st.msg);
    for (int p = 0; p < c->P && !r->err[0]; p++)
        if (j.st[p].code) snprintf(r->err, sizeof r->err, "rank %d: %s", p, j.st[p].msg);
    st = sp_cpu_reference(c, &r->cpu);
    if (st.code && !r->err[0]) snprintf(r->err, sizeof r->err, "cpu reference: %s", st.msg);
    ref_shape s = {c->B, c->S, c->S, c->H, c->Hkv, c->D, c->causal, c->scale};
    r->o = ref_alloc_d(sp_nq(c));
    r->lse = ref_alloc_d(sp_nlse(c));
    r->dq = ref_alloc_d(sp_nq(c));
    r->dk = ref_alloc_d(sp_nkv(c));
    r->dv = ref_alloc_d(sp_nkv(c));
    ref64_forward(&s, r->sp.q, r->sp.k, r->sp.v, r->o, r->lse);
    ref64_backward(&s, r->sp.q, r->sp.k, r->sp.v, r->sp.dout, r->dq, r->dk, r->dv);
    return r;
}

/* fp32 lse [B, H, S] against fp64. */
static double lse_diff(const float *got, const double *want, int64_t n) {
    return ref_maxdiff_fd(got, want, n);
}

/* ---------------------------------------------------------------------------------------------
   The layer against the unsharded references */

TEST(every_rank_of_every_case_runs_without_error) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        CHECK(!r->err[0], SP_CASE_FMT ": %s", SP_CASE_ARGS(&cases[i]), r->err);
    }
}

TEST(forward_output_is_bit_identical_to_unsharded_cpu_attention) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        int64_t nd = ref_bitdiff(r->sp.out, r->cpu.out, sp_nq(&cases[i]));
        CHECK(nd == 0, SP_CASE_FMT ": %lld of %lld outputs differ (max %g)",
              SP_CASE_ARGS(&cases[i]), (long long)nd, (long long)sp_nq(&cases[i]),
              ref_maxdiff_ff(r->sp.out, r->cpu.out, sp_nq(&cases[i])));
    }
}

TEST(forward_lse_is_bit_identical_to_unsharded_cpu_attention) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        int64_t nd = ref_bitdiff(r->sp.lse, r->cpu.lse, sp_nlse(&cases[i]));
        CHECK(nd == 0, SP_CASE_FMT ": %lld of %lld lse values differ", SP_CASE_ARGS(&cases[i]),
              (long long)nd, (long long)sp_nlse(&cases[i]));
    }
}

TEST(backward_is_within_1e_6_of_unsharded_cpu_attention) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        const sp_case *c = &cases[i];
        double eq = ref_maxdiff_ff(r->sp.dq, r->cpu.dq, sp_nq(c));
        double ek = ref_maxdiff_ff(r->sp.dk, r->cpu.dk, sp_nkv(c));
        double ev = ref_maxdiff_ff(r->sp.dv, r->cpu.dv, sp_nkv(c));
        CHECK(eq <= 1e-6 && ek <= 1e-6 && ev <= 1e-6, SP_CASE_FMT ": dq %g dk %g dv %g",
              SP_CASE_ARGS(c), eq, ek, ev);
    }
}

TEST(backward_dq_is_bit_identical_to_unsharded_cpu_attention) {
    /* dq of a head depends on that head alone: no sum crosses ranks. */
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        int64_t nd = ref_bitdiff(r->sp.dq, r->cpu.dq, sp_nq(&cases[i]));
        CHECK(nd == 0, SP_CASE_FMT ": %lld dq values differ", SP_CASE_ARGS(&cases[i]),
              (long long)nd);
    }
}

TEST(forward_output_is_within_1e_5_of_fp64_attention) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        double e = ref_maxdiff_fd(r->sp.out, r->o, sp_nq(&cases[i]));
        CHECK(e <= 1e-5, SP_CASE_FMT ": out off by %g", SP_CASE_ARGS(&cases[i]), e);
    }
}

TEST(saved_lse_in_B_Hr_S_layout_is_within_1e_5_of_fp64_lse) {
    for (int i = 0; i < NCASES; i++) {
        result *r = run_case(i);
        double e = lse_diff(r->sp.lse, r->lse, sp_nlse(&cases[i]));
        CHECK(e <= 1e-5, SP_CASE_FMT ": lse off by %g", SP_CASE_ARGS(&cases[i]), e);
    }
}

/* The largest errors of f's out, lse, dq, dk, dv against case i's fp64 reference. */
static void fp64_errors(int i, const sp_full *f, double e[5]) {
    const sp_case *c = &cases[i];
    const result *r = run_case(i);
    e[0] = ref_maxdiff_fd(f->out, r->o, sp_nq(c));
    e[1] = ref_maxdiff_fd(f->lse, r->lse, sp_nlse(c));
    e[2] = ref_maxdiff_fd(f->dq, r->dq, sp_nq(c));
    e[3] = ref_maxdiff_fd(f->dk, r->dk, sp_nkv(c));
    e[4] = ref_maxdiff_fd(f->dv, r->dv, sp_nkv(c));
}

TEST(backward_is_within_1e_5_of_fp64_gradients) {
    for (int i = 0; i < NCASES; i++) {
        double e[5];
        fp64_errors(i, &run_case(i)->sp, e);
        CHECK(e[2] <= 1e-5 && e[3] <= 1e-5 && e[4] <= 1e-5, SP_CASE_FMT ": dq %g dk %g dv %g",
              SP_CASE_ARGS(&cases[i]), e[2], e[3], e[4]);
    }
}

TEST(unsharded_cpu_attention_is_within_1e_5_of_fp64_forward_and_backward) {
    for (int i = 0; i < NCASES; i++) {
        double e[5];
        fp64_errors(i, &run_case(i)->cpu, e);
        CHECK(e[0] <= 1e-5 && e[1] <= 1e-5 && e[2] <= 1e-5 && e[3] <= 1e-5 && e[4] <= 1e-5,
              SP_CASE_FMT ": out %g lse %g dq %g dk %g dv %g", SP_CASE_ARGS(&cases[i]), e[0],
              e[1], e[2], e[3], e[4]);
    }
}

TEST(fused_qkv_views_give_the_same_bits_as_separate_tensors) {
    /* Each fused case follows its separate twin in the table with the same shape; rerun the
       fused one's data through the separate path and compare bit for bit. */
    for (int i = 0; i < NCASES; i++) {
        if (!cases[i].fused) continue;
        sp_case c = cases[i];
        c.fused = 0;
        sp_full f = sp_alloc(&c, 1000 + (uint64_t)i);
        job j;
        memset(&j, 0, sizeof j);
        j.c = &c;
        j.f = &f;
        uly_status st = uly_local_run(c.P, rank_main, &j);
        CHECK(st.code == ULY_OK, "%s", st.msg);
        result *r = run_case(i);
        int64_t nd =
            ref_bitdiff(f.out, r->sp.out, sp_nq(&c)) + ref_bitdiff(f.dq, r->sp.dq, sp_nq(&c)) +
            ref_bitdiff(f.dk, r->sp.dk, sp_nkv(&c)) + ref_bitdiff(f.dv, r->sp.dv, sp_nkv(&c));
        CHECK(nd == 0, SP_CASE_FMT ": %lld values differ", SP_CASE_ARGS(&cases[i]), (long long)nd);
        sp_free(&f);
    }
}

/* out may be written over q, and dq over dout: the layer exchanges its inputs before it writes
   an output. The same bits as separate buffers, for one and several batches, fused or not. */
TEST(outputs_written_over_their_inputs_give_the_same_bits) {
    const int picks[] = {3, 5, 10, 12};
    for (int k = 0; k < 4; k++) {
        const int i = picks[k];
        const sp_case c = cases[i];
        sp_full f = sp_alloc(&c, 1000 + (uint64_t)i);
        job j;
        memset(&j, 0, sizeof j);
        j.c = &c;
        j.f = &f;
        j.in_place = 1;
        uly_status st = uly_local_run(c.P, rank_main, &j);
        for (int r = 0; r < c.P && !st.code; r++) st = j.st[r];
        CHECK(st.code == ULY_OK, SP_CASE_FMT ": %s", SP_CASE_ARGS(&c), st.msg);
        const result *want = run_case(i);
        int64_t nd = ref_bitdiff(f.out, want->sp.out, sp_nq(&c)) +
                     ref_bitdiff(f.dq, want->sp.dq, sp_nq(&c)) +
                     ref_bitdiff(f.dk, want->sp.dk, sp_nkv(&c)) +
                     ref_bitdiff(f.dv, want->sp.dv, sp_nkv(&c));
        CHECK(nd == 0, SP_CASE_FMT ": %lld values differ", SP_CASE_ARGS(&c), (long long)nd);
        sp_free(&f);
    }
}

/* ---------------------------------------------------------------------------------------------
   The attention contract, against fp64 directly */

/* Runs uly_cpu_attention on dense tensors built from a seed and compares with ref64. Returns the
   largest error of out, lse, dq, dk, dv; *status_code gets the first non-zero status. */
static double attn_vs_fp64(const ref_shape *ac, uint64_t seed, int *status_code) {
    int64_t nq = ac->B * ac->Sq * ac->H * ac->D, nk = ac->B * ac->Sk * ac->Hkv * ac->D;
    int64_t nl = ac->B * ac->H * ac->Sq;
    attn_bufs x = {ref_alloc_f(nq), ref_alloc_f(nk), ref_alloc_f(nk), ref_alloc_f(nq),
                   ref_alloc_f(nl), ref_alloc_f(nq), ref_alloc_f(nq), ref_alloc_f(nk),
                   ref_alloc_f(nk)};
    ref_fill(x.q, nq, seed), ref_fill(x.k, nk, seed + 1), ref_fill(x.v, nk, seed + 2);
    ref_fill(x.dout, nq, seed + 3);
    sp_fill_nan(x.o, nq), sp_fill_nan(x.lse, nl), sp_fill_nan(x.dq, nq), sp_fill_nan(x.dk, nk);
    sp_fill_nan(x.dv, nk);
    *status_code = attn_run(attn_args(ac, &x), 1).code;

    double *ro = ref_alloc_d(nq), *rl = ref_alloc_d(nl), *rq = ref_alloc_d(nq);
    double *rk = ref_alloc_d(nk), *rv = ref_alloc_d(nk);
    ref64_forward(ac, x.q, x.k, x.v, ro, rl);
    ref64_backward(ac, x.q, x.k, x.v, x.dout, rq, rk, rv);
    double e = fmax(fmax(ref_maxdiff_fd(x.o, ro, nq), ref_maxdiff_fd(x.lse, rl, nl)),
                    fmax(ref_maxdiff_fd(x.dq, rq, nq),
                         fmax(ref_maxdiff_fd(x.dk, rk, nk), ref_maxdiff_fd(x.dv, rv, nk))));
    free(x.q), free(x.k), free(x.v), free(x.dout), free(x.o), free(x.lse), free(x.dq);
    free(x.dk), free(x.dv);
    free(ro), free(rl), free(rq), free(rk), free(rv);
    return e;
}

TEST(cpu_attention_matches_fp64_for_sq_not_equal_sk_and_gqa) {
    static const ref_shape acs[] = { /* B, Sq, Sk, H, Hkv, D, causal, scale */
        {1, 5, 9, 2, 2, 8, 1, 0},   /* Sq < Sk: bottom-right causal keeps more keys */
        {2, 9, 5, 4, 2, 8, 1, 0},   /* Sq > Sk: rows 0..3 keep no key */
        {1, 7, 7, 8, 1, 16, 1, 0},  /* MQA */
        {2, 6, 11, 6, 3, 8, 0, 0},  /* GQA, not causal */
        {1, 3, 1, 1, 1, 8, 1, 0},   /* one key: only the last row keeps it */
    };
    for (size_t i = 0; i < sizeof acs / sizeof *acs; i++) {
        int code = -1;
        double e = attn_vs_fp64(&acs[i], 77 + i, &code);
        CHECK(code == ULY_OK && e <= 1e-5, "case %d (Sq %lld Sk %lld H %lld Hkv %lld causal %d): "
              "status %d, max error %g", (int)i, (long long)acs[i].Sq, (long long)acs[i].Sk,
              (long long)acs[i].H, (long long)acs[i].Hkv, acs[i].causal, code, e);
    }
}

TEST(a_row_with_no_key_kept_outputs_zero_and_lse_inf_and_no_nan) {
    /* Sq = 4, Sk = 2, causal: rows 0 and 1 keep j <= i - 2, nothing. */
    enum { B = 1, Sq = 4, Sk = 2, H = 2, D = 8 };
    static const ref_shape ac = {B, Sq, Sk, H, H, D, 1, 0};
    float q[B * Sq * H * D], k[B * Sk * H * D], v[B * Sk * H * D], dout[B * Sq * H * D];
    float o[B * Sq * H * D], lse[B * H * Sq], dq[B * Sq * H * D], dk[B * Sk * H * D],
        dv[B * Sk * H * D];
    ref_fill(q, B * Sq * H * D, 5), ref_fill(k, B * Sk * H * D, 6), ref_fill(v, B * Sk * H * D, 7);
    ref_fill(dout, B * Sq * H * D, 8);
    attn_bufs x = {q, k, v, o, lse, dout, dq, dk, dv};
    uly_status st = attn_run(attn_args(&ac, &x), 1);
    CHECK(st.code == ULY_OK, "fwd and bwd: %s", st.msg);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < 2; i++) {
            CHECK(isinf(lse[h * Sq + i]) && lse[h * Sq + i] > 0, "lse[h%d, row %d] = %g", h, i,
                  lse[h * Sq + i]);
            for (int d = 0; d < D; d++) {
                CHECK(o[(i * H + h) * D + d] == 0, "o[row %d, h%d, %d] = %g", i, h, d,
                      o[(i * H + h) * D + d]);
                CHECK(dq[(i * H + h) * D + d] == 0, "dq[row %d, h%d, %d] = %g", i, h, d,
                      dq[(i * H + h) * D + d]);
            }
        }
    int nan = 0;
    for (int i = 0; i < B * Sq * H * D; i++) nan += isnan(o[i]) || isnan(dq[i]);
    for (int i = 0; i < B * Sk * H * D; i++) nan += isnan(dk[i]) || isnan(dv[i]);
    CHECK(nan == 0, "%d NaN values", nan);
}

TEST(q_head0_maps_a_head_slice_to_the_kv_heads_of_its_global_group) {
    /* H = 6, Hkv = 2 (g = 3). Heads [2, 4) of q use kv heads 0 and 1; run them alone with
       q_head0 = 2 and the kv slice [0, 2), and compare with the same heads of a full run. */
    enum { B = 2, S = 7, H = 6, HKV = 2, D = 8 };
    static const ref_shape ac = {B, S, S, H, HKV, D, 1, 0};
    static float q[B * S * H * D], k[B * S * HKV * D], v[B * S * HKV * D];
    static float o_full[B * S * H * D], lse_full[B * H * S], o_part[B * S * H * D],
        lse_part[B * 2 * S];
    ref_fill(q, B * S * H * D, 11);
    ref_fill(k, B * S * HKV * D, 12), ref_fill(v, B * S * HKV * D, 13);
    sp_fill_nan(o_part, B * S * H * D);
    attn_bufs full = {q, k, v, o_full, lse_full, NULL, NULL, NULL, NULL};
    uly_attn_args a = attn_args(&ac, &full);
    uly_status st = attn_run(a, 0);
    CHECK(st.code == ULY_OK, "full: %s", st.msg);

    a.q = uly_head_slice(a.q, 2, 2);
    a.o = uly_head_slice(uly_dense(o_part, ULY_F32, B, S, H, D), 2, 2);
    a.lse = lse_part;
    a.q_head0 = 2;
    a.kv_group = 3;
    st = attn_run(a, 0);
    CHECK(st.code == ULY_OK, "slice: %s", st.msg);
    int64_t nd = 0;
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            nd += ref_bitdiff(o_part + ((b * S + s) * H + 2) * D,
                              o_full + ((b * S + s) * H + 2) * D, 2 * D);
            nd += !isnan(o_part[((b * S + s) * H + 0) * D]); /* other heads untouched */
        }
    for (int b = 0; b < B; b++)
        nd += ref_bitdiff(lse_part + b * 2 * S, lse_full + (b * H + 2) * S, 2 * S);
    CHECK(nd == 0, "%lld values differ from the full run's heads 2 and 3", (long long)nd);
}

TEST(head_slice_and_qkv_views_have_the_documented_strides) {
    static float buf[2 * 5 * 10 * 16];
    uly_tensor q, k, v;
    uly_qkv_views(buf, ULY_BF16, 2, 5, 6, 2, 16, &q, &k, &v);
    int64_t row = 5 * 10 * 16, tok = 10 * 16; /* [2, 5, 6 + 2*2, 16] */
    CHECK(q.data == (void *)buf && q.b == 2 && q.s == 5 && q.h == 6 && q.d == 16, "q shape");
    CHECK(k.data == (void *)((char *)buf + 6 * 16 * 2) && k.h == 2, "k starts after 6 q heads");
    CHECK(v.data == (void *)((char *)buf + 8 * 16 * 2) && v.h == 2, "v starts after the k heads");
    CHECK(q.sb == row && q.ss == tok && q.sh == 16 && k.sb == row && k.ss == tok && k.sh == 16 &&
              v.sb == row && v.ss == tok && v.sh == 16,
          "strides q %lld %lld %lld", (long long)q.sb, (long long)q.ss, (long long)q.sh);
    CHECK(q.dtype == ULY_BF16 && k.dtype == ULY_BF16 && v.dtype == ULY_BF16, "dtype");
    uly_tensor t = uly_dense(buf, ULY_F32, 3, 4, 5, 8);
    CHECK(t.sb == 160 && t.ss == 40 && t.sh == 8, "dense strides %lld %lld %lld", (long long)t.sb,
          (long long)t.ss, (long long)t.sh);
    uly_tensor hs = uly_head_slice(t, 2, 3);
    CHECK(hs.data == (void *)((char *)buf + 2 * 8 * 4) && hs.h == 3 && hs.sb == 160 &&
              hs.ss == 40 && hs.sh == 8 && hs.b == 3 && hs.s == 4 && hs.d == 8,
          "head slice");
    CHECK(uly_dtype_size(ULY_F32) == 4 && uly_dtype_size(ULY_BF16) == 2 &&
              uly_dtype_size(ULY_F16) == 2,
          "dtype sizes");
}

int main(void) { return uly_run_tests(); }
