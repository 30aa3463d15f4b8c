/* test_edges.c - the edges of ulysses.h's rules, each pinned by a test: a bound, an overflow, an
   overlap, a check the layer makes before it exchanges, a sum order. Each one was found by
   mutation testing: moving the edge by one (or dropping the check) passed every other test.
   Expected values come from the rules as documented (sizes by hand, sums in the order the
   communicator promises), not from the code. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"

static uly_plan plan_of(int P, int rank, int64_t B, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                        uly_dtype t, int64_t max_bytes, uly_status *st) {
    uly_plan p;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    memset(&p, 0, sizeof p);
    d.world_size = P, d.rank = rank, d.sp_size = P, d.batch = B, d.seq_len = S, d.n_heads = H;
    d.n_kv_heads = Hkv, d.head_dim = D, d.dtype = t, d.max_bytes = max_bytes;
    *st = uly_plan_init(&p, &d);
    return p;
}
static int has(uly_status st, const char *w) { return strstr(st.msg, w) != NULL; }

/* ---- plan ---- */
TEST(ranges_of_rank_P_are_empty) {
    uly_status st;
    uly_plan p = plan_of(2, 0, 1, 7, 4, 2, 4, ULY_F32, 0, &st);
    uly_range t = uly_tokens(&p, 2), h = uly_heads(&p, 2), kv = uly_kv_heads(&p, 2);
    CHECK(!st.code && !t.start && !t.count && !h.start && !h.count && !kv.count,
          "rank P: tokens [%lld,+%lld) heads [%lld,+%lld)", (long long)t.start,
          (long long)t.count, (long long)h.start, (long long)h.count);
}
TEST(a_plan_whose_dp_rank_was_edited_is_refused) {
    uly_status st;
    uly_plan p = plan_of(2, 0, 1, 8, 4, 2, 4, ULY_F32, 0, &st);
    int64_t c[4][ULY_MAX_SP];
    p.dp_rank = 5;
    CHECK(uly_exchange_counts(&p, ULY_X_Q, c[0], c[1], c[2], c[3]).code == ULY_EINVAL, "accepted");
}
/* The other fields uly_plan_init derives: an edited one would size and index every buffer
   by another rank's tokens, another GQA group or another element size. */
TEST(a_plan_whose_sp_rank_group_or_elem_size_was_edited_is_refused) {
    static const char *const what[3] = {"sp_rank 0 -> 1", "group 2 -> 1", "elem_size 2 -> 4"};
    for (int edit = 0; edit < 3; edit++) {
        uly_status st;
        uly_plan p = plan_of(2, 0, 1, 8, 4, 2, 4, ULY_BF16, 0, &st);
        int64_t c[4][ULY_MAX_SP];
        if (edit == 0) p.sp_rank = 1;
        else if (edit == 1) p.group = 1;
        else p.elem_size = 4;
        CHECK(!st.code && uly_exchange_counts(&p, ULY_X_KV, c[0], c[1], c[2], c[3]).code ==
                              ULY_EINVAL && uly_saved_bytes(&p) == 0 &&
                  uly_kv_heads(&p, 0).count == 0,
              "%s accepted", what[edit]);
    }
}
/* A shape that overflows is refused on every rank of the world, in every DP group: world 4 =
   2 SP groups of 2; fused 2e17 x 9 x 4 bytes fits int64, the workspace does not. */
