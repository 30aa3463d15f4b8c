/* test_plan.c - the plan: who owns which tokens and heads, and how many bytes each exchange moves.

   Every property is checked over a sweep of shapes (B in {1,2,3}; S with primes and S = P;
   H = Hkv * g for group sizes 1, 2, 4, 8; P from 1 to 8; worlds of 1 and 2 SP groups) against
   the plan's formulas, written out here:
       S_r = S/P + (r < S%P),  s0_r = sum of S_q for q < r        (same for heads)
       kv heads of r: [h0_r / g, (h0_r + H_r - 1) / g]
       sp_rank = rank % P, dp_rank = rank / P
       bytes, per tensor:  Q   send to j  B*S_r*H_j*D*e,    recv from j  B*S_j*H_r*D*e
                           KV  send to j  B*S_r*Hkv_j*D*e,  recv from j  B*S_j*Hkv_r*D*e
                           O and DKV are the exact inverses of Q and KV. */
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"

/* ---------------------------------------------------------------------------------------------
   The formulas */

static int64_t f_count(int64_t n, int P, int r) { return n / P + (r < n % P); }
static int64_t f_start(int64_t n, int P, int r) {
    int64_t s = 0;
    for (int q = 0; q < r; q++) s += f_count(n, P, q);
    return s;
}
static int64_t f_kv_first(int64_t H, int64_t g, int P, int r) { return f_start(H, P, r) / g; }
static int64_t f_kv_count(int64_t H, int64_t g, int P, int r) {
    return (f_start(H, P, r) + f_count(H, P, r) - 1) / g - f_kv_first(H, g, P, r) + 1;
}

/* Expected per-tensor bytes that SP rank `me` sends to (send = 1) or receives from peer j. */
static int64_t f_bytes(const uly_plan_desc *d, uly_xchg x, int me, int j, int send) {
    int P = d->sp_size;
    int64_t H = d->n_heads, g = H / d->n_kv_heads, e = d->dtype == ULY_F32 ? 4 : 2;
    int seq_to_head = x == ULY_X_Q || x == ULY_X_KV;
    int kv = x == ULY_X_KV || x == ULY_X_DKV;
    /* seq->head: the sender's tokens, the receiver's heads; head->seq the other way round. */
    int tok_rank = seq_to_head == send ? me : j, head_rank = seq_to_head == send ? j : me;
    int64_t heads = kv ? f_kv_count(H, g, P, head_rank) : f_count(H, P, head_rank);
    return d->batch * f_count(d->seq_len, P, tok_rank) * heads * d->head_dim * e;
}

/* ---------------------------------------------------------------------------------------------
   The sweep */

typedef struct sweep {
    uly_plan_desc d;
    int dp;
} sweep;

/* Calls fn on every shape of the sweep, with a count of its failed checks (SWEEP_CHECK); returns
   how many shapes it visited. */
static int each_shape(void (*fn)(const sweep *s, int *bad)) {
    static const int64_t Ss[] = {1, 2, 3, 5, 7, 8, 13, 31, 64, 67};
    static const int64_t Hkvs[] = {1, 2, 3, 5, 8};
    static const int64_t gs[] = {1, 2, 4, 8};
    static const uly_dtype dts[] = {ULY_F32, ULY_BF16, ULY_F16};
    int n = 0, bad = 0;
    for (int P = 1; P <= 8; P++)
        for (int64_t B = 1; B <= 3; B++)
            for (size_t si = 0; si < sizeof Ss / sizeof *Ss + 1; si++)
                for (size_t ki = 0; ki < sizeof Hkvs / sizeof *Hkvs; ki++)
                    for (size_t gi = 0; gi < sizeof gs / sizeof *gs; gi++)
                        for (int dp = 1; dp <= 2; dp++) {
                            int64_t S = si < sizeof Ss / sizeof *Ss ? Ss[si] : P; /* S = P */
                            int64_t H = Hkvs[ki] * gs[gi];
                            if (S < P || H < P) continue;
                            sweep s;
                            memset(&s, 0, sizeof s);
                            s.dp = dp;
                            s.d.world_size = P * dp;
                            s.d.sp_size = P;
                            s.d.batch = B;
                            s.d.seq_len = S;
                            s.d.n_heads = H;
                            s.d.n_kv_heads = Hkvs[ki];
                            s.d.head_dim = (B + S) % 2 ? 8 : 16;
                            s.d.dtype = dts[(P + S + H) % 3];
                            fn(&s, &bad);
                            n++;
                        }
    return n;
}

