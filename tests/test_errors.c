/* test_errors.c - bad input is an error value with a specific code and a message that names the
   field, never a crash, an abort or a truncated size. Each table row is one invalid call: what
   it breaks, the code it must return and a word its message must contain. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"
#include "attn_call.h"

/* A message is a NUL-terminated string within uly_status.msg that contains `field` and starts
   with the name of the function called, fn, once ("uly_forward: ..."); the functions of a
   layer's parts (fn NULL) leave that to their caller. A success has no message. */
static void check_status(const char *fn, uly_status st, uly_code code, const char *field,
                         const char *what) {
    const int terminated = memchr(st.msg, 0, sizeof st.msg) != NULL;
    const char *msg = terminated ? st.msg : "<unterminated>";
    const size_t n = fn ? strlen(fn) : 0;
    CHECK(st.code == code, "%s: code %d, want %d (%s)", what, (int)st.code, (int)code, msg);
    CHECK(terminated && strstr(st.msg, field), "%s: message \"%s\" does not name %s", what, msg,
          field);
    CHECK(!fn || !code || (!strncmp(msg, fn, n) && !strncmp(msg + n, ": ", 2) &&
                  strncmp(msg + n + 2, fn, n)),
          "%s: message \"%s\" does not start with \"%s: \" once", what, msg, fn ? fn : "");
}

/* ---------------------------------------------------------------------------------------------
   uly_plan_init */

enum pfield { P_WORLD, P_RANK, P_SP, P_B, P_S, P_H, P_HKV, P_D, P_DTYPE, P_MAXB };

typedef struct plan_bad {
    const char *what;
    enum pfield f1;
    int64_t v1;
    enum pfield f2; /* a second field to set, or the same as f1 */
    int64_t v2;
    uly_code code;
    const char *field;
} plan_bad;

/* Valid: world 8 = DP 2 x SP 4, rank 5, B 2, S 16, H 8, Hkv 2, D 16, bf16. */
static uly_plan_desc good_desc(void) {
    uly_plan_desc d = {.world_size = 8, .rank = 5, .sp_size = 4, .batch = 2, .seq_len = 16,
                       .n_heads = 8, .n_kv_heads = 2, .head_dim = 16, .dtype = ULY_BF16};
    return d;
}

static void set_field(uly_plan_desc *d, enum pfield f, int64_t v) {
    switch (f) {
    case P_WORLD: d->world_size = (int)v; break;
    case P_RANK: d->rank = (int)v; break;
    case P_SP: d->sp_size = (int)v; break;
    case P_B: d->batch = v; break;
    case P_S: d->seq_len = v; break;
    case P_H: d->n_heads = v; break;
    case P_HKV: d->n_kv_heads = v; break;
    case P_D: d->head_dim = v; break;
    case P_DTYPE: d->dtype = (uly_dtype)v; break;
    case P_MAXB: d->max_bytes = v; break;
    }
}

static const int64_t BIG = (int64_t)1 << 40;

static const plan_bad plan_table[] = {
    {"sp_size 0", P_SP, 0, P_SP, 0, ULY_EINVAL, "sp_size"},
    {"sp_size negative", P_SP, -4, P_SP, -4, ULY_EINVAL, "sp_size"},
    {"sp_size > n_heads", P_SP, 8, P_H, 4, ULY_EINVAL, "sp_size"},
    {"sp_size > ULY_MAX_SP", P_SP, 512, P_WORLD, 512, ULY_EINVAL, "(512) must be in [1, 256]"},
    {"seq_len < sp_size", P_S, 3, P_S, 3, ULY_EINVAL, "seq_len"},
    {"seq_len negative", P_S, -16, P_S, -16, ULY_EINVAL, "seq_len"},
    {"world_size not a multiple of sp_size", P_WORLD, 6, P_WORLD, 6, ULY_EINVAL, "world_size"},
    {"world_size 0", P_WORLD, 0, P_WORLD, 0, ULY_EINVAL, "world_size"},
    {"rank = world_size", P_RANK, 8, P_RANK, 8, ULY_EINVAL, "rank"},
    {"rank negative", P_RANK, -1, P_RANK, -1, ULY_EINVAL, "rank"},
    {"n_kv_heads does not divide n_heads", P_HKV, 3, P_HKV, 3, ULY_EINVAL, "n_kv_heads"},
    {"n_kv_heads > n_heads", P_HKV, 16, P_HKV, 16, ULY_EINVAL, "n_kv_heads"},
    {"n_kv_heads negative", P_HKV, -2, P_HKV, -2, ULY_EINVAL, "n_kv_heads"},
    {"n_heads negative", P_H, -8, P_H, -8, ULY_EINVAL, "n_heads"},
    {"batch 0", P_B, 0, P_B, 0, ULY_EINVAL, "batch"},
    {"batch negative", P_B, -2, P_B, -2, ULY_EINVAL, "batch"},
    {"head_dim 0", P_D, 0, P_D, 0, ULY_EINVAL, "head_dim"},
    {"head_dim negative", P_D, -16, P_D, -16, ULY_EINVAL, "head_dim"},
    {"dtype not a uly_dtype", P_DTYPE, 7, P_DTYPE, 7, ULY_EINVAL, "dtype"},
    {"max_bytes negative", P_MAXB, -1, P_MAXB, -1, ULY_EINVAL, "max_bytes"},
    /* 2^40 * 2^40 * 8 * 16 * 2 bytes overflows int64 */
    {"B*S*H*D*elem overflows int64", P_B, BIG, P_S, BIG, ULY_EOVERFLOW, "seq_len"},
    /* Q to one peer: 2 * 4 * 2 * 16 * 2 = 512 bytes > 511 */
    {"per-peer bytes > max_bytes", P_MAXB, 511, P_MAXB, 511, ULY_EOVERFLOW, "max_bytes"},
};

TEST(plan_init_rejects_each_invalid_desc_with_its_code_and_field) {
    CHECK(sizeof plan_table / sizeof *plan_table >= 20, "table has %d rows",
          (int)(sizeof plan_table / sizeof *plan_table));
    for (size_t i = 0; i < sizeof plan_table / sizeof *plan_table; i++) {
        const plan_bad *t = &plan_table[i];
        uly_plan_desc d = good_desc();
        set_field(&d, t->f1, t->v1);
        set_field(&d, t->f2, t->v2);
        uly_plan p;
        check_status("uly_plan_init", uly_plan_init(&p, &d), t->code, t->field, t->what);
    }
}

TEST(plan_init_accepts_the_base_desc_of_the_table_and_max_bytes_at_the_limit) {
    uly_plan_desc d = good_desc();
    uly_plan p;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK && !st.msg[0], "%s", st.msg);
    d.max_bytes = 512; /* the largest per-peer count is exactly 512 */
    st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK && !st.msg[0], "max_bytes 512: %s", st.msg);
}

/* S = 2e17, H = Hkv = 3, f32 over 2 ranks: the fused QKV (7.2e18 bytes) fits int64, rank 1's
   workspace (one head of three) too, rank 0's (two) does not. Both ranks refuse the shape: one
   that went on would wait for the other in its first exchange. */
TEST(plan_init_refuses_alike_on_every_rank_sizes_that_overflow_on_one) {
    for (int r = 0; r < 2; r++) {
        uly_plan_desc d = {.world_size = 2, .rank = r, .sp_size = 2, .batch = 1,
                           .seq_len = 200000000000000000, .n_heads = 3, .head_dim = 1};
        uly_plan p;
        check_status("uly_plan_init", uly_plan_init(&p, &d), ULY_EOVERFLOW, "workspace bytes",
                     r ? "rank 1" : "rank 0");
    }
}

/* Near the limit, over uneven splits and GQA: every rank of a group accepts a shape or none
   does, and where they accept, every rank's saved and workspace bytes fit int64. */
TEST(plan_init_accepts_a_shape_near_int64_on_every_rank_or_on_none) {
    static const int64_t hs[][2] = {{3, 3}, {5, 1}, {8, 2}, {12, 4}};
    int refused = 0, accepted = 0;
    for (int P = 2; P <= 5; P++)
        for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
            for (int dt = ULY_F32; dt <= ULY_BF16; dt++)
                for (int64_t k = 4; k <= 64; k++) { /* S x H x D x 4 bytes near 2^63 x 4 / k */
                    uly_plan_desc d = {.world_size = P, .sp_size = P, .batch = 1,
                                       .n_heads = hs[i][0], .n_kv_heads = hs[i][1],
                                       .head_dim = 8, .dtype = (uly_dtype)dt};
                    d.seq_len = INT64_MAX / 8 / d.n_heads * 4 / k;
                    int ok = 0;
                    for (d.rank = 0; d.rank < P; d.rank++) {
                        uly_plan p;
                        uly__work w;
                        const uly_status st = uly_plan_init(&p, &d);
                        ok += !st.code;
                        CHECK(st.code || (uly_saved_bytes(&p) > 0 &&
                                          uly__work_at(&p, NULL, &w) > 0),
                              "P %d, H %lld, S %lld, rank %d: accepted, but its sizes overflow", P,
                              (long long)d.n_heads, (long long)d.seq_len, d.rank);
                    }
                    CHECK(ok == 0 || ok == P, "P %d, H %lld, Hkv %lld, S %lld: %d of %d accept", P,
                          (long long)d.n_heads, (long long)d.n_kv_heads, (long long)d.seq_len, ok,
                          P);
                    refused += ok == 0, accepted += ok == P;
                }
    CHECK(refused && accepted, "%d shapes refused, %d accepted: the sweep misses the limit",
          refused, accepted);
}