TEST(plan_init_refuses_an_overflowing_shape_in_every_dp_group_alike) {
    for (int r = 0; r < 4; r++) {
        uly_plan_desc d = {.world_size = 4, .rank = r, .sp_size = 2, .batch = 1,
                           .seq_len = 200000000000000000, .n_heads = 3, .head_dim = 1};
        uly_plan p;
        uly_status st = uly_plan_init(&p, &d);
        CHECK(st.code == ULY_EOVERFLOW, "rank %d (dp %d): %s", r, r / 2,
              st.code ? st.msg : "accepted");
    }
}
/* A plan filled in by hand, desc and made alike, whose fused buffer overflows int64. */
TEST(a_plan_never_made_whose_buffers_overflow_is_refused) {
    uly_plan p;
    int64_t c[4][ULY_MAX_SP];
    memset(&p, 0, sizeof p);
    p.desc.world_size = p.desc.sp_size = 1, p.desc.batch = 1, p.desc.seq_len = (int64_t)1 << 60;
    p.desc.n_heads = p.desc.n_kv_heads = 1, p.desc.head_dim = 16, p.desc.dtype = ULY_F32;
    p.made = p.desc, p.group = 1, p.elem_size = 4;
    CHECK(uly_exchange_counts(&p, ULY_X_Q, c[0], c[1], c[2], c[3]).code == ULY_EINVAL &&
              uly_saved_bytes(&p) == 0 && uly_tokens(&p, 0).count == 0,
          "S 2^60, D 16 accepted");
}
TEST(max_bytes_is_checked_against_rank_0s_block_when_S_and_H_are_uneven) {
    /* P 2, S 5, H 3: rank 0 has 3 tokens and 2 heads: 3 x 2 x D 4 x 4 bytes = 96 */
    uly_status st;
    plan_of(2, 0, 1, 5, 3, 3, 4, ULY_F32, 95, &st);
    CHECK(st.code == ULY_EOVERFLOW, "max_bytes 95: %s", st.msg);
    plan_of(2, 0, 1, 5, 3, 3, 4, ULY_F32, 96, &st);
    CHECK(st.code == ULY_OK, "max_bytes 96: %s", st.msg);
}
TEST(a_plan_whose_workspace_overflows_is_refused) {
    /* fused 12 S and saved ~20 S bytes fit int64, the layer scratch ~24 S does not */
    uly_status st;
    plan_of(1, 0, 1, INT64_MAX / 22, 1, 1, 1, ULY_F32, 0, &st);
    CHECK(st.code == ULY_EOVERFLOW, "accepted: %s", st.msg);
}
TEST(size_helpers_keep_overflow_sticky_and_exact_at_the_boundary) {
    CHECK(uly__add(-1, 5) == -1 && uly__add(5, -1) == -1 && uly__mul(-1, 0) == -1 &&
              uly__mul(0, -1) == -1,
          "add %lld %lld mul %lld %lld", (long long)uly__add(-1, 5), (long long)uly__add(5, -1),
          (long long)uly__mul(-1, 0), (long long)uly__mul(0, -1));
    CHECK(uly__add(INT64_MAX - 5, 5) == INT64_MAX && uly__add(INT64_MAX - 4, 5) == -1,
          "add %lld %lld", (long long)uly__add(INT64_MAX - 5, 5),
          (long long)uly__add(INT64_MAX - 4, 5));
    CHECK(uly__mul(2, INT64_MAX / 2) == INT64_MAX - 1, "mul %lld",
          (long long)uly__mul(2, INT64_MAX / 2));
    static float x[8];
    uly_tensor t = uly_dense(x, ULY_F32, 3, 1, 1, 4);
    t.sb = (int64_t)1 << 62; /* (b - 1) * sb overflows */
    CHECK(uly__check_view("q", t).code == ULY_EOVERFLOW, "view spanning 2^63 elements");
}
TEST(exchange_counts_reject_the_first_value_past_DKV) {
    uly_status st;
    uly_plan p = plan_of(2, 0, 1, 8, 4, 2, 4, ULY_F32, 0, &st);
    int64_t c[4][ULY_MAX_SP];
    CHECK(uly_exchange_counts(&p, (uly_xchg)(ULY_X_DKV + 1), c[0], c[1], c[2], c[3]).code ==
              ULY_EINVAL, "x = 4 accepted");
}
TEST(head_slice_one_past_the_end_has_no_data) {
    static float x[4 * 4];
    uly_tensor t = uly_dense(x, ULY_F32, 1, 1, 4, 4);
    CHECK(uly_head_slice(t, 3, 2).data == NULL, "heads [3, 5) of 4");
}
TEST(head_slice_of_no_heads_in_range_keeps_its_place) {
    static float x[4 * 4];
    uly_tensor t = uly_dense(x, ULY_F32, 1, 1, 4, 4);
    CHECK(uly_head_slice(t, 4, 0).data == x + 16 && uly_head_slice(t, 1, 0).data == x + 4,
          "heads [4, 4) at %p, [1, 1) at %p; want %p, %p", uly_head_slice(t, 4, 0).data,
          uly_head_slice(t, 1, 0).data, (void *)(x + 16), (void *)(x + 4));
}

