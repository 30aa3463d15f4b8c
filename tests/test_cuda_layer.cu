/* test_cuda_layer.cu - the SP attention layer on the GPU: ulysses.h's driver with
   uly_cuda_layout, the device-local communicator (P virtual ranks on one GPU), and
   uly_cuda_reference_attention or uly_flash_attention.

   - The reference attention with Sq = Sk, forward and backward, agrees with uly_cpu_attention
     (fp32 within 2e-6 relative; bf16 and f16 on the same rounded inputs, within their
     rounding). In fp32 with Sq < Sk and Sq > Sk, causal or not, GQA (H = 4 over Hkv = 2),
     B = 2, a decode step (Sq = 1) and an explicit scale, and with a GQA group split at q_head0
     (causal, Sq > Sk): every value of out, lse, dq, dk and dv is within 2e-6 (absolute) of
     fp64 (flash_case.h's reference) and of uly_cpu_attention, and rows that keep no key
     (causal, Sq > Sk: the first Sq - Sk) give out and dq exactly 0 and lse = +inf. The same
     for a rank past the first GQA group and for more rows than one block takes; in bf16 and
     fp16 with each tensor's strides its own, against fp64. The backward refuses gradients of
     the wrong shape and a workspace a byte short.
   - The layer over P = 1..4 virtual ranks, forward and backward, in each dtype: out, lse and dq
     are bit-identical to the same attention run unsharded (the layer only moves data), and so
     are dk and dv, except that a kv head whose GQA group is split across ranks gets the ranks'
     shares of its gradient, each rounded to the dtype, summed in fp32 in rank order and rounded
     once: bit-identical to that (sp_cuda_case.h's summed_shares). In fp32 the layer agrees
     with the unsharded CPU reference within 2e-6 (relative: |got - want| / (1 + |want|)).
   - The layer with the flash kernel over P = 1..4, bf16 and f16, D = 64 and 128, causal or
     not, MHA, MQA and GQA groups split across ranks, B > 1: out and lse are bit-identical to
     uly_flash_attention run unsharded; so are dQ, in both dQ modes, and dK, dV where no group
     is split; where one is, they are the ranks' shares summed as the DKV unpack sums them, bit
     for bit. In atomic-dQ mode, against the CPU fp32 layer (uly_cpu_attention over
     uly_cpu_layout, the same inputs widened) and fp64 it meets test_flash's accuracy rule
     (split groups' dK, dV aside: their shares round to the dtype one by one). The same with packed
     documents (uly_flash_varlen_attention) that cross shard boundaries, against unsharded
     varlen flash and references that attend within each document.
   - Under the emulator, which records what each rank thread asks of the device: the flash
     layer's uly_forward and uly_backward queue everything on the caller's stream and allocate
     nothing.
   - The device-local communicator on its own: bytes land where the counts say, allreduce sums
     host memory (queuing nothing, once the stream is done) or device memory (given no stream,
     on the per-thread one), and mismatched counts are an error on every rank, not a hang;
     uly_layer_agree over it fails on every rank when one rank's layer is not causal.
   - Bad input to the layer is a named error.
   Builds under the CUDA emulator (make test) and with nvcc for a GPU (make test-gpu). */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "ref64.h"
#include "sp_case.h"
#include "flash_case.h"
#include "sp_cuda_case.h"

/* ---------------------------------------------------------------------------------------------
   The reference attention against uly_cpu_attention */

static void check_attention(sp_case c, uly_dtype t, double tol) {
    sp_full g = sp_alloc(&c, 42), cpu = sp_alloc(&c, 42);
    sp_full *both[2] = {&g, &cpu};
    for (int i = 0; i < 2; i++) { /* the same inputs, representable in t */
        round_all(both[i]->q, sp_nq(&c), t), round_all(both[i]->k, sp_nkv(&c), t);
        round_all(both[i]->v, sp_nkv(&c), t), round_all(both[i]->dout, sp_nq(&c), t);
    }
    uly_status st = gpu_attention(&c, t, &g, 1), cs = sp_cpu_reference(&c, &cpu);
    CHECK(!st.code && !cs.code, "gpu '%s', cpu '%s'", st.msg, cs.msg);
    double e[5] = {maxdiff(g.out, cpu.out, sp_nq(&c)), maxdiff(g.lse, cpu.lse, sp_nlse(&c)),
                   maxdiff(g.dq, cpu.dq, sp_nq(&c)), maxdiff(g.dk, cpu.dk, sp_nkv(&c)),
                   maxdiff(g.dv, cpu.dv, sp_nkv(&c))};
    for (int i = 0; i < 5; i++)
        CHECK(e[i] <= tol, "%s " SP_CASE_FMT ": %s differs by %g (tol %g)", dtype_name(t),
              SP_CASE_ARGS(&c), output_names[i], e[i], tol);
    sp_free(&g);
    sp_free(&cpu);
}

/* P, B, S, H, Hkv, D, causal, fused, scale */
TEST(reference_attention_matches_cpu_f32) {
    const sp_case cases[] = {{1, 2, 9, 4, 2, 8, 1, 0, 0},  {1, 1, 7, 3, 1, 16, 0, 0, 0},
                             {1, 2, 5, 2, 2, 4, 1, 0, 0.3f}, {1, 1, 33, 4, 4, 64, 1, 0, 0}};
    for (int i = 0; i < 4; i++) check_attention(cases[i], ULY_F32, 2e-6);
}

TEST(reference_attention_matches_cpu_bf16_f16) {
    const sp_case c = {1, 2, 9, 4, 2, 8, 1, 0, 0};
    check_attention(c, ULY_BF16, 1e-2); /* outputs rounded to 8 bits of mantissa */
    check_attention(c, ULY_F16, 2e-3);
}

/* ---------------------------------------------------------------------------------------------
   The reference attention where gpu_attention's Sq = Sk cannot reach: Sq != Sk and a group
   split at q_head0, against fp64 and uly_cpu_attention */

/* uly_cuda_reference_attention, forward and backward, in fp32 on case c's inputs. */
static run_out run_reference_f32(const fcase &c, const inputs &in) {
    const uly_dtype t = ULY_F32;
    const int64_t nq = c.B * c.Sq * c.H * c.D, nk = c.B * c.Sk * c.Hkv * c.D;
    void *q = to_dev(in.q.data(), nq, t), *k = to_dev(in.k.data(), nk, t);
    void *v = to_dev(in.v.data(), nk, t), *dout = to_dev(in.dout.data(), nq, t);
    void *o = to_dev(NULL, nq, t), *dq = to_dev(NULL, nq, t);
    void *dk = to_dev(NULL, nk, t), *dv = to_dev(NULL, nk, t);
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(q, t, c.B, c.Sq, c.H, c.D), a.o = uly_dense(o, t, c.B, c.Sq, c.H, c.D);
    a.dout = uly_dense(dout, t, c.B, c.Sq, c.H, c.D), a.dq = uly_dense(dq, t, c.B, c.Sq, c.H, c.D);
    a.k = uly_dense(k, t, c.B, c.Sk, c.Hkv, c.D), a.v = uly_dense(v, t, c.B, c.Sk, c.Hkv, c.D);
    a.dk = uly_dense(dk, t, c.B, c.Sk, c.Hkv, c.D), a.dv = uly_dense(dv, t, c.B, c.Sk, c.Hkv, c.D);
    run_out r;
    r.ok = run_kernels(c, dense_cu(c.B, c.Sq), dense_cu(c.B, c.Sk), false,
                       uly_cuda_reference_attention(), a, &r.lse);
    const auto back = [&](void *d, int64_t n) {
        fvec x((size_t)n);
        from_dev(x.data(), d, n, t);
        return x;
    };
    r.o = back(o, nq), r.dq = back(dq, nq), r.dk = back(dk, nk), r.dv = back(dv, nk);
    void *all[] = {q, k, v, dout, o, dq, dk, dv};
    for (void *x : all) cudaFree(x);
    return r;
}

/* The reference attention in fp32 on case c: every value of out, lse, dq, dk and dv within 2e-6
   of flash_case.h's fp64 reference and of uly_cpu_attention, and +inf only where they have it.
   Absolute: the values stay below 3, where 2e-6 is 8 fp32 ulps (the largest error seen is
   2.6e-7); a term missed or added in any sum is far more. Rows that keep no key exactly as the
   contract says. */