#define SHAPE_FMT "P=%d B=%lld S=%lld H=%lld Hkv=%lld D=%lld world=%d"
#define SHAPE_ARGS(d)                                                                          \
    (d)->sp_size, (long long)(d)->batch, (long long)(d)->seq_len, (long long)(d)->n_heads,    \
        (long long)(d)->n_kv_heads, (long long)(d)->head_dim, (d)->world_size

/* A check inside the sweep: reports the first few failures with their shape. */
#define SWEEP_CHECK(cond, d, ...)                                                              \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            (*bad)++;                                                                          \
            CHECK(*bad > 5 || (cond), SHAPE_FMT ": " __VA_ARGS__);                             \
        }                                                                                      \
    } while (0)

static int plan_for(const uly_plan_desc *d, int rank, uly_plan *p) {
    uly_plan_desc dd = *d;
    dd.rank = rank;
    return uly_plan_init(p, &dd).code;
}

/* ---------------------------------------------------------------------------------------------
   Tests */

static void every_shape_is_accepted(const sweep *s, int *bad) {
    for (int rank = 0; rank < s->d.world_size; rank++) {
        uly_plan p;
        uly_plan_desc dd = s->d;
        dd.rank = rank;
        uly_status st = uly_plan_init(&p, &dd);
        SWEEP_CHECK(st.code == ULY_OK, &s->d, "rank %d: %s", SHAPE_ARGS(&s->d), rank, st.msg);
    }
}
TEST(plan_accepts_every_valid_shape_of_the_sweep) {
    int n = each_shape(every_shape_is_accepted);
    CHECK(n > 1000, "the sweep visited only %d shapes", n);
}

static void sp_and_dp_ranks(const sweep *s, int *bad) {
    for (int rank = 0; rank < s->d.world_size; rank++) {
        uly_plan p;
        if (plan_for(&s->d, rank, &p)) continue;
        SWEEP_CHECK(p.sp_rank == rank % s->d.sp_size && p.dp_rank == rank / s->d.sp_size, &s->d,
                    "rank %d: sp_rank %d dp_rank %d", SHAPE_ARGS(&s->d), rank, p.sp_rank,
                    p.dp_rank);
    }
}
TEST(sp_rank_is_rank_mod_P_and_dp_rank_is_rank_div_P) { each_shape(sp_and_dp_ranks); }

static void desc_filled_in(const sweep *s, int *bad) {
    uly_plan p;
    if (plan_for(&s->d, 0, &p)) return;
    int64_t e = s->d.dtype == ULY_F32 ? 4 : 2;
    SWEEP_CHECK(p.group == s->d.n_heads / s->d.n_kv_heads && p.elem_size == e &&
                    p.desc.n_kv_heads == s->d.n_kv_heads && p.desc.seq_len == s->d.seq_len,
                &s->d, "group %lld elem_size %lld", SHAPE_ARGS(&s->d), (long long)p.group,
                (long long)p.elem_size);
}
TEST(plan_records_group_size_and_element_size) { each_shape(desc_filled_in); }

TEST(n_kv_heads_0_means_n_heads) {
    uly_plan p;
    uly_plan_desc d = {.world_size = 2, .rank = 1, .sp_size = 2, .batch = 1, .seq_len = 9,
                       .n_heads = 6, .n_kv_heads = 0, .head_dim = 8, .dtype = ULY_F32};
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(p.desc.n_kv_heads == 6, "n_kv_heads filled in as %lld", (long long)p.desc.n_kv_heads);
    CHECK(p.group == 1, "group %lld", (long long)p.group);
    uly_range kv = uly_kv_heads(&p, 1);
    CHECK(kv.start == 3 && kv.count == 3, "kv heads of rank 1: [%lld, +%lld)",
          (long long)kv.start, (long long)kv.count);
}

/* The ranges range(p, r) of the P ranks split [0, n) in rank order, none empty, and rank r's is
   [f_start(n, P, r), +f_count(n, P, r)). */
static void check_split(const sweep *s, int *bad, const char *what,
                        uly_range (*range)(const uly_plan *, int), int64_t n) {
    uly_plan p;
    if (plan_for(&s->d, 0, &p)) return;
    int P = s->d.sp_size;
    int64_t next = 0;
    for (int r = 0; r < P; r++) {
        uly_range t = range(&p, r);
        SWEEP_CHECK(t.start == next && t.count >= 1, &s->d, "rank %d %s [%lld,+%lld) after %lld",
                    SHAPE_ARGS(&s->d), r, what, (long long)t.start, (long long)t.count,
                    (long long)next);
        SWEEP_CHECK(t.count == f_count(n, P, r) && t.start == f_start(n, P, r), &s->d,
                    "rank %d %s [%lld,+%lld) against the formula", SHAPE_ARGS(&s->d), r, what,
                    (long long)t.start, (long long)t.count);
        next = t.start + t.count;
    }
    SWEEP_CHECK(next == n, &s->d, "%s end at %lld, not %lld", SHAPE_ARGS(&s->d), what,
                (long long)next, (long long)n);
}