/* ---- CPU layout ---- */
TEST(pack_of_a_tensor_whose_heads_are_not_contiguous) {
    uly_status st;
    uly_plan p = plan_of(1, 0, 1, 2, 2, 2, 2, ULY_F32, 0, &st);
    float src[2 * 2 * 4], send[8]; /* [S 2][H 2][4], d 2 of each 4 */
    for (int i = 0; i < 16; i++) src[i] = (float)i;
    uly_tensor t = uly_dense(src, ULY_F32, 1, 2, 2, 2);
    t.sh = 4, t.ss = 8, t.sb = 16;
    uly_layout l = uly_cpu_layout();
    st = l.pack(l.ctx, &p, ULY_X_Q, t, send, NULL);
    const float want[8] = {0, 1, 4, 5, 8, 9, 12, 13};
    CHECK(!st.code && !memcmp(send, want, sizeof want), "%s: send %g %g %g %g", st.msg, send[0],
          send[1], send[2], send[3]);
}
TEST(dkv_unpack_copies_a_head_only_one_peer_holds_bit_for_bit) {
    /* P 4, H 6, Hkv 3: kv head 0 only on rank 0, 1 only on rank 1, 2 on ranks 2 and 3 */
    uly_status st;
    uly_plan p = plan_of(4, 0, 1, 4, 6, 3, 2, ULY_BF16, 0, &st);
    uint16_t recv[64], dst[1 * 1 * 3 * 2];
    for (int i = 0; i < 64; i++) recv[i] = 0xffc1; /* a NaN with sign and payload, as CUDA copies */
    uly_layout l = uly_cpu_layout();
    st = l.unpack(l.ctx, &p, ULY_X_DKV, recv, uly_dense(dst, ULY_BF16, 1, 1, 3, 2), NULL);
    CHECK(!st.code && dst[0] == 0xffc1 && dst[3] == 0xffc1, "%s: %04x %04x", st.msg, dst[0],
          dst[3]);
}

/* ---- overlap checks ---- */
TEST(share_and_meet_at_their_boundaries) {
    static float b[64];
    CHECK(uly__meet(b, 4, (char *)b + 3, 4), "one byte in common");
    uly_tensor x = uly_dense(b, ULY_F32, 1, 2, 2, 4), y = uly_dense(b + 15, ULY_F32, 1, 1, 1, 4);
    CHECK(uly__share(x, y), "y starts on x's last element");
    uly_tensor g = uly_dense(b, ULY_F32, 1, 1, 2, 2), g5, g1; /* rows [0, 2), [6, 8) */
    g.sh = 6, g.ss = g.sb = 12;
    g5 = g, g5.data = b + 5, g1 = g, g1.data = b + 1;
    CHECK(uly__share(g, g5), "moved by 5 meets row [6, 8)");
    CHECK(uly__share(g, g1), "moved by 1 meets row [0, 2)");
    uly_tensor dk = uly_dense(b, ULY_F32, 2, 1, 1, 1), dq; /* elements 0, 3 */
    dk.sb = 3, dk.ss = 2, dk.sh = 1;
    dq = dk, dq.h = 2, dq.data = b + 2; /* elements 2, 3, 5, 6 */
    CHECK(uly__share(dk, dq), "an s-slice after dk with more heads meets it at 3");
    uly_tensor k2 = uly_dense(b, ULY_F32, 1, 2, 2, 1), q4; /* elements 0, 2, 7, 9 */
    k2.sb = 14, k2.ss = 7, k2.sh = 2;
    q4 = k2, q4.h = 4, q4.data = b + 1; /* 1, 3, 5, 7, ... */
    CHECK(uly__share(k2, q4), "moved into the gaps but with more heads, meets at 7");
    uly_tensor z = uly_dense(b, ULY_F32, 1, 2, 2, 1), z1; /* rows 0, 3, 5, 8: ss < h x sh */
    z.sh = 3, z.ss = 5, z.sb = 10;
    z1 = z, z1.data = b + 1; /* rows 1, 4, 6, 9 */
    CHECK(uly__share(z, z1), "moved into the gaps of a view whose ss < h x sh: apart, but counted "
          "as sharing (uly_forward's rule)");
    uly_tensor w = uly_dense(b, ULY_F32, 2, 1, 2, 2), w5; /* rows at 0, 2, 8, 10 */
    w.sb = 8, w.ss = 4, w.sh = 2;
    w5 = w, w5.data = b + 5; /* rows at 5, 7, 13, 15: its first row's second element is 8 */
    CHECK(uly__share(w, w5), "moved by 5, not a multiple of any stride, meets at element 8");
    uly_tensor all = uly_dense(b, ULY_F32, 1, 2, 2, 2), one;
    all.ss = 6, all.sb = 12;
    one = all, one.h = 1, one.sh = 99, one.data = b + 4; /* head 2 of [S][3][D]; sh unused */
    CHECK(!uly__share(all, one), "the next head, whose unused sh differs, is apart");
}