static void check_reference(const fcase &c) {
    char what[128];
    snprintf(what, sizeof what, "f32 B=%lld Sq=%lld Sk=%lld H=%lld Hkv=%lld D=%lld%s scale=%g "
             "q_head0=%lld", (long long)c.B, (long long)c.Sq, (long long)c.Sk, (long long)c.H,
             (long long)c.Hkv, (long long)c.D, c.causal ? " causal" : "", (double)c.scale,
             (long long)c.q_head0);
    const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    const run_out got = run_reference_f32(c, in);
    if (!got.ok) return;
    const outputs r64 = reference(c, dense_cu(c.B, c.Sq), dense_cu(c.B, c.Sk), false, in, false);
    const outputs cpu = run_cpu(c, in);
    const auto compare = [&](const outputs &want, const char *name) {
        const fvec *g[5] = {&got.o, &got.lse, &got.dq, &got.dk, &got.dv};
        const dvec *w[5] = {&want.o, &want.lse, &want.dq, &want.dk, &want.dv};
        for (int i = 0; i < 5; i++) {
            const double e = max_err(*g[i], *w[i]);
            CHECK(e <= 2e-6, "%s: %s differs from %s by %g", what, output_names[i], name, e);
        }
    };
    compare(r64, "fp64");
    compare(cpu, "uly_cpu_attention");
    /* causal with Sq > Sk: the first Sq - Sk rows of each sequence keep no key */
    const int bad = masked_rows_wrong(c, got, row_range(0, c.causal ? c.Sq - c.Sk : 0));
    CHECK(bad == 0, "%s: %d values of rows without keys are not out = dq = 0, lse = +inf", what,
          bad);
}

/* Sq < Sk and Sq > Sk (the first Sq - Sk rows of a causal one keep no key), causal or not; GQA
   (groups of 2) and B = 2 throughout; one decode step; an explicit scale. */
TEST(reference_attention_with_sq_ne_sk_matches_fp64_and_cpu) {
    const matrix_shape cases[] = { /* {B, Sq, Sk, H, Hkv, causal}, scale */
        {{2, 5, 12, 4, 2, 1}, 0},    {{2, 5, 12, 4, 2, 0}, 0}, {{2, 12, 5, 4, 2, 1}, 0},
        {{2, 12, 5, 4, 2, 0}, 0.3f}, {{2, 1, 9, 4, 2, 1}, 0}};
    for (const auto &k : cases) check_reference(make_case(k.s, 8, ULY_F32, k.scale));
}

/* Local query heads 0..2 are global heads 1..3 of groups of 2: they read local kv heads 0, 1, 1
   (global kv heads 0, 1, 1), as a rank whose first head splits a group does; so dk and dv of
   local kv head 0 come from one query head, of kv head 1 from two. */
TEST(reference_attention_maps_a_group_split_at_q_head0) {
    fcase c = make_case({2, 7, 5, 3, 2, 1}, 4, ULY_F32);
    c.q_head0 = 1, c.kv_group = 2;
    check_reference(c);
}

/* An SP rank past the first group: global query heads 3..6 in groups of 2 read global kv heads
   1, 2, 2, 3, i.e. local kv heads 0, 1, 1, 2 (q_head0 / kv_group = 1 is subtracted, in the
   forward's and the dK/dV kernel's maps alike); local kv heads 0 and 2 have one query head each,
   the first and the last of the slice, so their dk and dv sum over no head outside it. */
TEST(reference_attention_maps_a_rank_past_the_first_group) {
    fcase c = make_case({2, 9, 6, 4, 3, 1}, 4, ULY_F32);
    c.q_head0 = 3, c.kv_group = 2;
    check_reference(c);
}

/* More rows than one block's 64 threads take: the forward's and dQ's grids must cover the query
   rows, the dK/dV kernel's the key rows. 70 queries against 5 keys (causal: 65 rows keep no key)
   and 3 against 130. */
TEST(reference_attention_grids_cover_rows_past_one_block) {
    check_reference(make_case({1, 70, 5, 2, 1, 1}, 8, ULY_F32));
    check_reference(make_case({1, 3, 130, 2, 1, 1}, 8, ULY_F32));
}

/* Each of the eight tensors with its own strides (flash_case.h's OWN_STRIDES), in bf16
   and fp16: a kernel that steps one tensor with another's strides, or with a dense tensor's
   (sb = S ss, sh = D), reads padding (NaN) or other rows, or writes padding. Against fp64 by
   test_flash's accuracy rule (the reference rounds only its outputs); rows that keep no key
   exactly. */
TEST(reference_attention_every_tensor_has_its_own_strides) {
    fcase c[2] = {make_case({2, 20, 13, 4, 2, 1}, 16, ULY_BF16),
                  make_case({1, 11, 11, 4, 3, 0}, 8, ULY_F16)};
    c[1].q_head0 = 3, c[1].kv_group = 2;
    for (fcase &k : c) {
        k.strided = OWN_STRIDES;
        const inputs in = make_inputs(k, k.B * k.Sq, k.B * k.Sk);
        const std::vector<int> cq = dense_cu(k.B, k.Sq), ck = dense_cu(k.B, k.Sk);
        const run_out got = run_attn(k, cq, ck, false, in, uly_cuda_reference_attention());
        if (!got.ok) continue;
        check_outputs(k, got, reference(k, cq, ck, false, in, false),
                      reference(k, cq, ck, false, in, true), NULL);
        const int bad = masked_rows_wrong(k, got, row_range(0, k.causal ? k.Sq - k.Sk : 0));
        CHECK(bad == 0, "%s: %d values of rows without keys are not out = dq = 0, lse = +inf",
              describe(k).c_str(), bad);
    }
}

/* Args for the reference attention's checks: the eight views, lse and the workspace all over
   buf, which no check reads. */
static uly_attn_args views_over(float *buf, int64_t B, int64_t S, int64_t H, int64_t Hkv,
                                int64_t D) {
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_F32, B, S, H, D);
    a.k = a.v = a.dk = a.dv = uly_dense(buf, ULY_F32, B, S, Hkv, D);
    a.lse = buf, a.workspace = buf, a.workspace_bytes = INT64_MAX / 2;
    return a;
}

/* The backward checks what only it uses, before anything runs: a dq or dk whose shape is not
   q's or k's is EINVAL (the forward does not look at them), and so is a workspace a byte short
   of workspace() (its Dsum). The views are never read. */
TEST(reference_attention_backward_rejects_bad_gradients_and_a_short_workspace) {
    const uly_attn ref = uly_cuda_reference_attention();
    alignas(16) static float buf[64];
    for (int which = 0; which < 3; which++) {
        uly_attn_args a = views_over(buf, 1, 2, 1, 1, 8);
        if (which == 0) a.dq.s = 1;
        if (which == 1) a.dk.s = 1;
        if (which == 2) a.workspace_bytes = ref.workspace(ref.ctx, &a) - 1;
        const char *says = which == 0 ? "dq: shape" : which == 1 ? "dk: shape" : "workspace_bytes";
        const uly_status fwd = ref.check(ref.ctx, &a, 0), bwd = ref.check(ref.ctx, &a, 1);
        CHECK(!fwd.code && bwd.code == ULY_EINVAL && strstr(bwd.msg, says),
              "%s: forward '%s', backward code %d '%s'", says, fwd.msg, (int)bwd.code, bwd.msg);
    }
}

/* What the reference attention's grid (k.h is the dK/dV kernel's y) or its float workspace
   cannot take is an error before anything runs. The views are never read. */
/* The size query of each GPU attention here, given no args: -1 (as uly_attn says), no crash. */
TEST(gpu_attentions_size_no_workspace_for_null_args) {
    const uly_attn all[3] = {uly_cuda_reference_attention(), uly_flash_attention(),
                             uly_flash_varlen_attention(NULL)};
    for (int i = 0; i < 3; i++)
        CHECK(all[i].workspace(all[i].ctx, NULL) == -1, "attention %d: %lld", i,
              (long long)all[i].workspace(all[i].ctx, NULL));
}