static void token_ranges(const sweep *s, int *bad) {
    check_split(s, bad, "tokens", uly_tokens, s->d.seq_len);
}
TEST(token_ranges_partition_the_sequence_in_rank_order_by_the_formula) { each_shape(token_ranges); }

static void head_ranges(const sweep *s, int *bad) {
    check_split(s, bad, "heads", uly_heads, s->d.n_heads);
}
TEST(head_ranges_partition_the_query_heads_in_rank_order_by_the_formula) {
    each_shape(head_ranges);
}

static void kv_heads(const sweep *s, int *bad) {
    uly_plan p;
    if (plan_for(&s->d, 0, &p)) return;
    int P = s->d.sp_size;
    int64_t g = s->d.n_heads / s->d.n_kv_heads;
    for (int r = 0; r < P; r++) {
        uly_range h = uly_heads(&p, r), kv = uly_kv_heads(&p, r);
        SWEEP_CHECK(kv.start == f_kv_first(s->d.n_heads, g, P, r) &&
                        kv.count == f_kv_count(s->d.n_heads, g, P, r),
                    &s->d, "rank %d kv heads [%lld,+%lld)", SHAPE_ARGS(&s->d), r,
                    (long long)kv.start, (long long)kv.count);
        for (int64_t qh = h.start; qh < h.start + h.count; qh++)
            SWEEP_CHECK(qh / g >= kv.start && qh / g < kv.start + kv.count, &s->d,
                        "rank %d: query head %lld needs kv head %lld, not in [%lld,+%lld)",
                        SHAPE_ARGS(&s->d), r, (long long)qh, (long long)(qh / g),
                        (long long)kv.start, (long long)kv.count);
        SWEEP_CHECK(kv.start >= 0 && kv.start + kv.count <= s->d.n_kv_heads, &s->d,
                    "rank %d kv heads out of [0, Hkv)", SHAPE_ARGS(&s->d), r);
    }
}
TEST(every_query_head_finds_its_kv_head_on_its_rank) { each_shape(kv_heads); }

static void kv_covered(const sweep *s, int *bad) {
    uly_plan p;
    if (plan_for(&s->d, 0, &p)) return;
    /* Every kv head is needed by some rank, and the union of the ranges is [0, Hkv). */
    for (int64_t kh = 0; kh < s->d.n_kv_heads; kh++) {
        int found = 0;
        for (int r = 0; r < s->d.sp_size; r++) {
            uly_range kv = uly_kv_heads(&p, r);
            found += kh >= kv.start && kh < kv.start + kv.count;
        }
        SWEEP_CHECK(found >= 1, &s->d, "kv head %lld is on no rank", SHAPE_ARGS(&s->d),
                    (long long)kh);
    }
}
TEST(every_kv_head_is_held_by_at_least_one_rank) { each_shape(kv_covered); }

static const uly_xchg all_x[4] = {ULY_X_Q, ULY_X_KV, ULY_X_O, ULY_X_DKV};
static const char *x_name[4] = {"Q", "KV", "O", "DKV"};

typedef struct counts {
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
} counts;

static void bytes_balance(const sweep *s, int *bad) {
    int P = s->d.sp_size;
    static counts c[2][8]; /* [dp group][sp rank]; P <= 8 in the sweep */
    uly_plan p[2][8];
    for (int x = 0; x < 4; x++) {
        for (int rank = 0; rank < s->d.world_size; rank++) {
            int dp = rank / P, sp = rank % P;
            if (plan_for(&s->d, rank, &p[dp][sp])) return;
            uly_exchange_counts(&p[dp][sp], all_x[x], c[dp][sp].sc, c[dp][sp].so, c[dp][sp].rc,
                                c[dp][sp].ro);
        }
        for (int dp = 0; dp < s->dp; dp++)
            for (int i = 0; i < P; i++)
                for (int j = 0; j < P; j++)
                    SWEEP_CHECK(c[dp][i].sc[j] == c[dp][j].rc[i], &s->d,
                                "%s: rank %d sends %lld bytes to %d, which expects %lld",
                                SHAPE_ARGS(&s->d), x_name[x], i, (long long)c[dp][i].sc[j], j,
                                (long long)c[dp][j].rc[i]);
    }
}
TEST(bytes_sent_from_i_to_j_equal_bytes_j_receives_from_i_for_every_exchange) {
    each_shape(bytes_balance);
}