TEST(plan_init_rejects_null_arguments) {
    uly_plan p;
    uly_plan_desc d = good_desc();
    check_status("uly_plan_init", uly_plan_init(&p, NULL), ULY_EINVAL, "desc", "desc NULL");
    check_status("uly_plan_init", uly_plan_init(NULL, &d), ULY_EINVAL, "p is NULL", "plan NULL");
}

/* ---------------------------------------------------------------------------------------------
   The calls around the plan: exchange counts, positions, shards, fused views */

TEST(exchange_counts_reject_a_bad_plan_exchange_or_array) {
    uly_plan p, none;
    uly_plan_desc d = good_desc();
    int64_t c[4][ULY_MAX_SP];
    CHECK(uly_plan_init(&p, &d).code == ULY_OK, "the base plan");
    memset(&none, 0, sizeof none);
    check_status("uly_exchange_counts", uly_exchange_counts(&none, ULY_X_Q, c[0], c[1], c[2], c[3]),
                 ULY_EINVAL, "plan", "a plan not from uly_plan_init");
    check_status("uly_exchange_counts",
                 uly_exchange_counts(&p, (uly_xchg)7, c[0], c[1], c[2], c[3]), ULY_EINVAL, "x (7)",
                 "exchange 7");
    check_status("uly_exchange_counts", uly_exchange_counts(&p, ULY_X_KV, c[0], NULL, c[2], c[3]),
                 ULY_EINVAL, "NULL", "send_offs NULL");
    CHECK(uly_send_bytes(&p, (uly_xchg)7) == 0 && uly_recv_bytes(&p, (uly_xchg)-1) == 0,
          "bytes of a bad exchange: %lld, %lld", (long long)uly_send_bytes(&p, (uly_xchg)7),
          (long long)uly_recv_bytes(&p, (uly_xchg)-1));
}

TEST(positions_and_shards_reject_a_bad_plan_or_a_null_buffer) {
    uly_plan p, none;
    uly_plan_desc d = good_desc();
    int32_t full[2 * 16], local[2 * 4];
    CHECK(uly_plan_init(&p, &d).code == ULY_OK, "the base plan");
    memset(&none, 0, sizeof none);
    memset(full, 0, sizeof full);
    check_status("uly_positions", uly_positions(&none, local), ULY_EINVAL, "plan",
                 "positions, bad plan");
    check_status("uly_positions", uly_positions(&p, NULL), ULY_EINVAL, "NULL",
                 "positions, pos NULL");
    check_status("uly_shard_tokens", uly_shard_tokens(&p, NULL, local), ULY_EINVAL, "NULL",
                 "tokens, full NULL");
    check_status("uly_shard_tokens", uly_shard_tokens(NULL, full, local), ULY_EINVAL, "plan",
                 "tokens, plan NULL");
    check_status("uly_shard_labels", uly_shard_labels(&p, full, -100, NULL), ULY_EINVAL, "NULL",
                 "labels NULL");
}

TEST(positions_beyond_int32_are_an_error_not_wrapped) {
    /* S = 2^32 over 256 ranks: the last rank's first token is 2^32 - 2^24. */
    uly_plan p;
    uly_plan_desc d = {.world_size = 256, .rank = 255, .sp_size = 256, .batch = 1,
                       .seq_len = (int64_t)1 << 32, .n_heads = 256, .head_dim = 8,
                       .dtype = ULY_BF16};
    int32_t pos[1] = {7};
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    check_status("uly_positions", uly_positions(&p, pos), ULY_EOVERFLOW, "int32", "S = 2^32");
    CHECK(pos[0] == 7, "pos[0] was written: %d", (int)pos[0]);
}

TEST(qkv_views_reject_a_null_output) {
    float buf[6 * 4];
    uly_tensor q, k;
    check_status("uly_qkv_views", uly_qkv_views(buf, ULY_F32, 1, 1, 4, 1, 4, &q, &k, NULL),
                 ULY_EINVAL, "v is NULL", "v NULL");
}

TEST(a_view_whose_shape_overflows_int64_is_eoverflow) {
    float buf[64];
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = a.o = uly_dense(buf, ULY_F32, 1, (int64_t)1 << 40, (int64_t)1 << 20, 1 << 10);
    a.k = a.v = uly_dense(buf, ULY_F32, 1, 4, 1, 8);
    a.lse = buf;
    check_status("uly_attn_check", uly_attn_check(&a, 0), ULY_EOVERFLOW, "overflows int64",
                 "q of 2^70 elements");
}

TEST(qkv_views_reject_negative_counts_and_shapes_that_overflow_int64) {
    float buf[6 * 4];
    uly_tensor q, k, v;
    check_status("uly_qkv_views", uly_qkv_views(buf, ULY_F32, 1, 1, -1, 1, 4, &q, &k, &v),
                 ULY_EINVAL, "nq", "nq -1");
    check_status(
        "uly_qkv_views",
        uly_qkv_views(buf, ULY_F32, 1, (int64_t)1 << 40, (int64_t)1 << 20, 1, 1 << 10, &q, &k, &v),
        ULY_EOVERFLOW, "overflows", "2^40 tokens x 2^20 heads x 2^10");
    check_status("uly_qkv_views",
                 uly_qkv_views(buf, ULY_F32, (int64_t)1 << 40, 1, 1, 0, 1 << 30, &q, &k, &v),
                 ULY_EOVERFLOW, "overflows", "2^40 batches of 2^30 elements");
}

/* ---------------------------------------------------------------------------------------------
   uly_forward and uly_backward

   A valid layer on SP rank 0 of 2 (B 1, S 8, H 4, Hkv 2, D 8, fp32): 4 local tokens. The
   communicator is a stub that fails if called: validation comes before any exchange, so a rank
   with a bad argument leaves having sent nothing (its peers then wait for it in the first
   exchange until the program aborts the communicator, as with any collective a rank leaves). */