TEST(reference_attention_rejects_65536_kv_heads_and_a_misaligned_workspace) {
    const uly_attn ref = uly_cuda_reference_attention();
    alignas(16) static float buf[16];
    uly_attn_args a = views_over(buf, 1, 1, 1, 65536, 8);
    a.kv_group = 1;
    uly_status st = ref.check(ref.ctx, &a, 1);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "k.h (65536) must be <= 65535"), "'%s'",
          st.msg);
    a.k = a.v = a.dk = a.dv = a.q;
    a.workspace = (char *)buf + 2;
    st = ref.bwd(ref.ctx, &a);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "not 4-byte aligned"), "'%s'", st.msg);
}

/* P, B, S, H, Hkv, D, causal, fused, scale */
static const sp_case layer_cases[] = {
    {1, 1, 5, 2, 2, 8, 0, 0, 0},     /* one rank: the layer is plain attention */
    {1, 2, 7, 4, 2, 8, 1, 1, 0},
    {2, 1, 16, 4, 4, 8, 1, 0, 0},    /* MHA, even split, B = 1 (no unpack) */
    {2, 1, 7, 3, 1, 8, 1, 1, 0},     /* MQA, uneven S and H, fused QKV */
    {3, 2, 17, 3, 3, 8, 1, 1, 0},    /* uneven S, B > 1 */
    {3, 2, 11, 6, 2, 8, 0, 0, 0},    /* g = 3: a GQA group split across ranks */
    {4, 2, 67, 8, 2, 16, 1, 1, 0},   /* Hkv < P: replicated kv heads, summed gradients */
    {4, 3, 31, 4, 1, 8, 1, 0, 0},    /* MQA, B = 3 */
    {4, 1, 9, 6, 3, 8, 1, 0, 0.3f},  /* H_r = 2, 2, 1, 1; explicit scale */
};
enum { NLAYER = sizeof layer_cases / sizeof *layer_cases };

TEST(layer_f32_matches_unsharded_and_cpu) {
    for (int i = 0; i < NLAYER; i++) check_layer(&layer_cases[i], ULY_F32, uly_cuda_local_run);
}

TEST(layer_bf16_matches_unsharded) {
    for (int i = 0; i < NLAYER; i++) check_layer(&layer_cases[i], ULY_BF16, uly_cuda_local_run);
}

TEST(layer_f16_matches_unsharded) {
    for (int i = 0; i < NLAYER; i++) check_layer(&layer_cases[i], ULY_F16, uly_cuda_local_run);
}

/* ---------------------------------------------------------------------------------------------
   The layer with the flash kernel

   The flash forward is one block per (batch, head, query block) and reads only its head's kv
   head, so giving each rank a slice of the heads cannot change a bit: out and lse equal
   uly_flash_attention run unsharded on the full tensors. So does dQ, since no sum of it crosses
   ranks. With atomics its fp32 sum over the backward's blocks of 128 keys runs in any order,
   but every case below has S <= 256: a row sums at most two blocks' partials onto zero, which
   commute (a case with S > 256 would need a bound instead). The backward sums dK and dV over
   the query heads of a GQA group in registers, in head order; when a group is split across
   ranks, each rank's share is rounded to the dtype and the DKV unpack sums the shares in fp32.
   summed_shares (sp_cuda_case.h) reproduces that bit for bit from a flash run per rank. (Not
   within an ulp of the unsharded value: each share rounds on its own scale, which makes up to
   3e4 ulps of the sum where the shares cancel, and can take the error past test_flash's
   accuracy rule.) Against the CPU fp32 reference layer (uly_cpu_attention over uly_cpu_layout,
   on the same inputs widened to fp32) and fp64, the layer meets the accuracy rule of
   test_flash (flash_case.h), split groups' dK and dV aside. */

/* Whether the query heads of some kv head live on more than one rank. */
static int kv_head_split(const sp_case *c) {
    uly_plan plan;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = d.sp_size = c->P, d.batch = c->B, d.seq_len = c->S, d.n_heads = c->H;
    d.n_kv_heads = c->Hkv, d.head_dim = c->D, d.dtype = ULY_BF16;
    if (uly_plan_init(&plan, &d).code) return 1;
    const int64_t g = c->H / c->Hkv;
    for (int r = 0; r < c->P; r++) {
        uly_range h = uly_heads(&plan, r);
        if (h.count && (h.start % g || (h.start + h.count) % g)) return 1;
    }
    return 0;
}

static fvec as_fvec(const float *x, int64_t n) { return fvec(x, x + n); }
static dvec as_dvec(const float *x, int64_t n) { return dvec(x, x + n); }

/* The layer with attention `attn` (flash, dense or varlen; in dQ mode `deterministic`) on c->P
   ranks of the device-local communicator, on f's inputs, its results into f; the first error of
   the run or of a rank. j: the ranks' record. */
static uly_status run_flash_layer(const sp_case *c, uly_dtype t, int deterministic,
                                  const uly_attn &attn, sp_full *f, job *j) {
    memset(j, 0, sizeof *j);
    j->c = c, j->t = t, j->f = f, j->attn = attn;
    j->deterministic = deterministic;
    uly_status st = uly_cuda_local_run(c->P, rank_main, j);
    for (int r = 0; r < c->P && !st.code; r++) st = j->st[r];
    return st;
}

/* f's inputs rounded to t, as the layer's device tensors hold them. */
static void round_inputs(const sp_case *c, sp_full *f, uly_dtype t) {
    round_all(f->q, sp_nq(c), t), round_all(f->k, sp_nkv(c), t);
    round_all(f->v, sp_nkv(c), t), round_all(f->dout, sp_nq(c), t);
}

/* Case c, unsharded, as flash_case.h describes an attention. */
static fcase flash_case_of(const sp_case *c, uly_dtype t, int deterministic) {
    fcase fc;
    memset(&fc, 0, sizeof fc);
    fc.B = c->B, fc.Sq = fc.Sk = c->S, fc.H = c->H, fc.Hkv = c->Hkv, fc.D = c->D;
    fc.causal = c->causal, fc.dt = t, fc.deterministic = deterministic;
    return fc;
}

static inputs inputs_of(const sp_case *c, const sp_full *f) {
    inputs in;
    in.q = as_fvec(f->q, sp_nq(c)), in.k = as_fvec(f->k, sp_nkv(c));
    in.v = as_fvec(f->v, sp_nkv(c)), in.dout = as_fvec(f->dout, sp_nq(c));
    return in;
}

/* Heads r of x, [B, S, H, D] in float: dense [B, S, r.count, D]. */
static fvec heads_of(const fvec &x, const sp_case *c, int64_t H, uly_range r) {
    fvec y((size_t)(c->B * c->S * r.count * c->D));
    const uly_tensor all = uly_dense((void *)x.data(), ULY_F32, c->B, c->S, H, c->D);
    sp_copy_tokens(uly_head_slice(all, r.start, r.count), y.data(), c->S, 0, 1);
    return y;
}

/* dk and dv of the flash layer where a group is split across ranks (summed_shares): a rank's
   share is unsharded flash over its query heads and kv heads, as the rank runs it (q_head0,
   kv_group), on in's values. */
static void flash_summed_shares(const sp_case *c, const fcase &fc, const std::vector<int> &cu,
                                bool varlen, const inputs &in, fvec &dk, fvec &dv) {
    dk.resize((size_t)sp_nkv(c)), dv.resize((size_t)sp_nkv(c));
    summed_shares(c, fc.dt, dk.data(), dv.data(),
                  [&](uly_range h, uly_range kv, float *share_k, float *share_v) {
                      fcase f = fc;
                      f.H = h.count, f.Hkv = kv.count;
                      f.q_head0 = h.start, f.kv_group = c->H / c->Hkv;
                      inputs part;
                      part.q = heads_of(in.q, c, c->H, h);
                      part.dout = heads_of(in.dout, c, c->H, h);
                      part.k = heads_of(in.k, c, c->Hkv, kv);
                      part.v = heads_of(in.v, c, c->Hkv, kv);
                      run_out r = run_attn(f, cu, cu, varlen, part, uly_flash_attention());
                      if (!r.ok) return;
                      /* r.dk, r.dv: [B, S, kv.count, D], into their heads of the shares */
                      const int64_t B = c->B, S = c->S, Hkv = c->Hkv, D = c->D;
                      const uly_tensor sk = uly_dense(share_k, ULY_F32, B, S, Hkv, D);
                      const uly_tensor sv = uly_dense(share_v, ULY_F32, B, S, Hkv, D);
                      sp_copy_tokens(uly_head_slice(sk, kv.start, kv.count), r.dk.data(), S, 0, 0);
                      sp_copy_tokens(uly_head_slice(sv, kv.start, kv.count), r.dv.data(), S, 0, 0);
                  });
}