static uly_status stub(const char *m) {
    uly_status st;
    memset(&st, 0, sizeof st);
    st.code = ULY_ECOMM;
    snprintf(st.msg, sizeof st.msg, "%s", m);
    return st;
}

/* ---- layer driver (the checks before an exchange are test_errors') ---- */
static int phases[64], nphases; /* 2 * phase + end, as on_phase reports them */
static void record_phase(void *u, uly_phase ph, int end) {
    (void)u;
    if (nphases < 64) phases[nphases++] = 2 * (int)ph + end;
}
/* The CPU attention's forward, noting whether its arguments carried any gradient view. */
static int fwd_saw_grads;
static uly_status fwd_seeing_grads(void *ctx, const uly_attn_args *a) {
    const uly_tensor *g[4] = {&a->dout, &a->dq, &a->dk, &a->dv};
    for (int i = 0; i < 4; i++)
        fwd_saw_grads |= g[i]->data || g[i]->b || g[i]->s || g[i]->h || g[i]->d || g[i]->sb ||
                         g[i]->ss || g[i]->sh || g[i]->dtype;
    return uly_cpu_attention().fwd(ctx, a);
}
static void b1_forward(const uly_comm *c, void *u) {
    uly_status st;
    uly_plan p = plan_of(1, 0, 1, 4, 2, 2, 4, ULY_F32, 0, &st);
    uly_layer L;
    static float x[4 * 4 * 2 * 4];
    memset(&L, 0, sizeof L);
    L.plan = &p, L.comm = c, L.attn = uly_cpu_attention(), L.layout = uly_cpu_layout();
    L.attn.fwd = fwd_seeing_grads, L.on_phase = record_phase;
    L.workspace_bytes = uly_layer_workspace(&L), L.workspace = malloc((size_t)L.workspace_bytes);
    void *saved = malloc((size_t)uly_saved_bytes(&p));
    *(uly_status *)u =
        uly_forward(&L, uly_dense(x, ULY_F32, 1, 4, 2, 4), uly_dense(x + 32, ULY_F32, 1, 4, 2, 4),
                    uly_dense(x + 64, ULY_F32, 1, 4, 2, 4), uly_dense(x + 96, ULY_F32, 1, 4, 2, 4),
                    saved, uly_saved_bytes(&p));
    free(saved), free(L.workspace);
}
static int first_difference(const int *a, const int *b, int n) {
    int i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* Each phase as a begin and an end, in the order of the layer's steps. */
TEST(with_B_1_the_head_layout_side_of_each_exchange_is_not_copied) {
    enum { P0 = 2 * ULY_PHASE_PACK, X0 = 2 * ULY_PHASE_EXCHANGE, A0 = 2 * ULY_PHASE_ATTN,
           U0 = 2 * ULY_PHASE_UNPACK };
    static const int want[] = {P0, P0 + 1, X0, X0 + 1,  /* Q: packed, received in place */
                               P0, P0 + 1, X0, X0 + 1,  /* K */
                               P0, P0 + 1, X0, X0 + 1,  /* V */
                               A0, A0 + 1,              /* attention */
                               X0, X0 + 1, U0, U0 + 1}; /* O: sent in place, unpacked */
    enum { NWANT = sizeof want / sizeof *want };
    uly_status st = stub("not run");
    nphases = 0;
    uly_local_run(1, b1_forward, &st);
    CHECK(!st.code && nphases == NWANT && !memcmp(phases, want, sizeof want),
          "%s: %d phase calls, want %d; first difference at %d", st.msg, nphases, (int)NWANT,
          first_difference(phases, want, nphases < NWANT ? nphases : NWANT));
}

/* uly_attn_args promises a forward's attention all-zero gradient views. */
TEST(a_forward_attention_gets_no_gradient_views) {
    uly_status st = stub("not run");
    fwd_saw_grads = 0;
    uly_local_run(1, b1_forward, &st);
    CHECK(!st.code && !fwd_saw_grads, "%s: gradient views %s", st.msg,
          fwd_saw_grads ? "set" : "zero");
}

/* The optional alltoall carries each exchange whose blocks all have one size on every rank,
   and only those. P 3, S 6, H 6 (2 tokens, 2 query heads a rank): Q and O always; with Hkv 3
   (g 2) every rank needs 1 kv head, so KV and DKV too; with Hkv 2 (g 3) ranks need 1, 2, 1
   kv heads (query heads 2, 3 read kv heads 0, 1), so K, V, dK, dV go by alltoallv. Per rank,
   forward and backward: 8 calls, or 4. The wrapper moves alltoall's blocks with the local
   alltoallv, so a wrong choice also moves wrong bytes. */
typedef struct a2a_wrap {
    const uly_comm *inner;
    int calls;
} a2a_wrap;
static uly_status wrap_a2av(void *ctx, const void *s, const int64_t *sc, const int64_t *so,
                            void *r, const int64_t *rc, const int64_t *ro, void *stream) {
    const uly_comm *in = ((a2a_wrap *)ctx)->inner;
    return in->alltoallv(in->ctx, s, sc, so, r, rc, ro, stream);
}
static uly_status wrap_a2a(void *ctx, const void *s, void *r, int64_t bytes, void *stream) {
    a2a_wrap *w = (a2a_wrap *)ctx;
    int64_t n[ULY_MAX_SP], at[ULY_MAX_SP];
    w->calls++;
    for (int j = 0; j < w->inner->size; j++) n[j] = bytes, at[j] = j * bytes;
    return wrap_a2av(ctx, s, n, at, r, n, at, stream);
}
typedef struct a2a_job {
    int64_t Hkv;
    int calls[3];
    uly_status st[3];
} a2a_job;
static void a2a_rank(const uly_comm *c, void *user) {
    a2a_job *job = (a2a_job *)user;
    const int64_t B = 1, Sr = 2, H = 6, Hkv = job->Hkv, D = 4;
    uly_status st;
    uly_plan p = plan_of(3, c->rank, B, 3 * Sr, H, Hkv, D, ULY_F32, 0, &st);
    a2a_wrap w = {c, 0};
    uly_comm comm = *c;
    comm.ctx = &w, comm.alltoallv = wrap_a2av, comm.alltoall = wrap_a2a;
    uly_layer L;
    memset(&L, 0, sizeof L);
    L.plan = &p, L.comm = &comm, L.attn = uly_cpu_attention(), L.layout = uly_cpu_layout();
    L.causal = 1;
    L.workspace_bytes = uly_layer_workspace(&L);
    L.workspace = malloc((size_t)L.workspace_bytes);
    const int64_t ns = uly_saved_bytes(&p);
    void *saved = malloc((size_t)ns);
    float *buf[8]; /* q, k, v, out, dout, dq, dk, dv: zeros, each room for [B, Sr, H, D] */
    for (int i = 0; i < 8; i++) buf[i] = (float *)calloc((size_t)(B * Sr * H * D), sizeof(float));
    uly_tensor t[8];
    for (int i = 0; i < 8; i++)
        t[i] = uly_dense(buf[i], ULY_F32, B, Sr, i == 1 || i == 2 || i >= 6 ? Hkv : H, D);
    uly_tensor q = t[0], k = t[1], v = t[2], o = t[3], dout = t[4], dq = t[5], dk = t[6], dv = t[7];
    if (!st.code) st = uly_forward(&L, q, k, v, o, saved, ns);
    if (!st.code) st = uly_backward(&L, dout, saved, ns, dq, dk, dv);
    job->st[c->rank] = st, job->calls[c->rank] = w.calls;
    for (int i = 0; i < 8; i++) free(buf[i]);
    free(saved), free(L.workspace);
}
TEST(alltoall_carries_exactly_the_exchanges_whose_blocks_are_uniform_kv_ones_included) {
    for (int64_t Hkv = 2; Hkv <= 3; Hkv++) {
        a2a_job job;
        memset(&job, 0, sizeof job);
        job.Hkv = Hkv;
        uly_local_run(3, a2a_rank, &job);
        for (int r = 0; r < 3; r++)
            CHECK(!job.st[r].code && job.calls[r] == (Hkv == 3 ? 8 : 4),
                  "Hkv %lld rank %d: %s; alltoall called %d times, want %d", (long long)Hkv, r,
                  job.st[r].msg, job.calls[r], Hkv == 3 ? 8 : 4);
    }
}

/* ---- attention ---- */
TEST(attention_of_scores_beyond_expf_range_is_finite) {
    static float q[2 * 8], k[2 * 8], v[2 * 8], o[2 * 8], lse[2];
    for (int i = 0; i < 16; i++) q[i] = k[i] = 10, v[i] = (float)(i / 8); /* scores 283 */
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(q, ULY_F32, 1, 2, 1, 8), a.k = uly_dense(k, ULY_F32, 1, 2, 1, 8);
    a.v = uly_dense(v, ULY_F32, 1, 2, 1, 8), a.o = uly_dense(o, ULY_F32, 1, 2, 1, 8);
    a.lse = lse;
    uly_attn at = uly_cpu_attention();
    a.workspace_bytes = at.workspace(at.ctx, &a), a.workspace = malloc((size_t)a.workspace_bytes);
    uly_status st = at.fwd(at.ctx, &a);
    CHECK(!st.code && o[0] == 0.5f && isfinite(lse[0]), "%s: o %g lse %g", st.msg, o[0], lse[0]);
    for (int i = 0; i < 16; i++) k[i] = -10; /* every score -283: exp underflows without the max */
    st = at.fwd(at.ctx, &a);
    CHECK(!st.code && o[0] == 0.5f && isfinite(lse[0]), "%s: o %g lse %g", st.msg, o[0], lse[0]);
    a.workspace_bytes -= 1;
    CHECK(at.fwd(at.ctx, &a).code == ULY_EINVAL, "workspace one byte short accepted");
    free(a.workspace);
}
TEST(attn_check_rejects_a_last_head_that_reads_kv_head_k_h) {
    static float x[2 * 8], lse[2];
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(x, ULY_F32, 1, 1, 2, 8), a.o = a.q;
    a.k = uly_dense(x, ULY_F32, 1, 1, 1, 8), a.v = a.k;
    a.lse = lse, a.kv_group = 1; /* head 1 reads kv head 1 of 1 */
    CHECK(uly_attn_check(&a, 0).code == ULY_EINVAL, "accepted");
}

/* ---- loss ---- */
TEST(cross_entropy_label_minus_one_a_large_logit_and_n_v_overflow) {
    float x[3] = {0, 1000, 0}, dx[3];
    int32_t lab[1] = {-1}, one[1] = {1}, bad[1] = {-7};
    double sum = 0;
    int64_t n = 0;
    CHECK(uly_cross_entropy(x, lab, 1, 3, -100, &sum, &n, NULL).code == ULY_EINVAL, "label -1");
    uly_status st = uly_cross_entropy(x, one, 1, 3, -100, &sum, &n, dx);
    CHECK(!st.code && sum == 0 && n == 1 && dx[1] == 0, "%s: loss %g dx %g", st.msg, sum, dx[1]);
    st = uly_cross_entropy(x, bad, (int64_t)1 << 40, (int64_t)1 << 30, -100, &sum, &n, NULL);
    CHECK(st.code == ULY_EOVERFLOW, "n x v = 2^70: %s", st.msg);
}
static int ar_calls;
static uly_status s_ar(void *c, double *b, int64_t n, void *s) {
    (void)c, (void)b, (void)n, (void)s;
    ar_calls++;
    return stub("allreduce");
}
TEST(loss_reduce_rejects_a_negative_count) {
    uly_comm c;
    double mean, scale;
    memset(&c, 0, sizeof c);
    c.size = 1, c.allreduce_sum = s_ar, ar_calls = 0;
    CHECK(uly_loss_reduce(&c, 1, -1, &mean, &scale).code == ULY_EINVAL && !ar_calls, "accepted");
}
TEST(positions_up_to_2_pow_31_fit_int32_and_one_more_does_not) {
    uly_status st;
    uly_plan p = plan_of(256, 255, 1, (int64_t)1 << 31, 256, 256, 8, ULY_BF16, 0, &st);
    int32_t *pos = (int32_t *)malloc(((size_t)1 << 23) * sizeof *pos + 64);
    st = uly_positions(&p, pos);
    CHECK(!st.code && pos[(1 << 23) - 1] == INT32_MAX, "S = 2^31: %s", st.msg);
    p = plan_of(256, 255, 1, ((int64_t)1 << 31) + 1, 256, 256, 8, ULY_BF16, 0, &st);
    CHECK(uly_positions(&p, pos).code == ULY_EOVERFLOW, "S = 2^31 + 1 accepted");
    free(pos);
}

/* ---- local communicator ---- */
static void ar_order(const uly_comm *c, void *u) {
    double x[1] = {c->rank == 0 ? 1 : c->rank == 1 ? 1e17 : -1e17};
    uly_status st = c->allreduce_sum(c->ctx, x, 1, NULL);
    ((double *)u)[c->rank] = st.code ? -1 : x[0];
}
TEST(local_allreduce_adds_in_rank_order) {
    double got[3];
    uly_local_run(3, ar_order, got);
    CHECK(got[0] == 0 && got[1] == 0 && got[2] == 0, "(1 + 1e17) - 1e17: %g %g %g", got[0],
          got[1], got[2]);
}
typedef struct bad_call { uly_status st[2]; } bad_call;
static void a2a_mismatch(const uly_comm *c, void *u) {
    char s[16] = {0}, r[16];
    int64_t sc[2] = {4, 4}, so[2] = {0, 4}, rc[2] = {4, c->rank ? 8 : 4}, ro[2] = {0, 8};
    ((bad_call *)u)->st[c->rank] = c->alltoallv(c->ctx, s, sc, so, r, rc, ro, NULL);
}
static void ar_mismatch(const uly_comm *c, void *u) {
    double x[4] = {0};
    ((bad_call *)u)->st[c->rank] = c->allreduce_sum(c->ctx, x, c->rank ? 4 : 2, NULL);
}
static void send_null(const uly_comm *c, void *u) {
    char r[8];
    int64_t z = 0, four = 4;
    ((bad_call *)u)->st[0] = c->alltoallv(c->ctx, NULL, &four, &z, r, &four, &z, NULL);
}
static void send_off_neg(const uly_comm *c, void *u) {
    char s[8] = {0}, r[8];
    int64_t z = 0, four = 4, neg = -1;
    ((bad_call *)u)->st[1] = c->alltoallv(c->ctx, s + 1, &four, &neg, r, &four, &z, NULL);
}
TEST(local_comm_rejects_mismatched_and_invalid_calls) {
    bad_call b;
    memset(&b, 0, sizeof b);
    uly_local_run(2, a2a_mismatch, &b);
    CHECK(b.st[0].code == ULY_ECOMM && b.st[1].code == ULY_ECOMM, "counts: %s", b.st[0].msg);
    memset(&b, 0, sizeof b);
    uly_local_run(2, ar_mismatch, &b);
    CHECK(b.st[0].code == ULY_ECOMM && b.st[1].code == ULY_ECOMM, "n: %s", b.st[0].msg);
    memset(&b, 0, sizeof b);
    uly_local_run(1, send_null, &b);
    uly_local_run(1, send_off_neg, &b);
    CHECK(b.st[0].code == ULY_EINVAL && has(b.st[0], "send is NULL"), "%s", b.st[0].msg);
    CHECK(b.st[1].code == ULY_EINVAL, "offset -1: %s", b.st[1].msg);
}

int main(void) { return uly_run_tests(); }