/* Calls fn with the counts of every exchange on every rank of the first SP group. */
static void each_exchange(const sweep *s, int *bad,
                          void (*fn)(const sweep *s, int *bad, const uly_plan *p, int x,
                                     const counts *c)) {
    for (int r = 0; r < s->d.sp_size; r++) {
        uly_plan p;
        counts c;
        if (plan_for(&s->d, r, &p)) return;
        for (int x = 0; x < 4; x++) {
            uly_exchange_counts(&p, all_x[x], c.sc, c.so, c.rc, c.ro);
            fn(s, bad, &p, x, &c);
        }
    }
}

static void bytes_formula(const sweep *s, int *bad, const uly_plan *p, int x, const counts *c) {
    int r = p->sp_rank;
    for (int j = 0; j < s->d.sp_size; j++) {
        int64_t ws = f_bytes(&s->d, all_x[x], r, j, 1), wr = f_bytes(&s->d, all_x[x], r, j, 0);
        SWEEP_CHECK(c->sc[j] == ws && c->rc[j] == wr, &s->d,
                    "%s rank %d peer %d: send %lld (want %lld) recv %lld (want %lld)",
                    SHAPE_ARGS(&s->d), x_name[x], r, j, (long long)c->sc[j], (long long)ws,
                    (long long)c->rc[j], (long long)wr);
    }
}
static void bytes_formulas(const sweep *s, int *bad) { each_exchange(s, bad, bytes_formula); }
TEST(byte_counts_are_batch_tokens_heads_headdim_elemsize_of_the_blocks) {
    each_shape(bytes_formulas);
}

static void offsets(const sweep *s, int *bad, const uly_plan *p, int x, const counts *c) {
    int r = p->sp_rank;
    int64_t so = 0, ro = 0;
    for (int j = 0; j < s->d.sp_size; j++) {
        SWEEP_CHECK(c->so[j] == so && c->ro[j] == ro, &s->d,
                    "%s rank %d peer %d: offsets %lld %lld, prefix sums %lld %lld",
                    SHAPE_ARGS(&s->d), x_name[x], r, j, (long long)c->so[j], (long long)c->ro[j],
                    (long long)so, (long long)ro);
        so += c->sc[j];
        ro += c->rc[j];
    }
    SWEEP_CHECK(uly_send_bytes(p, all_x[x]) == so && uly_recv_bytes(p, all_x[x]) == ro, &s->d,
                "%s rank %d: send_bytes %lld (sum %lld) recv_bytes %lld (sum %lld)",
                SHAPE_ARGS(&s->d), x_name[x], r, (long long)uly_send_bytes(p, all_x[x]),
                (long long)so, (long long)uly_recv_bytes(p, all_x[x]), (long long)ro);
}
static void all_offsets(const sweep *s, int *bad) { each_exchange(s, bad, offsets); }
TEST(offsets_are_prefix_sums_and_totals_are_sums_of_counts) { each_shape(all_offsets); }

static void inverse(const sweep *s, int *bad) {
    int P = s->d.sp_size;
    counts q, o, kv, dkv;
    for (int r = 0; r < P; r++) {
        uly_plan p;
        if (plan_for(&s->d, r, &p)) return;
        uly_exchange_counts(&p, ULY_X_Q, q.sc, q.so, q.rc, q.ro);
        uly_exchange_counts(&p, ULY_X_O, o.sc, o.so, o.rc, o.ro);
        uly_exchange_counts(&p, ULY_X_KV, kv.sc, kv.so, kv.rc, kv.ro);
        uly_exchange_counts(&p, ULY_X_DKV, dkv.sc, dkv.so, dkv.rc, dkv.ro);
        for (int j = 0; j < P; j++)
            SWEEP_CHECK(o.sc[j] == q.rc[j] && o.rc[j] == q.sc[j] && dkv.sc[j] == kv.rc[j] &&
                            dkv.rc[j] == kv.sc[j],
                        &s->d, "rank %d peer %d: head->seq is not the inverse of seq->head",
                        SHAPE_ARGS(&s->d), r, j);
    }
}
TEST(head_to_seq_exchanges_are_the_inverses_of_seq_to_head) { each_shape(inverse); }