/* The flash layer against unsharded flash, and the references. docs (B = 1 only): the
   cu_seqlens of packed documents over the full sequence, which the layer then attends within
   (uly_flash_varlen_attention); NULL for a dense batch. The CPU layer has no documents, so
   packed ones are checked against fp64 and plain references only. */
static void check_flash_layer(const sp_case *c, uly_dtype t, int deterministic,
                              const std::vector<int> *docs = NULL) {
    sp_full layer = sp_alloc(c, 11), cpu = sp_alloc(c, 11);
    round_inputs(c, &layer, t), round_inputs(c, &cpu, t);
    const std::vector<int> cu = docs ? *docs : dense_cu(c->B, c->S);
    int32_t *cu_dev = NULL;
    const uly_varlen vl = docs ? varlen_on_device(cu, cu, &cu_dev) : uly_varlen{};
    job j;
    uly_status st = run_flash_layer(c, t, deterministic,
                                    docs ? uly_flash_varlen_attention(&vl) : uly_flash_attention(),
                                    &layer, &j);
    uly_status cs = docs ? uly_status{} : sp_run_local(c, &cpu);
    CHECK(!st.code && !cs.code, "%s " SP_CASE_FMT ": flash layer '%s', cpu layer '%s'",
          dtype_name(t), SP_CASE_ARGS(c), st.msg, cs.msg);

    /* The same attention for flash_case.h: unsharded flash, fp64 and plain references. */
    const fcase fc = flash_case_of(c, t, deterministic);
    const inputs in = inputs_of(c, &layer);
    const run_out whole = run_attn(fc, cu, cu, docs, in, uly_flash_attention());
    const int split = kv_head_split(c);
    fvec dk = whole.dk, dv = whole.dv; /* what the layer's dk and dv must be */
    if (split && whole.ok) flash_summed_shares(c, fc, cu, docs, in, dk, dv);
    if (st.code || cs.code || !whole.ok) goto done;
    {
        const int64_t n[5] = {sp_nq(c), sp_nlse(c), sp_nq(c), sp_nkv(c), sp_nkv(c)};
        const float *got[5] = {layer.out, layer.lse, layer.dq, layer.dk, layer.dv};
        const float *want[5] = {whole.o.data(), whole.lse.data(), whole.dq.data(), dk.data(),
                                dv.data()};
        for (int i = 0; i < 5; i++) {
            const int64_t bits = ref_bitdiff(got[i], want[i], n[i]);
            CHECK(bits == 0, "%s%s " SP_CASE_FMT ": %s differs from %s in %lld values, by %g",
                  dtype_name(t), deterministic ? " deterministic" : "", SP_CASE_ARGS(c),
                  output_names[i], i >= 3 && split ? "the summed shares" : "unsharded flash",
                  (long long)bits, maxdiff(got[i], want[i], n[i]));
        }
    }
    if (!deterministic) { /* test_flash checks the deterministic kernels' accuracy */
        run_out got;
        got.ok = true;
        got.o = as_fvec(layer.out, sp_nq(c)), got.lse = as_fvec(layer.lse, sp_nlse(c));
        got.dq = as_fvec(layer.dq, sp_nq(c));
        /* A split group's dk, dv are the summed shares (above), not held to the rule. */
        got.dk = split ? whole.dk : as_fvec(layer.dk, sp_nkv(c));
        got.dv = split ? whole.dv : as_fvec(layer.dv, sp_nkv(c));
        outputs ref;
        ref.o = as_dvec(cpu.out, sp_nq(c)), ref.lse = as_dvec(cpu.lse, sp_nlse(c));
        ref.dq = as_dvec(cpu.dq, sp_nq(c)), ref.dk = as_dvec(cpu.dk, sp_nkv(c));
        ref.dv = as_dvec(cpu.dv, sp_nkv(c));
        const outputs r64 = reference(fc, cu, cu, docs, in, false);
        const outputs low = reference(fc, cu, cu, docs, in, true);
        check_outputs(fc, got, r64, low, docs ? NULL : &ref);
    }
done:
    cudaFree(cu_dev);
    sp_free(&layer), sp_free(&cpu);
}

/* P, B, S, H, Hkv, D, causal, fused, scale (0: flash_case.h's references take 1/sqrt(D)).
   S <= 256, for dQ with atomics to be bitwise (above). */
static const sp_case flash_cases[] = {
    {1, 2, 64, 2, 1, 64, 1, 0, 0},    /* one rank, MQA, B = 2 */
    {2, 1, 129, 4, 2, 128, 0, 1, 0},  /* uneven S, fused QKV, each group on one rank */
    {2, 2, 100, 4, 4, 64, 1, 0, 0},   /* MHA, B = 2 */
    {3, 2, 77, 6, 2, 64, 1, 1, 0},    /* g = 3 over H_r = 2: a group split across ranks */
    {3, 1, 150, 3, 3, 128, 1, 0, 0},  /* one head per rank */
    {4, 2, 67, 6, 2, 64, 1, 0, 0},    /* H_r = 2, 2, 1, 1: both groups split */
    {4, 1, 200, 8, 2, 128, 0, 1, 0},  /* Hkv < P: replicated kv heads, summed gradients */
    {4, 2, 64, 4, 4, 128, 1, 1, 0},   /* MHA, one head per rank, B = 2 */
};

/* Every case in both dQ modes, one mode per dtype (in bf16 the odd cases are deterministic,
   in f16 the even ones): a mode changes the dQ kernel and a dtype the element type of the same
   kernels, so the two matrices run each pair of case and mode once. */
static void flash_matrix(uly_dtype t) {
    const int n = (int)(sizeof flash_cases / sizeof flash_cases[0]);
    for (int i = 0; i < n; i++) check_flash_layer(&flash_cases[i], t, i % 2 == (t == ULY_BF16));
}

/* uly_cuda_layer: the CUDA layout and the flash kernels, the given plan, comm and stream, and
   every other field zero (not causal, default scale, no workspace, no hooks). */
TEST(cuda_layer_defaults_to_the_flash_kernels) {
    uly_plan plan;
    uly_comm comm;
    int stream;
    memset(&plan, 0, sizeof plan), memset(&comm, 0, sizeof comm);
    const uly_layer L = uly_cuda_layer(&plan, &comm, &stream);
    const uly_attn fa = uly_flash_attention();
    const uly_layout cl = uly_cuda_layout();
    CHECK(L.attn.fwd == fa.fwd && L.attn.bwd == fa.bwd && L.attn.workspace == fa.workspace &&
              L.attn.ctx == fa.ctx, "attn is not uly_flash_attention()");
    CHECK(L.layout.pack == cl.pack && L.layout.unpack == cl.unpack && L.layout.ctx == cl.ctx,
          "layout is not uly_cuda_layout()");
    CHECK(L.plan == &plan && L.comm == &comm && L.stream == &stream, "plan, comm or stream");
    CHECK(L.softmax_scale == 0 && !L.causal && !L.deterministic && !L.workspace &&
              !L.workspace_bytes && !L.on_phase && !L.phase_user,
          "scale %g, causal %d, deterministic %d, workspace %p (%lld bytes), on_phase %s",
          (double)L.softmax_scale, L.causal, L.deterministic, L.workspace,
          (long long)L.workspace_bytes, L.on_phase || L.phase_user ? "set" : "NULL");
}

TEST(flash_layer_bf16_matches_unsharded_flash_and_cpu_layer) { flash_matrix(ULY_BF16); }
TEST(flash_layer_f16_matches_unsharded_flash_and_cpu_layer) { flash_matrix(ULY_F16); }