static int stub_calls;
static uly_status stub_a2a(void *ctx, const void *s, const int64_t *sc, const int64_t *so, void *r,
                           const int64_t *rc, const int64_t *ro, void *stream) {
    (void)ctx, (void)s, (void)sc, (void)so, (void)r, (void)rc, (void)ro, (void)stream;
    stub_calls++;
    uly_status st;
    memset(&st, 0, sizeof st);
    st.code = ULY_ECOMM;
    snprintf(st.msg, sizeof st.msg, "stub communicator called");
    return st;
}
static uly_status stub_allreduce(void *ctx, double *buf, int64_t n, void *stream) {
    (void)ctx, (void)buf, (void)n, (void)stream;
    return stub_a2a(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
}
static uly_status stub_barrier(void *ctx) {
    (void)ctx;
    return stub_a2a(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
}

enum { FB = 1, FS = 8, FSR = 4, FH = 4, FHKV = 2, FD = 8 };

typedef struct fixture {
    uly_plan plan;
    uly_comm comm;
    uly_layer L;
    float q[FB * FSR * FH * FD], k[FB * FSR * FHKV * FD], v[FB * FSR * FHKV * FD];
    float o[FB * FSR * FH * FD], dq[FB * FSR * FH * FD], dk[FB * FSR * FHKV * FD],
        dv[FB * FSR * FHKV * FD];
    uly_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv;
    void *saved, *saved_buf, *ws;
    int64_t saved_bytes;
} fixture;

/* The fixture with seq_len S <= FS (rank 0 holds at most FSR tokens). */
static void fixture_init_len(fixture *f, int64_t S) {
    memset(f, 0, sizeof *f);
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 2, d.rank = 0, d.sp_size = 2, d.batch = FB, d.seq_len = S, d.n_heads = FH,
    d.n_kv_heads = FHKV, d.head_dim = FD, d.dtype = ULY_F32;
    uly_status st = uly_plan_init(&f->plan, &d);
    CHECK(st.code == ULY_OK, "fixture plan: %s", st.msg);
    f->comm.size = 2, f->comm.rank = 0;
    f->comm.alltoallv = stub_a2a, f->comm.allreduce_sum = stub_allreduce;
    f->comm.barrier = stub_barrier;
    f->L.plan = &f->plan;
    f->L.comm = &f->comm;
    f->L.attn = uly_cpu_attention();
    f->L.layout = uly_cpu_layout();
    f->L.causal = 1;
    f->L.workspace_bytes = uly_layer_workspace(&f->L);
    f->ws = malloc((size_t)(f->L.workspace_bytes > 0 ? f->L.workspace_bytes : 1));
    f->L.workspace = f->ws;
    f->saved_bytes = uly_saved_bytes(&f->plan);
    f->saved = f->saved_buf = malloc((size_t)f->saved_bytes);
    const int64_t n = uly_tokens(&f->plan, 0).count;
    f->tq = uly_dense(f->q, ULY_F32, FB, n, FH, FD);
    f->tk = uly_dense(f->k, ULY_F32, FB, n, FHKV, FD);
    f->tv = uly_dense(f->v, ULY_F32, FB, n, FHKV, FD);
    f->to = uly_dense(f->o, ULY_F32, FB, n, FH, FD);
    f->tdo = uly_dense(f->o, ULY_F32, FB, n, FH, FD);
    f->tdq = uly_dense(f->dq, ULY_F32, FB, n, FH, FD);
    f->tdk = uly_dense(f->dk, ULY_F32, FB, n, FHKV, FD);
    f->tdv = uly_dense(f->dv, ULY_F32, FB, n, FHKV, FD);
}
static void fixture_init(fixture *f) { fixture_init_len(f, FS); }
static void fixture_free(fixture *f) {
    free(f->ws);
    free(f->saved_buf);
}

static uly_status fwd(fixture *f) {
    return uly_forward(&f->L, f->tq, f->tk, f->tv, f->to, f->saved, f->saved_bytes);
}
static uly_status bwd(fixture *f) {
    return uly_backward(&f->L, f->tdo, f->saved, f->saved_bytes, f->tdq, f->tdk, f->tdv);
}

/* Each breaks one thing of a fresh fixture and makes the call. */
static uly_status f_q_null(fixture *f) { f->tq.data = NULL; return fwd(f); }
static uly_status f_k_null(fixture *f) { f->tk.data = NULL; return fwd(f); }
static uly_status f_out_null(fixture *f) { f->to.data = NULL; return fwd(f); }
static uly_status f_q_tokens(fixture *f) { f->tq.s = FSR + 1; return fwd(f); }
static uly_status f_q_heads(fixture *f) { f->tq.h = FH - 1; return fwd(f); }
static uly_status f_k_heads(fixture *f) { f->tk.h = FH; return fwd(f); }
static uly_status f_v_dim(fixture *f) { f->tv.d = FD / 2; return fwd(f); }
static uly_status f_out_batch(fixture *f) { f->to.b = 2; return fwd(f); }
static uly_status f_q_dtype(fixture *f) { f->tq.dtype = ULY_BF16; return fwd(f); }
static uly_status f_out_dtype(fixture *f) { f->to.dtype = ULY_F16; return fwd(f); }
static uly_status f_q_overlap(fixture *f) { f->tq.sh = FD - 1; return fwd(f); }
static uly_status f_comm_size(fixture *f) { f->comm.size = 3; return fwd(f); }
static uly_status f_comm_rank(fixture *f) { f->comm.rank = 1; return fwd(f); }
static uly_status f_comm_null(fixture *f) { f->L.comm = NULL; return fwd(f); }
static uly_status f_plan_null(fixture *f) { f->L.plan = NULL; return fwd(f); }
static uly_status f_ws_null(fixture *f) { f->L.workspace = NULL; return fwd(f); }
static uly_status f_ws_small(fixture *f) { f->L.workspace_bytes -= 1; return fwd(f); }
/* the layer's own check, not only the attention's */
static uly_status f_ws_small_unchecked(fixture *f) {
    f->L.attn.check = NULL, f->L.workspace_bytes -= 1;
    return fwd(f);
}
static uly_status f_comm_max_bytes(fixture *f) { f->comm.max_bytes = 8; return fwd(f); }
static uly_status f_attn_null(fixture *f) { f->L.attn.fwd = NULL; return fwd(f); }
static uly_status f_layout_null(fixture *f) { f->L.layout.pack = NULL; return fwd(f); }
static uly_status f_saved_null(fixture *f) { f->saved = NULL; return fwd(f); }
static uly_status f_saved_small(fixture *f) { f->saved_bytes -= 1; return fwd(f); }
/* refused before anything is written, so the bytes past the buffer are never touched */
static uly_status f_saved_misaligned(fixture *f) { f->saved = (char *)f->saved + 2; return fwd(f); }
/* saved sized for a plan of fewer tokens, as a buffer kept across a change of seq_len would be
   (a quarter of them: the parts of saved are padded to 256 bytes) */
static uly_status b_saved_of_fewer_tokens(fixture *f) {
    uly_plan fewer;
    uly_plan_desc d = f->plan.desc;
    d.seq_len /= 4;
    uly_status st = uly_plan_init(&fewer, &d);
    CHECK(st.code == ULY_OK, "plan of seq_len %lld: %s", (long long)d.seq_len, st.msg);
    f->saved_bytes = uly_saved_bytes(&fewer);
    return bwd(f);
}
static uly_status f_layout_device(fixture *f) { f->L.layout.device = 1; return fwd(f); }
static uly_status f_attn_device(fixture *f) { f->L.attn.device = 1; return fwd(f); }
/* A bf16 plan and tensors the layer takes, but the CPU attention computes in f32 only. */
static uly_status f_attn_refuses(fixture *f) {
    uly_plan_desc d = f->plan.desc;
    d.dtype = ULY_BF16;
    uly_status st = uly_plan_init(&f->plan, &d);
    CHECK(st.code == ULY_OK, "bf16 plan: %s", st.msg);
    f->tq.dtype = f->tk.dtype = f->tv.dtype = f->to.dtype = ULY_BF16;
    return fwd(f);
}
static uly_status f_saved_in_ws(fixture *f) { f->saved = (char *)f->ws + 256; return fwd(f); }
static uly_status f_k_in_saved(fixture *f) { f->tk.data = f->saved_buf; return fwd(f); }
static uly_status f_out_in_ws(fixture *f) { f->to.data = (char *)f->ws + 64; return fwd(f); }
static uly_status f_plan_kv_changed(fixture *f) { f->plan.desc.n_kv_heads = 1; return fwd(f); }
static uly_status f_plan_dtype_changed(fixture *f) { f->plan.desc.dtype = ULY_BF16; return fwd(f); }
static uly_status b_dout_null(fixture *f) { f->tdo.data = NULL; return bwd(f); }
static uly_status b_dout_in_ws(fixture *f) { f->tdo.data = f->ws; return bwd(f); }
static uly_status b_dv_in_saved(fixture *f) { f->tdv.data = f->saved_buf; return bwd(f); }
static uly_status b_dk_in_dq(fixture *f) { f->tdk.data = f->dq + FD; return bwd(f); }
static uly_status b_dv_is_dk(fixture *f) { f->tdv = f->tdk; return bwd(f); }
static uly_status b_dq_tokens(fixture *f) { f->tdq.s = FSR - 1; return bwd(f); }
static uly_status b_dk_heads(fixture *f) { f->tdk.h = FHKV + 1; return bwd(f); }
static uly_status b_dv_dtype(fixture *f) { f->tdv.dtype = ULY_BF16; return bwd(f); }
static uly_status b_attn_null(fixture *f) { f->L.attn.bwd = NULL; return bwd(f); }
static uly_status b_ws_small(fixture *f) { f->L.workspace_bytes = 8; return bwd(f); }
static uly_status b_saved_null(fixture *f) { f->saved = NULL; return bwd(f); }
static uly_status b_comm_size(fixture *f) { f->comm.size = 1; return bwd(f); }
static uly_status refuse(void *ctx, const uly_attn_args *a, int backward) {
    (void)ctx, (void)a;
    return uly__err(ULY_EUNSUPPORTED, "refused by the attention's check (backward %d)", backward);
}
static uly_status b_attn_refuses(fixture *f) { f->L.attn.check = refuse; return bwd(f); }

typedef struct layer_bad {
    const char *what;
    uly_status (*call)(fixture *f);
    uly_code code;
    const char *field;
} layer_bad;

static const layer_bad layer_table[] = {
    {"forward: q data NULL", f_q_null, ULY_EINVAL, "q:"},
    {"forward: k data NULL", f_k_null, ULY_EINVAL, "k:"},
    {"forward: out data NULL", f_out_null, ULY_EINVAL, "out:"},
    {"forward: q has S_r + 1 tokens", f_q_tokens, ULY_EINVAL, "q:"},
    {"forward: q has H - 1 heads", f_q_heads, ULY_EINVAL, "q:"},
    {"forward: k has H heads, plan says Hkv", f_k_heads, ULY_EINVAL, "k:"},
    {"forward: v head dim D/2", f_v_dim, ULY_EINVAL, "v:"},
    {"forward: out batch 2", f_out_batch, ULY_EINVAL, "out:"},
    {"forward: q bf16, plan fp32", f_q_dtype, ULY_EINVAL, "dtype"},
    {"forward: out f16, plan fp32", f_out_dtype, ULY_EINVAL, "dtype"},
    {"forward: q heads overlap (sh < d)", f_q_overlap, ULY_EINVAL, "q:"},
    {"forward: comm size 3, sp_size 2", f_comm_size, ULY_EINVAL, "comm"},
    {"forward: comm rank 1, sp_rank 0", f_comm_rank, ULY_EINVAL, "comm"},
    {"forward: comm NULL", f_comm_null, ULY_EINVAL, "comm"},
    {"forward: plan NULL", f_plan_null, ULY_EINVAL, "plan"},
    {"forward: plan's n_kv_heads changed after init", f_plan_kv_changed, ULY_EINVAL, "plan"},
    {"forward: plan's dtype changed after init", f_plan_dtype_changed, ULY_EINVAL, "plan"},
    {"forward: workspace NULL", f_ws_null, ULY_EINVAL, "workspace"},
    {"forward: workspace one byte short", f_ws_small, ULY_EINVAL, "workspace"},
    {"forward: workspace one byte short, the attention without a check", f_ws_small_unchecked,
     ULY_EINVAL, "layer.workspace_bytes"},
    {"forward: comm.max_bytes below the largest message", f_comm_max_bytes, ULY_EOVERFLOW,
     "layer.comm->max_bytes"},
    {"forward: attn.fwd NULL", f_attn_null, ULY_EINVAL, "attn.fwd"},
    {"forward: layout.pack NULL", f_layout_null, ULY_EINVAL, "layout.pack"},
    {"forward: saved NULL", f_saved_null, ULY_EINVAL, "saved"},
    {"forward: saved one byte short", f_saved_small, ULY_EINVAL,
     "saved_bytes (1791) < uly_saved_bytes() (1792)"},
    {"forward: saved 2 bytes past 4-byte alignment", f_saved_misaligned, ULY_EINVAL,
     "is not 4-byte aligned: it holds the fp32 lse"},
    {"forward: layout on GPU memory, comm on host", f_layout_device, ULY_EINVAL, "device"},
    {"forward: attention on GPU memory, comm on host", f_attn_device, ULY_EINVAL, "device"},
    {"forward: bf16 into the f32-only CPU attention", f_attn_refuses, ULY_EUNSUPPORTED, "f32"},
    /* saved: q and o [8, 2, 8] and k, v [8, 1, 8] fp32, then lse [2, 8] padded to 256 bytes */
    {"forward: saved inside the workspace", f_saved_in_ws, ULY_EINVAL, "saved (1792 bytes) and"},
    {"forward: k inside saved", f_k_in_saved, ULY_EINVAL, "k overlaps saved"},
    {"forward: out inside the workspace", f_out_in_ws, ULY_EINVAL, "out overlaps layer.work"},
    {"backward: dout data NULL", b_dout_null, ULY_EINVAL, "dout:"},
    {"backward: dout is the workspace", b_dout_in_ws, ULY_EINVAL, "dout overlaps layer.work"},
    {"backward: dv inside saved", b_dv_in_saved, ULY_EINVAL, "dv overlaps saved"},
    {"backward: dk inside dq", b_dk_in_dq, ULY_EINVAL, "dq and dk share memory"},
    {"backward: dv is dk", b_dv_is_dk, ULY_EINVAL, "dk and dv share memory"},
    {"backward: dq has S_r - 1 tokens", b_dq_tokens, ULY_EINVAL, "dq:"},
    {"backward: dk has Hkv + 1 heads", b_dk_heads, ULY_EINVAL, "dk:"},
    {"backward: dv bf16", b_dv_dtype, ULY_EINVAL, "dtype"},
    {"backward: attn.bwd NULL", b_attn_null, ULY_EINVAL, "attn.bwd"},
    {"backward: workspace of 8 bytes", b_ws_small, ULY_EINVAL, "workspace"},
    {"backward: saved NULL", b_saved_null, ULY_EINVAL, "saved"},
    {"backward: saved sized for a quarter of the tokens", b_saved_of_fewer_tokens, ULY_EINVAL,
     "saved_bytes (1280) < uly_saved_bytes() (1792)"},
    {"backward: comm size 1, sp_size 2", b_comm_size, ULY_EINVAL, "comm"},
    {"backward: the attention's check refuses", b_attn_refuses, ULY_EUNSUPPORTED, "backward 1"},
};

TEST(forward_and_backward_reject_each_invalid_argument_before_any_exchange) {
    for (size_t i = 0; i < sizeof layer_table / sizeof *layer_table; i++) {
        fixture *f = (fixture *)malloc(sizeof *f);
        fixture_init(f);
        stub_calls = 0;
        const char *fn =
            strncmp(layer_table[i].what, "forward", 7) ? "uly_backward" : "uly_forward";
        check_status(fn, layer_table[i].call(f), layer_table[i].code, layer_table[i].field,
                     layer_table[i].what);
        CHECK(stub_calls == 0, "%s: the communicator was called %d times", layer_table[i].what,
              stub_calls);
        fixture_free(f);
        free(f);
    }
}

/* A plan changed after uly_plan_init would size the kv blocks by one kv head and index four. */
TEST(cpu_layout_rejects_a_plan_changed_after_init) {
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    f->plan.desc.n_kv_heads = 1;
    uly_layout cpu = uly_cpu_layout();
    check_status(NULL, cpu.pack(cpu.ctx, &f->plan, ULY_X_KV, f->tk, f->ws, NULL), ULY_EINVAL,
                 "plan is NULL or not as uly_plan_init made it", "pack with n_kv_heads changed");
    fixture_free(f);
    free(f);
}

/* f32 tensors and exchange buffers are read as floats: a pointer 2 bytes in is refused. */
TEST(cpu_layout_rejects_pointers_off_the_element_size) {
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    uly_layout cpu = uly_cpu_layout();
    uly_tensor odd = f->tk;
    odd.data = (char *)odd.data + 2;
    check_status(NULL, cpu.pack(cpu.ctx, &f->plan, ULY_X_KV, odd, f->ws, NULL), ULY_EINVAL,
                 "is not aligned to its element size (4 bytes)", "a tensor 2 bytes in");
    check_status(NULL, cpu.pack(cpu.ctx, &f->plan, ULY_X_KV, f->tk, (char *)f->ws + 2, NULL),
                 ULY_EINVAL, "is NULL or not aligned to the element size (4 bytes)",
                 "a send buffer 2 bytes in");
    check_status(NULL, cpu.unpack(cpu.ctx, &f->plan, ULY_X_O, (char *)f->ws + 2, f->to, NULL),
                 ULY_EINVAL, "unpack O: recv", "a recv buffer 2 bytes in");
    fixture_free(f);
    free(f);
}

/* The layer calls the optional alltoall only where every block of every rank has one size:
   S = 8 over 2 ranks (4 tokens each), not S = 7 (4 and 3). */
static int stub_alltoall_calls;
static uly_status stub_alltoall(void *ctx, const void *s, void *r, int64_t n, void *stream) {
    (void)s, (void)r, (void)n;
    stub_alltoall_calls++;
    return stub_a2a(ctx, NULL, NULL, NULL, NULL, NULL, NULL, stream);
}

TEST(alltoall_only_where_every_block_has_one_size) {
    for (int64_t S = FS - 1; S <= FS; S++) {
        fixture *f = (fixture *)malloc(sizeof *f);
        fixture_init_len(f, S);
        f->comm.alltoall = stub_alltoall;
        stub_calls = stub_alltoall_calls = 0;
        check_status("uly_forward", fwd(f), ULY_ECOMM, "stub communicator called",
                     "forward, stub comm");
        CHECK(stub_alltoall_calls == (S == FS) && stub_calls == 1,
              "S %lld: alltoall called %d times, alltoallv %d; want %d, 1", (long long)S,
              stub_alltoall_calls, stub_calls - stub_alltoall_calls, S == FS);
        fixture_free(f);
        free(f);
    }
}

/* The attention gets what is left of the layer's workspace after the layer's own part: its
   workspace ends where the layer's does. */
static const uly_layer *seen_layer;
static int ws_seen;
static uly_status see_workspace(void *ctx, const uly_attn_args *a, int backward) {
    (void)ctx, (void)backward;
    const char *end = (const char *)seen_layer->workspace + seen_layer->workspace_bytes;
    ws_seen++;
    CHECK((const char *)a->workspace + a->workspace_bytes == end, "the attention's workspace "
          "ends %lld bytes past the layer's",
          (long long)((const char *)a->workspace + a->workspace_bytes - end));
    return uly__err(ULY_EUNSUPPORTED, "checked");
}

TEST(the_attention_gets_the_workspace_left_after_the_layers_part) {
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    f->L.attn.check = see_workspace, seen_layer = &f->L, ws_seen = 0;
    fwd(f);
    CHECK(ws_seen == 1, "the attention's check ran %d times", ws_seen);
    fixture_free(f);
    free(f);
}

TEST(a_valid_call_reaches_the_communicator_and_returns_its_error) {
    /* The fixture is valid: the first exchange fails in the stub, and that error comes back. */
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    for (int i = 0; i < FB * FSR * FH * FD; i++) f->q[i] = 0, f->o[i] = 0;
    for (int i = 0; i < FB * FSR * FHKV * FD; i++) f->k[i] = f->v[i] = 0;
    stub_calls = 0;
    uly_status st = fwd(f);
    CHECK(stub_calls >= 1, "the communicator was not called");
    check_status("uly_forward", st, ULY_ECOMM, "stub communicator called",
                 "forward with a failing comm");
    fixture_free(f);
    free(f);
}

/* The inputs may share memory (only the gradients may not): k and v one tensor passes every
   check and reaches the communicator. */
TEST(forward_takes_k_and_v_as_one_tensor) {
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    f->tv = f->tk;
    check_status("uly_forward", fwd(f), ULY_ECOMM, "stub communicator called", "v is k");
    fixture_free(f);
    free(f);
}

/* A communicator whose message fills uly_status.msg: letters a to z over and over. */
static uly_status long_a2a(void *ctx, const void *s, const int64_t *sc, const int64_t *so,
                           void *r, const int64_t *rc, const int64_t *ro, void *stream) {
    uly_status st;
    (void)ctx, (void)s, (void)sc, (void)so, (void)r, (void)rc, (void)ro, (void)stream;
    st.code = ULY_ECOMM;
    for (size_t i = 0; i + 1 < sizeof st.msg; i++) st.msg[i] = (char)('a' + i % 26);
    st.msg[sizeof st.msg - 1] = 0;
    return st;
}

TEST(a_full_message_from_inside_keeps_its_start_after_the_name_of_the_call) {
    fixture *f = (fixture *)malloc(sizeof *f);
    fixture_init(f);
    f->comm.alltoallv = long_a2a;
    const uly_status st = fwd(f);
    const size_t cap = sizeof st.msg - 1, n = strlen("uly_forward: ");
    int letters = 1;
    for (size_t i = n; i < cap; i++) letters &= st.msg[i] == (char)('a' + (i - n) % 26);
    CHECK(st.code == ULY_ECOMM && memchr(st.msg, 0, sizeof st.msg) && strlen(st.msg) == cap &&
              !strncmp(st.msg, "uly_forward: ", n) && letters,
          "code %d, message \"%.*s\"", (int)st.code, (int)cap, st.msg);
    fixture_free(f);
    free(f);
}

/* The gradients may be views of one fused buffer, which interleave row by row without sharing
   an element; the check must tell them from views that do share one. */
TEST(gradient_views_that_interleave_are_told_from_views_that_share_an_element) {
    static float buf[2 * 3 * 8 * 8];
    uly_tensor q, k, v;
    CHECK(!uly_qkv_views(buf, ULY_F32, 2, 3, 4, 2, 8, &q, &k, &v).code, "fused views");
    /* the same heads stored heads-outer: [2, 8 heads, 3 tokens, 8] seen as [b, s, h, d] */
    uly_tensor hq = uly_dense(buf, ULY_F32, 2, 3, 4, 8), hk;
    hq.sb = 8 * 3 * 8, hq.ss = 8, hq.sh = 3 * 8;
    hk = hq, hk.h = 2, hk.data = buf + 4 * 3 * 8;
    /* tokens [0, 2) and [2, 3) of each batch of a dense [2, 3, 8, 8], and [1, 3) */
    uly_tensor all = uly_dense(buf, ULY_F32, 2, 3, 8, 8), t0 = all, t1 = all, t2 = all;
    t0.s = 2, t1.s = 1, t1.data = buf + 2 * 8 * 8, t2.s = 2, t2.data = buf + 8 * 8;
    uly_tensor q_shift = q, kv = uly_head_slice(all, 4, 3); /* heads 4..6: k and v's first */
    q_shift.data = buf + 1;
    /* one batch: the stride of b is never applied, so k's may be anything */
    uly_tensor q1, k1, v1, k1_sb;
    CHECK(!uly_qkv_views(buf, ULY_F32, 1, 3, 4, 2, 8, &q1, &k1, &v1).code, "fused views, B 1");
    k1_sb = k1, k1_sb.sb = 12345;
    /* heads interleaved [2, 3, 4, 3 (q k v), 8]; and the same with tight strides (H = 2: rows
       at 0, 24, 32, 56, ...), where the view moved on by 8 meets its own row at 32 */
    uly_tensor iq = uly_dense(buf, ULY_F32, 2, 3, 4, 8), ik, iv, tq, tk;
    iq.sh = 24, iq.ss = 96, iq.sb = 288;
    ik = iq, ik.data = buf + 8, iv = iq, iv.data = buf + 16;
    tq = uly_dense(buf, ULY_F32, 1, 3, 2, 8), tq.sh = 24, tq.ss = 32;
    tk = tq, tk.data = buf + 8;
    const struct {
        const char *what;
        uly_tensor x, y;
        int share;
    } pairs[] = {
        {"fused q, k", q, k, 0},       {"fused k, v", k, v, 0},
        {"fused v, q", v, q, 0},       {"heads-outer q, k", hq, hk, 0},
        {"tokens [0, 2), [2, 3)", t0, t1, 0},
        {"fused q, q", q, q, 1},       {"k, heads 4..6", k, kv, 1},
        {"v, heads 4..6", v, kv, 1},   {"q, q one element on", q, q_shift, 1},
        {"tokens [0, 2), [1, 3)", t0, t2, 1},
        {"fused q, heads-outer k", q, hk, 1},
        {"B = 1: fused q, k whose sb differs", q1, k1_sb, 0},
        {"B = 1: fused k whose sb differs, k", k1_sb, k1, 1},
        {"interleaved q, k", iq, ik, 0},
        {"interleaved k, v", ik, iv, 0},
        {"interleaved q, v", iq, iv, 0},
        {"tight strides, moved by 8", tq, tk, 1},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof *pairs; i++) {
        CHECK(uly__share(pairs[i].x, pairs[i].y) == pairs[i].share &&
                  uly__share(pairs[i].y, pairs[i].x) == pairs[i].share,
              "%s: share %d, want %d", pairs[i].what, uly__share(pairs[i].x, pairs[i].y),
              pairs[i].share);
    }
}

/* Two byte ranges near the top of the address space meet without their ends wrapping around. */
TEST(overlap_of_byte_ranges_near_the_top_of_the_address_space) {
    const void *a = (const void *)(UINTPTR_MAX - 63), *b = (const void *)(UINTPTR_MAX - 31);
    CHECK(uly__meet(a, 64, b, 32) && uly__meet(b, 32, a, 64), "64 bytes and the last 32 meet");
    CHECK(!uly__meet(a, 32, b, 32) && !uly__meet(b, 32, a, 32), "two 32-byte halves meet");
}

/* A plan edited after uly_plan_init into sizes that overflow is refused, and sized as 0,
   instead of sizing buffers from the overflow. */
TEST(a_plan_edited_into_overflowing_sizes_is_refused) {
    uly_plan p;
    uly_plan_desc d = good_desc();
    CHECK(uly_plan_init(&p, &d).code == ULY_OK, "the base plan");
    p.desc.seq_len = (int64_t)1 << 60;
    int64_t c[4][ULY_MAX_SP];
    check_status("uly_exchange_counts", uly_exchange_counts(&p, ULY_X_Q, c[0], c[1], c[2], c[3]),
                 ULY_EINVAL, "plan", "seq_len 2^60 after init");
    CHECK(uly_saved_bytes(&p) == 0 && uly_send_bytes(&p, ULY_X_Q) == 0, "sized as %lld, %lld",
          (long long)uly_saved_bytes(&p), (long long)uly_send_bytes(&p, ULY_X_Q));
    CHECK(uly_plan_init(&p, &d).code == ULY_OK, "the base plan");
    p.desc.n_heads = p.desc.n_kv_heads = (int64_t)1 << 62, p.group = 1;
    check_status("uly_exchange_counts", uly_exchange_counts(&p, ULY_X_Q, c[0], c[1], c[2], c[3]),
                 ULY_EINVAL, "plan", "2^62 heads after init");
}

/* One rank, f32, S = 5 * 2^37 and D = 2^20 after init: the fused q, k, v (3 * 5 * 2^59 bytes)
   fit int64, saved (4 * 5 * 2^59, as uly_plan_init would have found) does not. And an edit into
   a shape init accepts, S 16 -> 17: its buffers would be sized for what no peer planned. Both
   are refused: the queries size 0 and the lse view is NULL. */
TEST(a_plan_edited_after_init_is_refused_even_where_its_fused_buffer_fits) {
    uly_plan_desc one = {.world_size = 1, .sp_size = 1, .batch = 1, .seq_len = 16, .n_heads = 1,
                         .head_dim = 16};
    uly_plan_desc d = good_desc();
    uly_plan p;
    char saved[64];
    int64_t c[4][ULY_MAX_SP];
    for (int edit = 0; edit < 2; edit++) {
        CHECK(uly_plan_init(&p, edit ? &d : &one).code == ULY_OK, "the base plan");
        if (edit) p.desc.seq_len = 17;
        else p.desc.seq_len = (int64_t)5 << 37, p.desc.head_dim = (int64_t)1 << 20;
        check_status("uly_exchange_counts",
                     uly_exchange_counts(&p, ULY_X_Q, c[0], c[1], c[2], c[3]), ULY_EINVAL, "plan",
                     edit ? "S 16 -> 17" : "S 5 * 2^37, D 2^20");
        CHECK(uly_saved_bytes(&p) == 0 && uly_saved_lse(&p, saved) == NULL &&
                  uly_tokens(&p, 0).count == 0,
              "edit %d: saved_bytes %lld, lse at saved %+lld", edit,
              (long long)uly_saved_bytes(&p),
              (long long)((char *)uly_saved_lse(&p, saved) - saved));
    }
    check_status("uly_plan_init", uly_plan_init(&p, &p.desc), ULY_OK, "", "S 17 made anew");
}

/* ---------------------------------------------------------------------------------------------
   uly_attn_check */

enum { AB = 2, AS = 5, AH = 4, AHKV = 2, AD = 8 };
static float abuf[AB * AS * AH * AD];
static float alse[AB * AH * AS];

/* Every tensor a view of abuf: uly_attn_check looks at shapes, not data. */
static uly_attn_args good_args(void) {
    static const ref_shape s = {AB, AS, AS, AH, AHKV, AD, 0, 0};
    attn_bufs x = {abuf, abuf, abuf, abuf, alse, abuf, abuf, abuf, abuf};
    return attn_args(&s, &x);
}

typedef struct attn_bad {
    const char *what;
    int backward;
    uly_code code;
    const char *field;
} attn_bad;

/* Row i of this table is broken by case i of break_args. */
static const attn_bad attn_table[] = {
    {"k.h = 3 does not divide q.h = 4", 0, ULY_EINVAL, "k.h"},
    {"k.d != q.d", 0, ULY_EINVAL, "k.d"},
    {"v.s != k.s", 0, ULY_EINVAL, "v:"},
    {"o.h != q.h", 0, ULY_EINVAL, "o:"},
    {"k.b != q.b", 0, ULY_EINVAL, "k.b"},
    {"lse NULL", 0, ULY_EINVAL, "lse"},
    {"q data NULL", 0, ULY_EINVAL, "q:"},
    {"k bf16, q fp32", 0, ULY_EINVAL, "dtype"},
    {"kv_group 1 with q.h 4, k.h 2: head 3 reads kv head 3", 0, ULY_EINVAL, "kv_group"},
    {"backward: dq NULL", 1, ULY_EINVAL, "dq:"},
    {"backward: dk.h != k.h", 1, ULY_EINVAL, "dk:"},
    {"backward: dout.s != q.s", 1, ULY_EINVAL, "dout:"},
    {"softmax_scale NaN", 0, ULY_EINVAL, "softmax_scale"},
    {"q_head0 negative", 0, ULY_EINVAL, "q_head0"},
    {"q_head0 + q.h beyond int64", 0, ULY_EINVAL, "q_head0"},
    {"q.ss = -1 (a negative stride, not uly_dense's overflow mark)", 0, ULY_EINVAL, ">= 0"},
    {"kv_group 2^62 over 2 kv heads: their query heads pass int64", 0, ULY_EINVAL, "kv_group"},
    {"lse 2 bytes into a float array", 0, ULY_EINVAL, "lse is NULL or not 4-byte aligned"},
    {"backward: dv 2 bytes into a float array", 1, ULY_EINVAL,
     "is not aligned to its element size (4 bytes)"},
};

static void break_args(uly_attn_args *a, int i) {
    switch (i) {
    case 0: a->k.h = 3, a->v.h = 3; break;
    case 1: a->k.d = 16, a->v.d = 16; break;
    case 2: a->v.s = AS + 1; break;
    case 3: a->o.h = AH - 1; break;
    case 4: a->k.b = 1, a->v.b = 1; break;
    case 5: a->lse = NULL; break;
    case 6: a->q.data = NULL; break;
    case 7: a->k.dtype = ULY_BF16, a->v.dtype = ULY_BF16; break;
    case 8: a->kv_group = 1; break;
    case 9: a->dq.data = NULL; break;
    case 10: a->dk.h = 1; break;
    case 11: a->dout.s = AS - 1; break;
    case 12: a->softmax_scale = NAN; break;
    case 13: a->q_head0 = -1; break;
    case 14: a->q_head0 = INT64_MAX - 1; break;
    case 15: a->q.ss = -1; break;
    case 16: a->kv_group = (int64_t)1 << 62; break;
    case 17: a->lse = (float *)((char *)alse + 2); break;
    case 18: a->dv.data = (char *)a->dv.data + 2; break;
    }
}

TEST(attn_check_accepts_a_kv_group_that_maps_a_head_slice_into_k) {
    /* q heads [0, 4) of a group-3 model (H = 6, Hkv = 2) read kv heads 0, 0, 0, 1: valid. */
    uly_attn_args a = good_args();
    a.kv_group = 3;
    uly_status st = uly_attn_check(&a, 1);
    CHECK(st.code == ULY_OK, "%s", st.msg);
}

TEST(attn_check_accepts_the_last_head_slice_int64_can_number) {
    /* q_head0 + q.h == INT64_MAX, one kv head a query head */
    uly_attn_args a = good_args();
    a.k = a.v = a.q, a.dk = a.dv = a.dq;
    a.kv_group = 1, a.q_head0 = INT64_MAX - AH;
    uly_status st = uly_attn_check(&a, 1);
    CHECK(st.code == ULY_OK, "%s", st.msg);
}

TEST(attn_check_rejects_each_broken_contract_rule_with_its_field) {
    uly_attn_args ok = good_args();
    uly_status st = uly_attn_check(&ok, 1);
    CHECK(st.code == ULY_OK, "the base args: %s", st.msg);
    for (int i = 0; i < (int)(sizeof attn_table / sizeof *attn_table); i++) {
        uly_attn_args a = good_args();
        break_args(&a, i);
        check_status("uly_attn_check", uly_attn_check(&a, attn_table[i].backward),
                     attn_table[i].code, attn_table[i].field, attn_table[i].what);
    }
}

TEST(cpu_attention_refuses_a_broken_contract_instead_of_reading_out_of_bounds) {
    uly_attn attn = uly_cpu_attention();
    uly_attn_args a = good_args();
    a.k.h = 3, a.v.h = 3;
    check_status(NULL, attn.fwd(attn.ctx, &a), ULY_EINVAL, "k.h", "fwd with k.h = 3");
    check_status(NULL, attn.bwd(attn.ctx, &a), ULY_EINVAL, "k.h", "bwd with k.h = 3");
}

/* A workspace sized for other args (here: fewer keys) is refused, not overrun. */
TEST(cpu_attention_sizes_no_workspace_for_null_args) {
    const uly_attn attn = uly_cpu_attention();
    CHECK(attn.workspace(attn.ctx, NULL) == -1, "%lld", (long long)attn.workspace(attn.ctx, NULL));
}

TEST(cpu_attention_refuses_a_workspace_smaller_than_its_args_need) {
    uly_attn attn = uly_cpu_attention();
    uly_attn_args a = good_args(), fewer = good_args();
    fewer.k.s = fewer.v.s = AS - 1;
    a.workspace_bytes = attn.workspace(attn.ctx, &fewer);
    a.workspace = malloc((size_t)a.workspace_bytes);
    CHECK(a.workspace_bytes < attn.workspace(attn.ctx, &a), "sizes %lld, %lld",
          (long long)a.workspace_bytes, (long long)attn.workspace(attn.ctx, &a));
    check_status(NULL, attn.fwd(attn.ctx, &a), ULY_EINVAL, "workspace_bytes",
                 "fwd, 4 keys' workspace");
    check_status(NULL, attn.bwd(attn.ctx, &a), ULY_EINVAL, "workspace_bytes",
                 "bwd, 4 keys' workspace");
    free(a.workspace);
}

/* ---------------------------------------------------------------------------------------------
   uly_layer_agree: three ranks, one of which builds its layer with one field changed, or whose
   plan is broken or another communicator's. Every rank must fail: a rank unlike rank 0 names the
   field with both values (when rank 0 is the odd one, both others do), a rank with a broken
   layer says so, the rest count the ranks that failed. */

enum { A_CAUSAL = P_MAXB + 1, A_SCALE, A_EDIT, A_NONE };

typedef struct agree_row {
    const char *what;
    int who;             /* the rank that builds another layer */
    int f;               /* an enum pfield, A_CAUSAL, A_SCALE or A_EDIT (the plan after init) */
    int64_t v;           /* the value of a pfield or of causal */
    float scale;         /* A_SCALE's */
    int odd;             /* the ranks (bits) whose message says what differs */
    const char *mine, *first; /* in theirs (first NULL: no second part); NULL: layers agree */
    const char *count;        /* in the other ranks' message */
} agree_row;

/* 2^53 + 1 rounds to 2^53 as a double: only exact integers tell them apart. */
#define TWO53 ((int64_t)1 << 53)

static const agree_row agree_table[] = {
    {"the same layer", 1, A_NONE, 0, 0, 0, NULL, NULL, NULL},
    {"scale 0.25 given, the others' 0 (1/sqrt(16))", 1, A_SCALE, 0, 0.25f, 0, NULL, NULL, NULL},
    {"seq_len 17 on rank 2", 2, P_S, 17, 0, 4, "seq_len is 17 on this rank (sp rank 2)",
     ", 16 on sp rank 0", "1 of 3 sp ranks"},
    {"seq_len 17 on rank 0", 0, P_S, 17, 0, 6, "seq_len is 16 on this rank", ", 17 on sp rank 0",
     "2 of 3 sp ranks"},
    {"batch 3 on rank 1", 1, P_B, 3, 0, 2, "batch is 3 on this rank", ", 2 on", "1 of 3"},
    {"n_heads 12 on rank 2", 2, P_H, 12, 0, 4, "n_heads is 12 on this rank", ", 6 on", "1 of 3"},
    {"n_kv_heads 6 on rank 1", 1, P_HKV, 6, 0, 2, "n_kv_heads is 6 on this rank", ", 3 on",
     "1 of 3"},
    /* the default scale differs too, but head_dim comes first */
    {"head_dim 32 on rank 1", 1, P_D, 32, 0, 2, "head_dim is 32 on this rank", ", 16 on",
     "1 of 3"},
    {"dtype f16 on rank 1", 1, P_DTYPE, ULY_F16, 0, 2, "dtype is f16 on this rank", ", bf16 on",
     "1 of 3"},
    {"world_size 6 on rank 2", 2, P_WORLD, 6, 0, 4, "world_size is 6 on this rank", ", 3 on",
     "1 of 3"},
    {"max_bytes 2^53 + 1 on rank 1", 1, P_MAXB, TWO53 + 1, 0, 2,
     "max_bytes is 9007199254740993 on this rank", ", 9007199254740992 on", "1 of 3"},
    {"max_bytes 2^53 + 1 on rank 0", 0, P_MAXB, TWO53 + 1, 0, 6,
     "max_bytes is 9007199254740992 on this rank", ", 9007199254740993 on", "2 of 3"},
    {"causal 0 on rank 2", 2, A_CAUSAL, 0, 0, 4, "causal is 0 on this rank", ", 1 on", "1 of 3"},
    {"causal 2 on rank 1: true, as the others' 1", 1, A_CAUSAL, 2, 0, 0, NULL, NULL, NULL},
    /* values whose low 32 bits have the top one set travel whole */
    {"scale -0.5 on rank 0", 0, A_SCALE, 0, -0.5f, 6, "softmax_scale is 0.25 on this rank",
     ", -0.5 on sp rank 0", "2 of 3"},
    {"max_bytes 3 x 2^30 on rank 0", 0, P_MAXB, (int64_t)3 << 30, 0, 6,
     "max_bytes is 9007199254740992 on this rank", ", 3221225472 on sp rank 0", "2 of 3"},
    {"scale 0.3 on rank 1", 1, A_SCALE, 0, 0.3f, 2, "softmax_scale is 0.3 on this rank",
     ", 0.25 on", "1 of 3"},
    /* sp_size 1 in a world of 3: a valid plan, but not for a communicator of 3 */
    {"sp_size 1 on rank 2", 2, P_SP, 1, 0, 4, "layer.comm is rank 2 of 3, the plan's sp rank 0 "
     "of 1", NULL, "1 of 3"},
    {"sp_size 1 on rank 0", 0, P_SP, 1, 0, 1, "layer.comm is rank 0 of 3, the plan's sp rank 0 "
     "of 1", NULL, "sp rank 0 has no valid layer"},
    {"rank 1's plan made for rank 0", 1, P_RANK, 0, 0, 2, "layer.comm is rank 1 of 3, the plan's "
     "sp rank 0 of 3", NULL, "1 of 3"},
    {"rank 2's plan edited after init", 2, A_EDIT, 0, 0, 4, "layer.plan is NULL or not as",
     NULL, "1 of 3"},
    {"rank 0's plan edited after init", 0, A_EDIT, 0, 0, 1, "layer.plan is NULL or not as",
     NULL, "sp rank 0 has no valid layer"},
};

typedef struct agree_run {
    const agree_row *row;
    uly_status st[3];
} agree_run;

static void agree_rank(const uly_comm *c, void *user) {
    agree_run *run = (agree_run *)user;
    const agree_row *row = run->row;
    const int odd = c->rank == row->who;
    uly_plan_desc d = {.world_size = 3, .rank = c->rank, .sp_size = 3, .batch = 2,
                       .seq_len = 16, .n_heads = 6, .n_kv_heads = 3, .head_dim = 16,
                       .dtype = ULY_BF16, .max_bytes = TWO53};
    uly_layer l = {.comm = c, .causal = 1};
    if (odd && row->f <= P_MAXB) set_field(&d, (enum pfield)row->f, row->v);
    if (odd && row->f == A_CAUSAL) l.causal = (int)row->v;
    if (odd && row->f == A_SCALE) l.softmax_scale = row->scale;
    uly_plan p;
    run->st[c->rank] = uly_plan_init(&p, &d);
    if (odd && row->f == A_EDIT) p.desc.seq_len = 17;
    l.plan = &p;
    if (!run->st[c->rank].code) run->st[c->rank] = uly_layer_agree(&l);
}

TEST(layer_agree_fails_on_every_rank_and_each_odd_one_says_why) {
    for (size_t i = 0; i < sizeof agree_table / sizeof *agree_table; i++) {
        const agree_row *row = &agree_table[i];
        agree_run run = {.row = row};
        uly_status st = uly_local_run(3, agree_rank, &run);
        CHECK(st.code == ULY_OK, "%s: local_run: %s", row->what, st.msg);
        for (int r = 0; r < 3; r++) {
            const uly_status got = run.st[r];
            if (!row->mine) {
                CHECK(got.code == ULY_OK, "%s: rank %d: %s", row->what, r, got.msg);
            } else if (row->odd >> r & 1) {
                check_status("uly_layer_agree", got, ULY_EINVAL, row->mine, row->what);
                if (row->first)
                    check_status("uly_layer_agree", got, ULY_EINVAL, row->first, row->what);
            } else {
                check_status("uly_layer_agree", got, ULY_EINVAL, row->count, row->what);
            }
        }
    }
}

static void agree_alone(const uly_comm *c, void *user) {
    uly_status *st = (uly_status *)user + 3 * c->rank;
    uly_plan p;
    uly_plan_desc d = {.world_size = 2, .rank = c->rank, .sp_size = 2, .batch = 1, .seq_len = 6,
                       .n_heads = 2, .head_dim = 8};
    uly_layer l = {.plan = &p, .comm = NULL};
    uly_comm no_sum = *c;
    no_sum.allreduce_sum = NULL;
    uly_plan_init(&p, &d);
    st[0] = uly_layer_agree(NULL);
    st[1] = uly_layer_agree(&l);
    l.comm = &no_sum;
    st[2] = uly_layer_agree(&l);
}

/* What cannot call the communicator returns at once, on one rank (its peers would wait). */
TEST(layer_agree_without_a_communicator_to_call_returns_at_once) {
    uly_status st[2][3];
    CHECK(uly_local_run(2, agree_alone, st).code == ULY_OK, "local_run");
    for (int r = 0; r < 2; r++) {
        check_status("uly_layer_agree", st[r][0], ULY_EINVAL, "layer is NULL", "layer NULL");
        check_status("uly_layer_agree", st[r][1], ULY_EINVAL, "layer.comm is NULL", "comm NULL");
        check_status("uly_layer_agree", st[r][2], ULY_EINVAL, "allreduce_sum is NULL",
                     "allreduce_sum NULL");
    }
}

/* ---------------------------------------------------------------------------------------------
   uly_cross_entropy and uly_local_run */

TEST(cross_entropy_rejects_a_label_out_of_the_vocabulary) {
    float logits[3 * 4] = {0};
    int32_t high[3] = {0, 4, 1}, low[3] = {0, -7, 1};
    double sum = 0;
    int64_t count = 0;
    check_status("uly_cross_entropy",
                 uly_cross_entropy(logits, high, 3, 4, -100, &sum, &count, NULL), ULY_EINVAL,
                 "label", "label 4 with v = 4");
    check_status("uly_cross_entropy",
                 uly_cross_entropy(logits, low, 3, 4, -100, &sum, &count, NULL), ULY_EINVAL,
                 "label", "label -7 that is not ignore_index");
}

TEST(cross_entropy_of_no_token_takes_null_buffers) {
    double sum = 0;
    int64_t count = 0;
    uly_status st = uly_cross_entropy(NULL, NULL, 0, 4, -100, &sum, &count, NULL);
    CHECK(st.code == ULY_OK && sum == 0 && count == 0, "n = 0: %s, sum %g, count %lld", st.msg,
          sum, (long long)count);
}

TEST(cross_entropy_rejects_null_logits) {
    int32_t labels[1] = {0};
    double sum = 0;
    int64_t count = 0;
    check_status("uly_cross_entropy",
                 uly_cross_entropy(NULL, labels, 1, 4, -100, &sum, &count, NULL), ULY_EINVAL,
                 "logits", "logits NULL");
}

/* ---------------------------------------------------------------------------------------------
   An exchange that fails: its error comes back, whichever of a pass's four exchanges it is */

typedef struct failing_comm {
    const uly_comm *inner;
    int calls, fail_at; /* the alltoallv call that fails, counting from 1 */
} failing_comm;

static uly_status failing_a2a(void *ctx, const void *s, const int64_t *sc, const int64_t *so,
                              void *r, const int64_t *rc, const int64_t *ro, void *stream) {
    failing_comm *f = (failing_comm *)ctx;
    if (++f->calls == f->fail_at) return uly__err(ULY_ECOMM, "exchange %d fails", f->calls);
    return f->inner->alltoallv(f->inner->ctx, s, sc, so, r, rc, ro, stream);
}

typedef struct fail_at_run {
    uly_status st[2][4]; /* forward, backward; the exchange that failed */
} fail_at_run;

/* One rank, B 2 (every exchange packs or unpacks), over a comm that fails on call n. */
static void fail_at_main(const uly_comm *c, void *user) {
    fail_at_run *run = (fail_at_run *)user;
    uly_plan p;
    uly_plan_desc d = {.world_size = 1, .sp_size = 1, .batch = 2, .seq_len = 4, .n_heads = 2,
                       .n_kv_heads = 1, .head_dim = 4};
    static float x[8][2 * 4 * 2 * 4]; /* q, k, v, out, dout, dq, dk, dv */
    failing_comm f = {c, 0, 0};
    uly_comm comm = *c;
    comm.alltoallv = failing_a2a, comm.ctx = &f;
    uly_plan_init(&p, &d);
    uly_layer L = {.plan = &p, .comm = &comm, .attn = uly_cpu_attention(),
                   .layout = uly_cpu_layout()};
    L.workspace_bytes = uly_layer_workspace(&L);
    L.workspace = malloc((size_t)L.workspace_bytes);
    const int64_t ns = uly_saved_bytes(&p);
    void *saved = malloc((size_t)ns);
    uly_tensor t[8];
    for (int i = 0; i < 8; i++) /* k, v, dk, dv have the one kv head */
        t[i] = uly_dense(x[i], ULY_F32, 2, 4, i == 1 || i == 2 || i >= 6 ? 1 : 2, 4);
    for (int backward = 0; backward < 2; backward++)
        for (int n = 1; n <= 4; n++) {
            f.calls = 0, f.fail_at = backward ? 0 : n;
            uly_status st = uly_forward(&L, t[0], t[1], t[2], t[3], saved, ns);
            if (backward && !st.code) {
                f.calls = 0, f.fail_at = n;
                st = uly_backward(&L, t[4], saved, ns, t[5], t[6], t[7]);
            }
            run->st[backward][n - 1] = st;
        }
    free(saved), free(L.workspace);
}

TEST(an_error_from_any_exchange_of_a_pass_comes_back) {
    fail_at_run run;
    memset(&run, 0, sizeof run);
    CHECK(uly_local_run(1, fail_at_main, &run).code == ULY_OK, "local_run");
    for (int backward = 0; backward < 2; backward++)
        for (int n = 1; n <= 4; n++) {
            char says[32], what[32];
            snprintf(says, sizeof says, "exchange %d fails", n);
            snprintf(what, sizeof what, "%s, exchange %d", backward ? "backward" : "forward", n);
            check_status(backward ? "uly_backward" : "uly_forward", run.st[backward][n - 1],
                         ULY_ECOMM, says, what);
        }
}

static void never_run(const uly_comm *c, void *u) {
    (void)c;
    (*(int *)u)++;
}

TEST(local_run_rejects_size_0_and_negative_and_above_ULY_MAX_SP) {
    int runs = 0;
    check_status("uly_local_run", uly_local_run(0, never_run, &runs), ULY_EINVAL, "size", "size 0");
    check_status("uly_local_run", uly_local_run(-3, never_run, &runs), ULY_EINVAL, "size",
                 "size -3");
    check_status("uly_local_run", uly_local_run(ULY_MAX_SP + 1, never_run, &runs), ULY_EINVAL,
                 "size", "size ULY_MAX_SP + 1");
    CHECK(runs == 0, "fn ran %d times", runs);
}

/* send is NULL with nothing to send, recv is NULL with bytes to receive: recv is the one. */
static void null_recv(const uly_comm *c, void *user) {
    const int64_t none = 0, eight = 8;
    *(uly_status *)user = c->alltoallv(c->ctx, NULL, &none, &none, NULL, &eight, &none, NULL);
}

TEST(local_alltoallv_names_the_null_buffer_that_has_bytes) {
    uly_status got;
    uly_status st = uly_local_run(1, null_recv, &got);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    check_status(NULL, got, ULY_EINVAL, "recv is NULL", "recv NULL with 8 bytes");
}

static void null_offsets(const uly_comm *c, void *user) {
    const int64_t eight = 8, none = 0;
    char buf[8] = {0}, out[8];
    *(uly_status *)user = c->alltoallv(c->ctx, buf, &eight, NULL, out, &eight, &none, NULL);
}

TEST(local_alltoallv_rejects_null_offsets) {
    uly_status got;
    CHECK(uly_local_run(1, null_offsets, &got).code == ULY_OK, "local_run");
    check_status(NULL, got, ULY_EINVAL, "a count or offset array is NULL", "send_offs NULL");
}

/* Rank 0's send blocks are buf[0, 4) and buf[8, 12); its recv buffer starts recv_at bytes into
   buf, blocks at 0 and 8 (gap 1) or 0 and 4: the bytes from its first block's start to its last
   block's end must be apart from send's, which is what MPI and NCCL require. Rank 1 has buffers
   of its own. */
typedef struct in_place_job {
    int recv_at, gap;
    uly_status st[2];
} in_place_job;
static void in_place(const uly_comm *c, void *user) {
    in_place_job *j = (in_place_job *)user;
    char buf[32] = {0}, mine[16] = {0}, theirs[16];
    const int64_t cnt[2] = {4, 4}, so[2] = {0, 8}, ro[2] = {0, j->gap ? 8 : 4};
    if (c->rank == 0)
        j->st[0] = c->alltoallv(c->ctx, buf, cnt, so, buf + j->recv_at, cnt, ro, NULL);
    else
        j->st[1] = c->alltoallv(c->ctx, mine, cnt, so, theirs, cnt, ro, NULL);
}

TEST(local_alltoallv_refuses_send_and_recv_that_overlap) {
    static const struct {
        int recv_at, gap;
        const char *says; /* NULL: it runs */
    } cases[] = {{12, 0, NULL}, /* recv [12, 20) right after send's [0, 12) */
                 {11, 0, "send[0, 12) and recv[0, 8) overlap"},
                 {4, 1, "send[0, 12) and recv[0, 12) overlap"}}; /* in send's gap */
    for (int i = 0; i < 3; i++) {
        in_place_job j;
        memset(&j, 0, sizeof j);
        j.recv_at = cases[i].recv_at, j.gap = cases[i].gap;
        CHECK(uly_local_run(2, in_place, &j).code == ULY_OK, "local_run");
        if (!cases[i].says) {
            CHECK(!j.st[0].code && !j.st[1].code, "recv at %d: '%s', '%s'", j.recv_at,
                  j.st[0].msg, j.st[1].msg);
            continue;
        }
        check_status(NULL, j.st[0], ULY_EINVAL, cases[i].says, "rank 0");
        check_status(NULL, j.st[1], ULY_ECOMM, "rank 0 failed", "rank 1");
    }
}

/* Rank 1 returns at once; rank 0's barrier, before or after that, fails instead of waiting. */
static void barrier_alone(const uly_comm *c, void *user) {
    if (c->rank == 0) *(uly_status *)user = c->barrier(c->ctx);
}

TEST(local_barrier_fails_once_a_peer_has_returned) {
    uly_status got;
    CHECK(uly_local_run(2, barrier_alone, &got).code == ULY_OK, "local_run");
    check_status(NULL, got, ULY_ECOMM, "rank 1 has returned", "barrier without rank 1");
}

/* Ranks that sum 4 and 2 values: both fail, and neither buffer is touched (each holds only its
   own count). */
typedef struct count_run {
    double *buf[2];
    uly_status st[2];
} count_run;

static void sum_4_and_2(const uly_comm *c, void *user) {
    count_run *run = (count_run *)user;
    run->st[c->rank] = c->allreduce_sum(c->ctx, run->buf[c->rank], c->rank ? 2 : 4, NULL);
}

TEST(local_allreduce_of_counts_that_differ_fails_every_rank_and_sums_nothing) {
    count_run run;
    memset(&run, 0, sizeof run);
    run.buf[0] = (double *)malloc(4 * sizeof(double));
    run.buf[1] = (double *)malloc(2 * sizeof(double));
    for (int i = 0; i < 4; i++) run.buf[0][i] = 1;
    for (int i = 0; i < 2; i++) run.buf[1][i] = 2;
    CHECK(uly_local_run(2, sum_4_and_2, &run).code == ULY_OK, "local_run");
    for (int r = 0; r < 2; r++)
        check_status(NULL, run.st[r], ULY_ECOMM, "sums", r ? "rank 1" : "rank 0");
    int touched = 0;
    for (int i = 0; i < 4; i++) touched += run.buf[0][i] != 1;
    for (int i = 0; i < 2; i++) touched += run.buf[1][i] != 2;
    CHECK(!touched, "%d elements changed", touched);
    free(run.buf[0]), free(run.buf[1]);
}

TEST(local_run_rejects_a_null_function) {
    check_status("uly_local_run", uly_local_run(2, NULL, NULL), ULY_EINVAL, "fn", "fn NULL");
}

/* Rank 0 gives up (a bad allreduce), rank 1's allreduce fails; then rank 0 tries again. A
   broken world completes no collective, however many ranks arrive: this one would otherwise
   count rank 1's old arrival and sum rank 1's buffer after rank 1 took it back. */
typedef struct broken_world {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int rank1_failed;
    double buf[2][4];
    uly_status first[2], retry;
} broken_world;

static void give_up_then_retry(const uly_comm *c, void *user) {
    broken_world *w = (broken_world *)user;
    double *buf = w->buf[c->rank];
    w->first[c->rank] = c->allreduce_sum(c->ctx, buf, c->rank ? 4 : -1, NULL);
    pthread_mutex_lock(&w->mu);
    if (c->rank) w->rank1_failed = 1, pthread_cond_signal(&w->cv);
    while (!w->rank1_failed) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    if (!c->rank) w->retry = c->allreduce_sum(c->ctx, buf, 4, NULL);
}

TEST(local_comm_after_a_rank_gives_up_every_collective_fails_and_reads_no_peer) {
    broken_world w = {.rank1_failed = 0};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    for (int i = 0; i < 4; i++) w.buf[0][i] = 1, w.buf[1][i] = 2;
    uly_status st = uly_local_run(2, give_up_then_retry, &w);
    CHECK(st.code == ULY_OK, "local_run: %s", st.msg);
    check_status(NULL, w.first[0], ULY_EINVAL, "n (-1)", "rank 0's bad allreduce");
    check_status(NULL, w.first[1], ULY_ECOMM, "rank 0 failed", "rank 1's allreduce");
    check_status(NULL, w.retry, ULY_ECOMM, "rank 0 failed", "rank 0's retry");
    for (int i = 0; i < 4; i++)
        CHECK(w.buf[0][i] == 1 && w.buf[1][i] == 2, "element %d summed: %g, %g", i, w.buf[0][i],
              w.buf[1][i]);
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
}

int main(void) { return uly_run_tests(); }