TEST(the_sp_groups_of_a_world_are_consecutive_ranks_with_equal_plans) {
    /* world 12 = DP 3 x SP 4: ranks 4..7 form SP group 1 and plan exactly like ranks 0..3. */
    uly_plan_desc d = {.world_size = 12, .sp_size = 4, .batch = 2, .seq_len = 29, .n_heads = 8,
                       .n_kv_heads = 2, .head_dim = 16, .dtype = ULY_BF16};
    for (int rank = 0; rank < 12; rank++) {
        uly_plan p, p0;
        CHECK(plan_for(&d, rank, &p) == ULY_OK, "rank %d", rank);
        CHECK(plan_for(&d, rank % 4, &p0) == ULY_OK, "rank %d", rank % 4);
        CHECK(p.sp_rank == rank % 4 && p.dp_rank == rank / 4, "rank %d: sp %d dp %d", rank,
              p.sp_rank, p.dp_rank);
        for (int x = 0; x < 4; x++)
            CHECK(uly_send_bytes(&p, all_x[x]) == uly_send_bytes(&p0, all_x[x]) &&
                      uly_recv_bytes(&p, all_x[x]) == uly_recv_bytes(&p0, all_x[x]),
                  "rank %d %s", rank, x_name[x]);
    }
}

TEST(a_replicated_kv_head_is_sent_to_every_rank_that_needs_it) {
    /* H = 8, Hkv = 2, P = 8: query heads 0..3 use kv head 0, 4..7 kv head 1. Each rank gets one
       kv head; kv head 0 goes to ranks 0..3. Rank 0 (tokens 0..1 of S = 16) sends B*2*1*D*4. */
    uly_plan_desc d = {.world_size = 8, .rank = 0, .sp_size = 8, .batch = 1, .seq_len = 16,
                       .n_heads = 8, .n_kv_heads = 2, .head_dim = 8, .dtype = ULY_F32};
    uly_plan p;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    for (int r = 0; r < 8; r++) {
        uly_range kv = uly_kv_heads(&p, r);
        CHECK(kv.start == r / 4 && kv.count == 1, "rank %d kv [%lld,+%lld)", r,
              (long long)kv.start, (long long)kv.count);
    }
    counts c;
    uly_exchange_counts(&p, ULY_X_KV, c.sc, c.so, c.rc, c.ro);
    for (int j = 0; j < 8; j++) CHECK(c.sc[j] == 2 * 8 * 4, "to %d: %lld", j, (long long)c.sc[j]);
    CHECK(uly_send_bytes(&p, ULY_X_KV) == 8 * 2 * 8 * 4, "KV send total %lld",
          (long long)uly_send_bytes(&p, ULY_X_KV));
}

TEST(a_gqa_group_split_across_ranks_gives_each_rank_both_kv_heads_it_touches) {
    /* H = 6, Hkv = 2 (g = 3), P = 4: heads 0-1 | 2-3 | 4 | 5. Rank 1 holds heads 2 and 3, which
       use kv heads 0 and 1. */
    uly_plan_desc d = {.world_size = 4, .rank = 1, .sp_size = 4, .batch = 1, .seq_len = 10,
                       .n_heads = 6, .n_kv_heads = 2, .head_dim = 8, .dtype = ULY_F16};
    uly_plan p;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    int64_t want[4][2] = {{0, 1}, {0, 2}, {1, 1}, {1, 1}};
    for (int r = 0; r < 4; r++) {
        uly_range kv = uly_kv_heads(&p, r);
        CHECK(kv.start == want[r][0] && kv.count == want[r][1], "rank %d kv [%lld,+%lld)", r,
              (long long)kv.start, (long long)kv.count);
    }
}

TEST(the_plan_is_all_int64_for_a_long_sequence) {
    /* S = 2^31 + 3 tokens: counts above INT_MAX stay exact. */
    int64_t S = ((int64_t)1 << 31) + 3;
    uly_plan_desc d = {.world_size = 4, .rank = 3, .sp_size = 4, .batch = 1, .seq_len = S,
                       .n_heads = 4, .n_kv_heads = 4, .head_dim = 128, .dtype = ULY_BF16};
    uly_plan p;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    uly_range t = uly_tokens(&p, 3);
    CHECK(t.start == 3 * (S / 4 + 1) && t.count == S / 4, "rank 3 tokens [%lld,+%lld)",
          (long long)t.start, (long long)t.count);
    counts c;
    uly_exchange_counts(&p, ULY_X_Q, c.sc, c.so, c.rc, c.ro);
    CHECK(c.sc[0] == (S / 4) * 128 * 2, "send to 0: %lld", (long long)c.sc[0]);
    CHECK(c.rc[0] == (S / 4 + 1) * 128 * 2, "recv from 0: %lld", (long long)c.rc[0]);
    CHECK(c.ro[3] == 3 * (S / 4 + 1) * 128 * 2, "recv offset of 3: %lld", (long long)c.ro[3]);
}

int main(void) { return uly_run_tests(); }