/* Packed documents (uly_flash_varlen_attention) through the layer: documents of one token, of
   several tiles, and ones that cross shard boundaries (P = 3 over S = 150 shards at 50 and
   100; P = 4 over 200 at 50, 100, 150); causal or not; a GQA group split across ranks. The
   same checks as the dense layer, the references attending within each document. */
TEST(flash_layer_attends_within_packed_documents) {
    const sp_case cases[] = {{3, 1, 150, 6, 2, 64, 1, 1, 0}, {4, 1, 200, 4, 4, 128, 0, 0, 0},
                             {2, 1, 130, 4, 1, 64, 1, 0, 0}};
    const std::vector<int> docs[] = {{0, 1, 49, 51, 150}, {0, 130, 131, 200},
                                     {0, 64, 65, 66, 130}};
    for (int i = 0; i < 3; i++)
        check_flash_layer(&cases[i], i == 1 ? ULY_F16 : ULY_BF16, i == 2, &docs[i]);
}

/* Split groups through the matrices' check, at sizes ThreadSanitizer runs (make test): MQA over
   4 ranks (four shares of each dK, dV value) in bf16, g = 3 over H_r = 2 (two shares) in f16. */
TEST(flash_layer_split_group_gradients_are_the_summed_shares) {
    const sp_case mqa = {4, 1, 40, 4, 1, 64, 1, 0, 0}, gqa = {3, 1, 33, 6, 2, 64, 0, 1, 0};
    check_flash_layer(&mqa, ULY_BF16, 0);
    check_flash_layer(&gqa, ULY_F16, 1);
}

#ifdef ULY_EMU
/* ---------------------------------------------------------------------------------------------
   What the layer asks of the device (the emulator's record, tests/emu/cuda_emu.h)

   The flash layer (uly_cuda_layer's default attention) over the device-local communicator, in
   both dQ modes, on a GQA group split across 3 ranks (so the DKV unpack sums). Each rank makes
   its stream and buffers before its calls; gpu_run_rank records only its uly_forward and
   uly_backward. */

/* f(rank's record, what) for every rank of the run in each dQ mode. */
template <typename F> static void each_recorded_rank(F f) {
    const sp_case c = {3, 1, 40, 6, 2, 64, 1, 1, 0};
    for (int deterministic = 0; deterministic < 2; deterministic++) {
        sp_full layer = sp_alloc(&c, 17);
        round_inputs(&c, &layer, ULY_BF16);
        job j;
        const uly_status st =
            run_flash_layer(&c, ULY_BF16, deterministic, uly_flash_attention(), &layer, &j);
        CHECK(!st.code, "%s", st.msg);
        char what[64];
        for (int r = 0; r < c.P; r++) {
            snprintf(what, sizeof what, "rank %d, %s dQ", r,
                     deterministic ? "deterministic" : "atomic");
            f(j.calls[r], what);
        }
        sp_free(&layer);
    }
}

TEST(layer_queues_only_on_the_callers_stream) {
    each_recorded_rank([](const rank_calls &k, const char *what) {
        CHECK(k.ops > 0 && !k.off_stream, "%s: %lld operations queued, %s not on the layer's "
              "stream", what, (long long)k.ops, k.off_stream ? k.off_stream : "none");
    });
}

TEST(layer_allocates_nothing) {
    each_recorded_rank([](const rank_calls &k, const char *what) {
        CHECK(k.allocs == 0, "%s: %llu allocations in uly_forward and uly_backward", what,
              k.allocs);
    });
}
#endif

/* ---------------------------------------------------------------------------------------------
   The device-local communicator on its own */

typedef struct comm_job {
    int mismatch;        /* rank 1 expects one byte too many from rank 0 */
    uly_status st[4], sum[4];
    double got[4][4];    /* allreduce results: host memory, then device memory twice */
    int64_t queued[4];   /* ops the host-memory allreduce queued; those of the device-memory one
                            without a stream that went elsewhere than the per-thread stream */
    int64_t wrong[4];    /* received bytes that are not what the sender wrote */
} comm_job;

/* The stream operations this thread queued since the last call, less those on *except (NULL:
   all count); 0 on a GPU, where nothing records them. */
static int64_t queued_since(const cudaStream_t *except) {
#ifdef ULY_EMU
    int64_t n = 0;
    for (const uly_emu_op &op : uly_emu_recorded_ops()) n += !except || op.stream != *except;
    uly_emu_record_reset();
    return n;
#else
    (void)except;
    return 0;
#endif
}

static void comm_main(const uly_comm *c, void *user) {
    comm_job *j = (comm_job *)user;
    const int P = c->size, r = c->rank;
    int64_t sc[4], so[4], rc[4], ro[4];
    unsigned char *send, *recv, host[64];
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&send, 64);
    cudaMalloc((void **)&recv, 64);
    /* Rank i sends i + j + 1 bytes of value 16 i + j to rank j, blocks in peer order. */
    for (int q = 0, at = 0, from = 0; q < P; q++) {
        sc[q] = r + q + 1, so[q] = at, at += (int)sc[q];
        rc[q] = q + r + 1 + (j->mismatch && r == 1 && q == 0), ro[q] = from, from += (int)rc[q];
        memset(host + so[q], 16 * r + q, (size_t)sc[q]);
    }
    cudaMemcpy(send, host, 64, cudaMemcpyHostToDevice);
    j->st[r] = c->alltoallv(c->ctx, send, sc, so, recv, rc, ro, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, recv, 64, cudaMemcpyDeviceToHost);
    for (int q = 0; q < P && !j->mismatch; q++)
        for (int64_t b = 0; b < rc[q]; b++) j->wrong[r] += host[ro[q] + b] != 16 * q + r;

    /* Host memory needs no stream; device memory, given none, takes the per-thread one. */
    double h[2] = {1.0 + r, 0.5}, *dev;
    const cudaStream_t per_thread = cudaStreamPerThread;
    queued_since(NULL);
    j->sum[r] = c->allreduce_sum(c->ctx, h, 2, NULL);
    j->queued[r] = queued_since(NULL);
    cudaMalloc((void **)&dev, sizeof(double));
    double x = 10.0 * r;
    cudaMemcpy(dev, &x, sizeof x, cudaMemcpyHostToDevice);
    if (!j->sum[r].code) j->sum[r] = c->allreduce_sum(c->ctx, dev, 1, s);
    cudaMemcpy(&x, dev, sizeof x, cudaMemcpyDeviceToHost);
    j->got[r][0] = h[0], j->got[r][1] = h[1], j->got[r][2] = x;
    queued_since(NULL);
    if (!j->sum[r].code) j->sum[r] = c->allreduce_sum(c->ctx, dev, 1, NULL);
    j->queued[r] += queued_since(&per_thread);
    cudaMemcpy(&x, dev, sizeof x, cudaMemcpyDeviceToHost);
    j->got[r][3] = x;
    cudaFree(dev), cudaFree(send), cudaFree(recv);
    cudaStreamDestroy(s);
}

TEST(device_local_alltoallv_and_allreduce) {
    const comm_job j = run_job<comm_job>(uly_cuda_local_run, 4, comm_main);
    for (int r = 0; r < 4; r++) {
        CHECK(!j.st[r].code && !j.wrong[r], "rank %d: '%s', %lld wrong bytes", r, j.st[r].msg,
              (long long)j.wrong[r]);
        CHECK(!j.sum[r].code && j.got[r][0] == 10 && j.got[r][1] == 2 && j.got[r][2] == 60 &&
                  j.got[r][3] == 240 && j.queued[r] == 0,
              "rank %d: '%s', sums %g %g %g %g, want 10 2 60 240; %lld ops queued off the "
              "per-thread stream", r, j.sum[r].msg, j.got[r][0], j.got[r][1], j.got[r][2],
              j.got[r][3], (long long)j.queued[r]);
    }
}

/* Host memory given a stream is summed once the stream is done, so a value copied there on the
   stream is what every rank gets (under the emulator the stream first sleeps 50 ms, so a sum
   that did not wait would add the zeros there before the copy). */
typedef struct pinned_job {
    uly_status st[4];
    double got[4];
} pinned_job;

static void pinned_main(const uly_comm *c, void *user) {
    pinned_job *j = (pinned_job *)user;
    const int r = c->rank;
    const double x = 1.0 + r;
    cudaStream_t s;
    double *dev, *pin;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&dev, sizeof x);
    cudaMallocHost((void **)&pin, sizeof x);
    cudaMemcpy(dev, &x, sizeof x, cudaMemcpyHostToDevice);
    *pin = 0;
#ifdef ULY_EMU
    sleep_on_stream(s, 50);
#endif
    cudaMemcpyAsync(pin, dev, sizeof x, cudaMemcpyDeviceToHost, s);
    j->st[r] = c->allreduce_sum(c->ctx, pin, 1, s);
    j->got[r] = *pin;
    cudaFree(dev), cudaFreeHost(pin);
    cudaStreamDestroy(s);
}

TEST(device_local_allreduce_of_host_memory_waits_for_the_stream) {
    const pinned_job j = run_job<pinned_job>(uly_cuda_local_run, 4, pinned_main);
    for (int r = 0; r < 4; r++)
        CHECK(!j.st[r].code && j.got[r] == 10, "rank %d: '%s', sum %g, want 1+2+3+4", r,
              j.st[r].msg, j.got[r]);
}

#ifdef ULY_EMU
/* alltoallv is ordered on the streams both ways: the copies wait for what each sender queued
   before the call (its send buffer is filled on its stream after a sleep), and what a sender
   queues after the call (a memset over its send buffer) waits for every peer's copies (rank 1's
   stream sleeps longer, so its copies run last). */
typedef struct order_job {
    int64_t wrong[4];
    uly_status st[4];
} order_job;

static void order_main(const uly_comm *c, void *user) {
    order_job *j = (order_job *)user;
    const int P = c->size, r = c->rank;
    int64_t cnt[4], off[4];
    unsigned char host[16], *stage, *send, *recv;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&stage, 16), cudaMalloc((void **)&send, 16), cudaMalloc((void **)&recv, 16);
    for (int q = 0; q < P; q++) cnt[q] = 4, off[q] = 4 * q, memset(host + 4 * q, 16 * r + q, 4);
    cudaMemcpy(stage, host, 16, cudaMemcpyHostToDevice);
    cudaMemset(send, 0, 16), cudaMemset(recv, 0, 16);
    sleep_on_stream(s, r == 1 ? 100 : 20);
    cudaMemcpyAsync(send, stage, 16, cudaMemcpyDeviceToDevice, s);
    j->st[r] = c->alltoallv(c->ctx, send, cnt, off, recv, cnt, off, s);
    cudaMemsetAsync(send, 0xee, 16, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, recv, 16, cudaMemcpyDeviceToHost);
    for (int q = 0; q < P; q++)
        for (int b = 0; b < 4; b++) j->wrong[r] += host[4 * q + b] != 16 * q + r;
    cudaFree(stage), cudaFree(send), cudaFree(recv);
    cudaStreamDestroy(s);
}

TEST(device_local_alltoallv_is_ordered_on_the_streams_both_ways) {
    const order_job j = run_job<order_job>(uly_cuda_local_run, 4, order_main);
    for (int r = 0; r < 4; r++)
        CHECK(!j.st[r].code && !j.wrong[r], "rank %d: '%s', %lld of 16 bytes wrong", r,
              j.st[r].msg, (long long)j.wrong[r]);
}
#endif

TEST(device_local_count_mismatch_is_an_error_not_a_hang) {
    comm_job j;
    memset(&j, 0, sizeof j);
    j.mismatch = 1;
    uly_status st = uly_cuda_local_run(4, comm_main, &j);
    CHECK(!st.code, "%s", st.msg);
    CHECK(j.st[1].code == ULY_ECOMM && strstr(j.st[1].msg, "rank 0 sends 2 bytes to rank 1"),
          "rank 1: '%s'", j.st[1].msg);
    for (int r = 0; r < 4; r++)
        CHECK(r == 1 || (j.st[r].code == ULY_ECOMM && strstr(j.st[r].msg, "do not match")),
              "rank %d: '%s'", r, j.st[r].msg);
}

/* ---------------------------------------------------------------------------------------------
   Bad input to the layer */

typedef struct bad_job {
    int comm_size_of_plan; /* the plan's sp_size */
    int null_workspace, wrong_shape;
    int packed_batch;      /* packed documents (flash varlen) with B = 2 */
    uly_status st[4];
} bad_job;

static void bad_main(const uly_comm *comm, void *user) {
    bad_job *j = (bad_job *)user;
    const int P = j->comm_size_of_plan;
    const int64_t B = j->packed_batch ? 2 : 1, D = j->packed_batch ? 64 : 8;
    const sp_case c = {P, B, 8, 4, 4, D, 0, 0, 0}; /* B, S, H, Hkv, D */
    uly_plan plan;
    uly_status st = sp_plan(&c, P, comm->rank % P, ULY_BF16, &plan);
    if (st.code) {
        j->st[comm->rank] = st;
        return;
    }
    uly_layer L;
    memset(&L, 0, sizeof L);
    L.plan = &plan, L.comm = comm;
    void *saved, *buf;
    cudaMalloc(&buf, 4096);
    const int32_t *cu = (const int32_t *)buf; /* never read: the layer refuses first */
    const uly_varlen docs = {cu, cu, 1, 8, 8};
    L.attn = j->packed_batch ? uly_flash_varlen_attention(&docs) : uly_cuda_reference_attention();
    L.layout = uly_cuda_layout();
    L.workspace_bytes = uly_layer_workspace(&L);
    cudaMalloc(&L.workspace, (size_t)L.workspace_bytes);
    const int64_t nsaved = uly_saved_bytes(&plan);
    cudaMalloc(&saved, (size_t)nsaved);
    int64_t Sr = uly_tokens(&plan, plan.sp_rank).count - j->wrong_shape;
    uly_tensor q = uly_dense(buf, ULY_BF16, B, Sr, 4, D);
    void *ws = L.workspace;
    if (j->null_workspace) L.workspace = NULL;
    j->st[comm->rank] = uly_forward(&L, q, q, q, q, saved, nsaved);
    cudaFree(ws), cudaFree(saved), cudaFree(buf);
}

static void check_bad(bad_job j, const char *words) {
    uly_status st = uly_cuda_local_run(2, bad_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++)
        CHECK(j.st[r].code == ULY_EINVAL && strstr(j.st[r].msg, words), "rank %d: '%s', want '%s'",
              r, j.st[r].msg, words);
}

TEST(layer_rejects_a_communicator_of_the_wrong_size) {
    bad_job j;
    memset(&j, 0, sizeof j);
    j.comm_size_of_plan = 1;
    check_bad(j, "of 2, the plan's sp rank 0 of 1");
}

TEST(layer_rejects_tensors_the_plan_does_not_describe) {
    bad_job j;
    memset(&j, 0, sizeof j);
    j.comm_size_of_plan = 2, j.wrong_shape = 1;
    check_bad(j, "q: shape [1, 3, 4, 8], want [1, 4, 4, 8]");
}

TEST(layer_rejects_a_null_workspace) {
    bad_job j;
    memset(&j, 0, sizeof j);
    j.comm_size_of_plan = 2, j.null_workspace = 1;
    check_bad(j, "layer.workspace is NULL");
}

/* Packed documents span the one sequence of a batch of 1. */
TEST(layer_rejects_packed_documents_in_a_batch) {
    bad_job j;
    memset(&j, 0, sizeof j);
    j.comm_size_of_plan = 2, j.packed_batch = 1;
    check_bad(j, "varlen: q.b must be 1");
}

/* Device memory past one 64-value chunk, read and written on the stream given: every value of
   all 150 summed (rank r holds (r + 1) * (i + 1) at i, so the sum is 10 * (i + 1)). The values
   are copied into dev on the stream (under the emulator after a 50 ms sleep), so a sum whose
   copies ran on another stream would add the zeros there and leave dev to the late copy. */
typedef struct many_job {
    uly_status st[4];
    int64_t wrong[4];
} many_job;

static void many_main(const uly_comm *c, void *user) {
    many_job *j = (many_job *)user;
    enum { N = 150 };
    const int r = c->rank;
    double h[N], *dev, *stage;
    cudaStream_t s;
    cudaStreamCreate(&s);
    for (int i = 0; i < N; i++) h[i] = (r + 1.0) * (i + 1);
    cudaMalloc((void **)&dev, sizeof h), cudaMalloc((void **)&stage, sizeof h);
    cudaMemcpy(stage, h, sizeof h, cudaMemcpyHostToDevice);
    cudaMemset(dev, 0, sizeof h);
#ifdef ULY_EMU
    sleep_on_stream(s, 50);
#endif
    cudaMemcpyAsync(dev, stage, sizeof h, cudaMemcpyDeviceToDevice, s);
    j->st[r] = c->allreduce_sum(c->ctx, dev, N, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(h, dev, sizeof h, cudaMemcpyDeviceToHost);
    for (int i = 0; i < N; i++) j->wrong[r] += h[i] != 10.0 * (i + 1);
    cudaFree(dev), cudaFree(stage);
    cudaStreamDestroy(s);
}

TEST(device_local_allreduce_of_device_memory_past_one_chunk_follows_the_stream) {
    const many_job j = run_job<many_job>(uly_cuda_local_run, 4, many_main);
    for (int r = 0; r < 4; r++)
        CHECK(!j.st[r].code && !j.wrong[r], "rank %d: '%s', %lld of 150 sums wrong", r,
              j.st[r].msg, (long long)j.wrong[r]);
}

/* A rank whose own arguments are bad (a NULL send buffer with bytes for its peers) offers its
   peers nothing: it gets EINVAL, they ECOMM (no copy from its NULL buffer), and none hangs. */
typedef struct badargs_job {
    uly_status st[4];
} badargs_job;

static void badargs_main(const uly_comm *c, void *user) {
    badargs_job *j = (badargs_job *)user;
    const int P = c->size, r = c->rank;
    int64_t cnt[4], off[4];
    unsigned char *send, *recv;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&send, 64);
    cudaMalloc((void **)&recv, 64);
    cudaMemset(recv, 0, 64);
    for (int q = 0; q < P; q++) cnt[q] = 4, off[q] = 4 * q;
    j->st[r] = c->alltoallv(c->ctx, r == 0 ? NULL : send, cnt, off, recv, cnt, off, s);
    cudaStreamSynchronize(s);
    cudaFree(send), cudaFree(recv);
    cudaStreamDestroy(s);
}

TEST(device_local_bad_arguments_on_one_rank_fail_every_rank) {
    const badargs_job j = run_job<badargs_job>(uly_cuda_local_run, 4, badargs_main);
    CHECK(j.st[0].code == ULY_EINVAL && strstr(j.st[0].msg, "send is NULL"), "rank 0: '%s'",
          j.st[0].msg);
    for (int r = 1; r < 4; r++)
        CHECK(j.st[r].code == ULY_ECOMM && strstr(j.st[r].msg, "rank 0 failed"),
              "rank %d: '%s'", r, j.st[r].msg);
}

#ifdef ULY_EMU
/* A CUDA call of alltoallv that fails on rank 2 (uly_emu_fail_call) fails the call there, and
   on every peer that may have read rank 2's buffers unordered: without its ready event rank 2
   offers nothing (no peer copies its block), a failed wait copies nothing, and a failed copy or
   done record stops every peer. Each time the next call on every rank moves every byte. */
typedef struct xfail_job {
    const char *call; /* rank 2's failing call, its nth */
    int nth;
    uly_status st[4], next[4];
    int64_t from2[4];  /* bytes of rank 2's block the failed call wrote */
    int64_t copied[4]; /* bytes the failed call wrote */
    int64_t wrong[4];  /* bytes the next call got wrong */
} xfail_job;

/* Rank r sends 4 bytes of 16 r + q to rank q; recv starts as 0xee, which no block holds. */
static void xfail_main(const uly_comm *c, void *user) {
    xfail_job *j = (xfail_job *)user;
    const int P = c->size, r = c->rank;
    int64_t cnt[4], off[4];
    unsigned char host[16], *send, *recv;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&send, 16), cudaMalloc((void **)&recv, 16);
    for (int q = 0; q < P; q++) cnt[q] = 4, off[q] = 4 * q, memset(host + 4 * q, 16 * r + q, 4);
    cudaMemcpy(send, host, 16, cudaMemcpyHostToDevice);
    for (int pass = 0; pass < 2; pass++) {
        cudaMemset(recv, 0xee, 16);
        if (r == 2 && !pass) uly_emu_fail_call(j->call, j->nth, cudaErrorInvalidResourceHandle);
        (pass ? j->next : j->st)[r] = c->alltoallv(c->ctx, send, cnt, off, recv, cnt, off, s);
        uly_emu_fail_call(nullptr, 0, cudaSuccess);
        cudaStreamSynchronize(s);
        cudaMemcpy(host, recv, 16, cudaMemcpyDeviceToHost);
        for (int b = 0; b < 16; b++) {
            if (pass) j->wrong[r] += host[b] != 16 * (b / 4) + r;
            else j->copied[r] += host[b] != 0xee, j->from2[r] += b / 4 == 2 && host[b] != 0xee;
        }
    }
    cudaFree(send), cudaFree(recv);
    cudaStreamDestroy(s);
}

TEST(device_local_alltoallv_fails_every_rank_a_failed_call_leaves_unordered) {
    static const struct {
        const char *call;
        int nth;
        const char *others_say; /* NULL: the peers' exchanges are whole and ordered */
        int copies;             /* rank 2 copies any block */
    } cases[] = {
        {"cudaEventRecord", 1, "rank 2 failed", 0},          /* ready */
        {"cudaStreamWaitEvent", 1, "1 rank(s) failed", 0},   /* for rank 0's ready */
        {"cudaMemcpyAsync", 2, "1 rank(s) failed", 1},       /* rank 1's block */
        {"cudaEventRecord", 2, "1 rank(s) failed", 1},       /* done */
        {"cudaStreamWaitEvent", 5, NULL, 1},                 /* for rank 0's done */
    };
    for (const auto &k : cases) {
        xfail_job j;
        memset(&j, 0, sizeof j);
        j.call = k.call, j.nth = k.nth;
        const uly_status st = uly_cuda_local_run(4, xfail_main, &j);
        CHECK(!st.code, "%s %d: %s", k.call, k.nth, st.msg);
        CHECK(j.st[2].code == ULY_ECUDA && strstr(j.st[2].msg, "device-local alltoallv"),
              "%s %d: rank 2: '%s'", k.call, k.nth, j.st[2].msg);
        CHECK(!j.copied[2] == !k.copies, "%s %d: rank 2 wrote %lld bytes", k.call, k.nth,
              (long long)j.copied[2]);
        for (int r = 0; r < 4; r++) {
            const bool ok = r != 2 && !k.others_say;
            CHECK(r == 2 || (ok ? !j.st[r].code && j.copied[r] == 16
                                : j.st[r].code == ULY_ECOMM && strstr(j.st[r].msg, k.others_say)),
                  "%s %d: rank %d: '%s', %lld bytes copied", k.call, k.nth, r, j.st[r].msg,
                  (long long)j.copied[r]);
            CHECK(k.nth != 1 || strcmp(k.call, "cudaEventRecord") || !j.from2[r],
                  "%s %d: rank %d copied %lld bytes from rank 2, whose stream it could not wait "
                  "for", k.call, k.nth, r, (long long)j.from2[r]);
            CHECK(!j.next[r].code && !j.wrong[r], "%s %d: rank %d, the next call: '%s', %lld "
                  "bytes wrong", k.call, k.nth, r, j.next[r].msg, (long long)j.wrong[r]);
        }
    }
}
#endif

/* allreduce_sum fails every rank alike, so that none pairs the failed call with its peers'
   next one (and of nothing, NULL everywhere, succeeds); each time the next call, 1 value on
   every rank, sums right. */
typedef struct sum_job {
    int64_t n[4];  /* each rank's count (-1: a bad argument) */
    int null_buf;  /* the ranks (bits) that pass buf NULL */
    int host_buf;  /* the ranks (bits) that pass host memory */
    int fail_copy; /* the rank whose copies fail (-1: none) */
    uly_status st[4], next[4];
    double got[4];
} sum_job;

static void sum_main(const uly_comm *c, void *user) {
    sum_job *j = (sum_job *)user;
    const int r = c->rank;
    double h[100], *dev;
    cudaStream_t s;
    cudaStreamCreate(&s);
    for (int i = 0; i < 100; i++) h[i] = 1.0 + r;
    cudaMalloc((void **)&dev, sizeof h);
    cudaMemcpy(dev, h, sizeof h, cudaMemcpyHostToDevice);
#ifdef ULY_EMU
    if (r == j->fail_copy) uly_emu_fail_call("cudaMemcpyAsync", 1, cudaErrorInvalidValue);
#endif
    double *buf = j->null_buf >> r & 1 ? NULL : j->host_buf >> r & 1 ? h : dev;
    j->st[r] = c->allreduce_sum(c->ctx, buf, j->n[r], s);
    j->next[r] = c->allreduce_sum(c->ctx, dev, 1, s);
    cudaMemcpy(&j->got[r], dev, sizeof(double), cudaMemcpyDeviceToHost);
    cudaFree(dev);
    cudaStreamDestroy(s);
}

TEST(device_local_allreduce_fails_every_rank_alike) {
    static const struct {
        const char *what;
        int64_t n[4];
        int null_buf, host_buf, fail_copy, bad; /* bad -1: every rank succeeds */
        uly_code code;
        const char *bad_says, *others_say;
    } cases[] = {
        {"counts 64, 64, 100, 64 (one chunk in common)", {64, 64, 100, 64}, 0, 0, -1, 2,
         ULY_ECOMM, "rank 0 sums 64 values, rank 2 100", "rank 2 sums 100 values"},
        {"n = -1 on rank 0", {-1, 3, 3, 3}, 0, 0, -1, 0, ULY_EINVAL, "n (-1) must be >= 0",
         "rank 0 failed"},
        {"buf NULL with 3 values on rank 0", {3, 3, 3, 3}, 1, 0, -1, 0, ULY_EINVAL,
         "buf not NULL", "rank 0 failed"},
        /* 65: device memory's first round (64 values and a flag) is host memory's one round */
        {"rank 1's 65 values in host memory", {65, 65, 65, 65}, 0, 2, -1, 1, ULY_ECOMM,
         "rank 0 sums values in device memory, rank 1 in host memory",
         "rank 1 sums values in host memory"},
        {"nothing to sum, buf NULL everywhere", {0, 0, 0, 0}, 15, 0, -1, -1, ULY_OK, "", ""},
#ifdef ULY_EMU
        {"rank 1's copy fails", {100, 100, 100, 100}, 0, 0, 1, 1, ULY_ECUDA,
         "device-local allreduce_sum", "1 rank(s) could not copy their values"},
#endif
    };
    for (const auto &k : cases) {
        sum_job j;
        memset(&j, 0, sizeof j);
        memcpy(j.n, k.n, sizeof j.n);
        j.null_buf = k.null_buf, j.host_buf = k.host_buf, j.fail_copy = k.fail_copy;
        const uly_status st = uly_cuda_local_run(4, sum_main, &j);
        CHECK(!st.code, "%s: %s", k.what, st.msg);
        for (int r = 0; r < 4; r++) {
            const char *says = r == k.bad ? k.bad_says : k.others_say;
            const uly_code want = k.bad < 0 ? ULY_OK : r == k.bad ? k.code : ULY_ECOMM;
            CHECK(j.st[r].code == want && strstr(j.st[r].msg, says),
                  "%s: rank %d: code %d '%s', want '%s'", k.what, r, (int)j.st[r].code,
                  j.st[r].msg, says);
            CHECK(!j.next[r].code && j.got[r] == 10, "%s: rank %d, the next call: '%s', sum %g",
                  k.what, r, j.next[r].msg, j.got[r]);
        }
    }
}

static void count_rank(const uly_comm *c, void *user) {
    (void)c;
    __atomic_fetch_add((int *)user, 1, __ATOMIC_RELAXED);
}

/* From 1 to ULY_MAX_SP virtual ranks, each of which runs fn once; anything else runs nothing. */
TEST(device_local_run_takes_1_to_ULY_MAX_SP_ranks) {
    int ran = 0;
    uly_status st = uly_cuda_local_run(ULY_MAX_SP, count_rank, &ran);
    CHECK(!st.code && ran == ULY_MAX_SP, "%d ranks: '%s', %d ran", ULY_MAX_SP, st.msg, ran);
    for (int size : {0, -1, ULY_MAX_SP + 1}) {
        ran = 0;
        st = uly_cuda_local_run(size, count_rank, &ran);
        CHECK(st.code == ULY_EINVAL && strstr(st.msg, "uly_cuda_local_run: size") && !ran,
              "%d ranks: code %d '%s', %d ran", size, (int)st.code, st.msg, ran);
    }
    st = uly_cuda_local_run(2, NULL, NULL);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "fn is NULL"), "fn NULL: '%s'", st.msg);
}

#ifdef ULY_EMU

/* uly_cuda_local_run runs the rank function on every rank or on none: where cudaSetDevice fails
   on one rank (or all), none runs it (its peers would wait for it in their first collective)
   and the call returns that rank's error; with the device back, all run. */
TEST(device_local_run_runs_every_rank_or_none) {
    for (int failures : {1, 3}) {
        int ran = 0;
        uly_emu_fail_set_device(failures);
        const uly_status st = uly_cuda_local_run(3, count_rank, &ran);
        CHECK(st.code == ULY_ECUDA && !strncmp(st.msg, "uly_cuda_local_run: ", 20) &&
                  strstr(st.msg, "cudaSetDevice") && ran == 0,
              "%d failing: '%s', %d ranks ran", failures, st.msg, ran);
    }
    uly_emu_fail_set_device(0);
    int ran = 0;
    const uly_status st = uly_cuda_local_run(3, count_rank, &ran);
    CHECK(!st.code && ran == 3, "'%s', %d ranks ran", st.msg, ran);
}
#endif

/* sp_cuda_case.h's barrier check, as test_nccl runs it for NCCL's. */
TEST(device_local_barrier_holds_every_rank_until_all_arrive) {
    check_barrier(uly_cuda_local_run);
}

/* sp_cuda_case.h's, as test_nccl runs it for NCCL's. */
TEST(device_local_layer_agree_fails_on_every_rank_when_one_is_not_causal) {
    check_agree(uly_cuda_local_run);
}

/* The other two grid dims: 65536 batches (the grid's z) or 65536 query heads (its y) are
   EUNSUPPORTED before anything runs, forward and backward. The views are never read. */
TEST(reference_attention_rejects_65536_batches_or_query_heads) {
    const uly_attn ref = uly_cuda_reference_attention();
    alignas(16) static float buf[16];
    for (int which = 0; which < 2; which++)
        for (int backward = 0; backward < 2; backward++) {
            const uly_attn_args a = views_over(buf, which ? 1 : 65536, 1, which ? 65536 : 1, 1, 8);
            const uly_status st = ref.check(ref.ctx, &a, backward);
            CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "must be <= 65535"),
                  "%s, %s: code %d '%s'", which ? "q.h 65536" : "q.b 65536",
                  backward ? "backward" : "forward", (int)st.code, st.msg);
        }
}

/* Rows of more than 256 elements (the kernels' fp32 accumulators) are EUNSUPPORTED. */
TEST(reference_attention_rejects_a_head_dim_past_256) {
    const uly_attn ref = uly_cuda_reference_attention();
    alignas(16) static float buf[16];
    for (int backward = 0; backward < 2; backward++) {
        const uly_attn_args a = views_over(buf, 1, 1, 1, 1, 257);
        const uly_status st = ref.check(ref.ctx, &a, backward);
        CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "q.d (257) > 256"), "%s: code %d '%s'",
              backward ? "backward" : "forward", (int)st.code, st.msg);
    }
}

int main(void) { return uly_run_tests(); }
