/* test_loss.c - what a trainer needs around the layer: token, label and position shards, the
   cross-entropy and its SP reduction, against formulas and fp64 references written here.

       labels of global token t: full[b, t + 1], ignore_index for t = S - 1
       loss_t = logsumexp(logits_t) - logits_t[label_t];  dlogits_t = softmax(logits_t) - onehot
       mean = sum over all ranks / count over all ranks;  grad_scale = 1 / count  (0 and 0 when
       no rank has a valid token) */
#include <float.h>

#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"

enum { IGNORE = -100 };

/* The plan of rank `rank` of an SP group of P ranks for a [B, S] batch (the heads do not
   matter here). */
static uly_status plan_of(uly_plan *p, int P, int rank, int64_t B, int64_t S) {
    uly_plan_desc d = {.world_size = P, .rank = rank, .sp_size = P, .batch = B, .seq_len = S,
                       .n_heads = 8, .head_dim = 8};
    return uly_plan_init(p, &d);
}

static uly_plan make_plan(int P, int rank, int64_t B, int64_t S) {
    uly_plan p;
    uly_status st = plan_of(&p, P, rank, B, S);
    CHECK(st.code == ULY_OK, "plan P=%d B=%lld S=%lld: %s", P, (long long)B, (long long)S, st.msg);
    return p;
}

/* ---------------------------------------------------------------------------------------------
   fp64 cross-entropy, by hand */

/* log-sum-exp of x as *m + *ls: the largest logit and log sum exp(x - m), kept apart, since
   next to a logit of 1e15 or more the sum m + ls would lose ls. */
static void ref_lse(const float *x, int64_t v, double *m, double *ls) {
    double s = 0;
    *m = -INFINITY;
    for (int64_t i = 0; i < v; i++) *m = x[i] > *m ? x[i] : *m;
    for (int64_t i = 0; i < v; i++) s += exp((double)x[i] - *m);
    *ls = log(s);
}

/* Sum of token losses and count of valid labels; dlogits = softmax - onehot (0 if ignored). */
static double ref_ce(const float *logits, const int32_t *labels, int64_t n, int64_t v,
                     int64_t *count, double *dlogits) {
    double sum = 0;
    *count = 0;
    for (int64_t t = 0; t < n; t++) {
        const float *x = logits + t * v;
        double m, ls;
        ref_lse(x, v, &m, &ls);
        for (int64_t i = 0; i < v; i++)
            if (dlogits)
                dlogits[t * v + i] =
                    labels[t] == IGNORE ? 0 : exp((double)x[i] - m - ls) - (i == labels[t]);
        if (labels[t] == IGNORE) continue;
        sum += ls + (m - (double)x[labels[t]]);
        (*count)++;
    }
    return sum;
}

/* fp64 loss of one token with logits in double (for finite differences). */
static double ref_token_loss_d(const double *x, int64_t v, int32_t label) {
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < v; i++) m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < v; i++) s += exp(x[i] - m);
    return log(s) + (m - x[label]);
}

static void make_labels(int32_t *labels, int64_t n, int64_t v, uint64_t seed, int every_ignored) {
    ref_rng r = ref_seed(seed);
    for (int64_t t = 0; t < n; t++) {
        labels[t] = (int32_t)(ref_next(&r) % (uint64_t)v);
        if (every_ignored && t % every_ignored == 0) labels[t] = IGNORE;
    }
}

/* ---------------------------------------------------------------------------------------------
   Cross-entropy on one rank */

TEST(cross_entropy_sum_and_count_match_fp64_log_sum_exp) {
    enum { N = 37, V = 50 };
    static float logits[N * V];
    int32_t labels[N];
    ref_fill(logits, N * V, 21);
    for (int i = 0; i < N * V; i++) logits[i] *= 4;
    make_labels(labels, N, V, 22, 5);
    int64_t want_count;
    double want = ref_ce(logits, labels, N, V, &want_count, NULL);
    double sum = 0;
    int64_t count = 0;
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, NULL);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(count == want_count && count == N - 8, "count %lld want %lld", (long long)count,
          (long long)want_count);
    CHECK_NEAR(sum / count, want / want_count, 1e-5, "mean loss");
    CHECK_NEAR(sum, want, 1e-5 * N, "loss sum");
}

TEST(cross_entropy_adds_to_the_callers_sum_and_count) {
    enum { N = 4, V = 6 };
    float logits[N * V];
    int32_t labels[N] = {1, IGNORE, 5, 0};
    ref_fill(logits, N * V, 23);
    int64_t want_count;
    double want = ref_ce(logits, labels, N, V, &want_count, NULL);
    double sum = 2.5;
    int64_t count = 7;
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, NULL);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(count == 7 + 3, "count %lld", (long long)count);
    CHECK_NEAR(sum, 2.5 + want, 1e-5, "sum");
}

TEST(cross_entropy_is_stable_for_large_logits) {
    enum { N = 3, V = 8 };
    float logits[N * V];
    int32_t labels[N] = {0, 7, 3};
    ref_fill(logits, N * V, 24);
    for (int i = 0; i < N * V; i++) logits[i] = logits[i] * 20 + (i % 2 ? 1000 : -1000);
    int64_t want_count;
    static double want_d[N * V];
    double want = ref_ce(logits, labels, N, V, &want_count, want_d);
    double sum = 0;
    int64_t count = 0;
    float dl[N * V];
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, dl);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(isfinite(sum), "sum %g", sum);
    CHECK_NEAR(sum, want, 1e-3, "sum of losses near 2000");
    CHECK(ref_maxdiff_fd(dl, want_d, N * V) <= 1e-6, "dlogits off by %g",
          ref_maxdiff_fd(dl, want_d, N * V));
}

/* v equal logits give -log softmax = log v and a gradient of 1/v - onehot, however large they
   are: the shift by the largest logit must not swallow log v (it did beyond about 1e15). */
TEST(cross_entropy_of_equal_logits_is_log_v_at_any_magnitude) {
    enum { V = 3 };
    const float big[] = {1e15f, -1e15f, 1e30f, -1e30f, FLT_MAX, -FLT_MAX};
    for (int c = 0; c < (int)(sizeof big / sizeof *big); c++) {
        const float logits[V] = {big[c], big[c], big[c]};
        const int32_t label = c % V;
        float dl[V];
        double sum = 0;
        int64_t count = 0;
        uly_status st = uly_cross_entropy(logits, &label, 1, V, IGNORE, &sum, &count, dl);
        CHECK(st.code == ULY_OK && count == 1, "logits %g: %s", big[c], st.msg);
        CHECK(fabs(sum - log(3.0)) <= 1e-12, "logits %g: loss %.17g, want log 3", big[c], sum);
        for (int i = 0; i < V; i++)
            CHECK(fabs(dl[i] - (1.0 / 3 - (i == label))) <= 1e-7,
                  "logits %g: dlogits[%d] %.9g, want %.9g", big[c], i, dl[i],
                  1.0 / 3 - (i == label));
    }
}

/* A -inf logit masks its class out of the softmax: the loss is that of the other classes, and
   its gradient is 0. A -inf on the label makes the loss +inf; a +inf or NaN logit, or every
   logit -inf (a softmax of 0/0), makes it NaN, as in PyTorch. */
TEST(minus_inf_logits_mask_classes_and_plus_inf_or_nan_give_nan) {
    enum { N = 3, V = 7 };
    float logits[N * V], dl[N * V];
    double want_d[N * V];
    int32_t labels[N] = {2, 6, 0};
    ref_fill(logits, N * V, 26);
    logits[0] = logits[4] = logits[V + 1] = logits[2 * V + 6] = -INFINITY;
    int64_t want_count, count = 0;
    double want = ref_ce(logits, labels, N, V, &want_count, want_d), sum = 0;
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, dl);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(isfinite(want) && count == N, "reference %g, count %lld", want, (long long)count);
    CHECK_NEAR(sum, want, 1e-5, "loss with masked classes");
    CHECK(ref_maxdiff_fd(dl, want_d, N * V) <= 1e-6 && dl[0] == 0 && dl[4] == 0,
          "dlogits off by %g, masked %g %g", ref_maxdiff_fd(dl, want_d, N * V), dl[0], dl[4]);

    const float bad[3] = {-INFINITY, INFINITY, NAN};
    for (int i = 0; i < 3; i++) {
        float x[V];
        ref_fill(x, V, 27);
        x[0] = bad[i];
        int32_t label = 0;
        sum = 0;
        st = uly_cross_entropy(x, &label, 1, V, IGNORE, &sum, &count, NULL);
        CHECK(st.code == ULY_OK, "%s", st.msg);
        CHECK(i == 0 ? sum == INFINITY : isnan(sum), "label logit %g: loss %g", bad[i], sum);
    }
    float none[V];
    for (int i = 0; i < V; i++) none[i] = -INFINITY;
    int32_t label = 3;
    sum = 0;
    st = uly_cross_entropy(none, &label, 1, V, IGNORE, &sum, &count, dl);
    CHECK(st.code == ULY_OK && isnan(sum) && isnan(dl[0]) && isnan(dl[3]),
          "every logit -inf: %s, loss %g, dlogits %g %g", st.msg, sum, dl[0], dl[3]);
}

TEST(dlogits_are_softmax_minus_onehot_and_zero_for_ignored_tokens) {
    enum { N = 29, V = 33 };
    static float logits[N * V], dl[N * V];
    static double want[N * V];
    int32_t labels[N];
    ref_fill(logits, N * V, 25);
    for (int i = 0; i < N * V; i++) logits[i] *= 3;
    make_labels(labels, N, V, 26, 4);
    int64_t c;
    ref_ce(logits, labels, N, V, &c, want);
    for (int i = 0; i < N * V; i++) dl[i] = NAN;
    double sum = 0;
    int64_t count = 0;
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, dl);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(ref_maxdiff_fd(dl, want, N * V) <= 1e-6, "dlogits off by %g",
          ref_maxdiff_fd(dl, want, N * V));
    for (int t = 0; t < N; t += 4)
        for (int i = 0; i < V; i++)
            CHECK(dl[t * V + i] == 0, "ignored token %d: dlogits %g", t, dl[t * V + i]);
}

TEST(dlogits_match_central_finite_differences_of_the_fp64_loss) {
    enum { N = 5, V = 7 };
    float logits[N * V], dl[N * V];
    int32_t labels[N] = {3, 0, 6, IGNORE, 2};
    ref_fill(logits, N * V, 27);
    double sum = 0;
    int64_t count = 0;
    uly_status st = uly_cross_entropy(logits, labels, N, V, IGNORE, &sum, &count, dl);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    const double h = 1e-5;
    for (int t = 0; t < N; t++)
        for (int i = 0; i < V; i++) {
            double x[V], fd = 0;
            for (int j = 0; j < V; j++) x[j] = logits[t * V + j];
            if (labels[t] != IGNORE) {
                x[i] += h;
                double lp = ref_token_loss_d(x, V, labels[t]);
                x[i] -= 2 * h;
                double lm = ref_token_loss_d(x, V, labels[t]);
                fd = (lp - lm) / (2 * h);
            }
            CHECK_NEAR(dl[t * V + i], fd, 1e-6, "dlogits vs finite difference");
        }
}

/* ---------------------------------------------------------------------------------------------
   Shards */

/* Rank r of P's shard of a [B, S] batch: its plan, and by the formula its Sr tokens from s0. */
typedef struct shard {
    uly_plan p;
    int P, r;
    int64_t B, S, Sr, s0;
} shard;

enum { MAX_B = 3, MAX_S = 17 };

/* Calls check on every shard of a [B, S] batch for P from 1 to 5 and B from 1 to MAX_B. */
static void each_shard(int64_t S, void (*check)(const shard *sh)) {
    for (int P = 1; P <= 5; P++)
        for (int64_t B = 1; B <= MAX_B; B++)
            for (int r = 0; r < P; r++) {
                shard sh = {make_plan(P, r, B, S), P, r, B, S, S / P + (r < S % P),
                            r * (S / P) + (r < S % P ? r : S % P)};
                check(&sh);
            }
}

static void tokens_of(const shard *sh) {
    int32_t full[MAX_B * MAX_S], local[MAX_B * MAX_S];
    for (int i = 0; i < sh->B * sh->S; i++) full[i] = 1000 + i * 7;
    uly_status st = uly_shard_tokens(&sh->p, full, local);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    for (int64_t b = 0; b < sh->B; b++)
        for (int64_t i = 0; i < sh->Sr; i++)
            CHECK(local[b * sh->Sr + i] == full[b * sh->S + sh->s0 + i],
                  "P=%d B=%lld rank %d b %lld i %lld", sh->P, (long long)sh->B, sh->r,
                  (long long)b, (long long)i);
}
TEST(shard_tokens_gives_rank_r_the_tokens_s0_to_s0_plus_Sr_of_every_sample) {
    each_shard(13, tokens_of);
}

static void labels_of(const shard *sh) {
    int32_t full[MAX_B * MAX_S], labels[MAX_B * MAX_S];
    for (int i = 0; i < sh->B * sh->S; i++) full[i] = 500 + i * 3;
    uly_status st = uly_shard_labels(&sh->p, full, IGNORE, labels);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    for (int64_t b = 0; b < sh->B; b++)
        for (int64_t i = 0; i < sh->Sr; i++) {
            int64_t t = sh->s0 + i;
            int32_t want = t == sh->S - 1 ? IGNORE : full[b * sh->S + t + 1];
            CHECK(labels[b * sh->Sr + i] == want, "P=%d B=%lld rank %d token %lld: %d want %d",
                  sh->P, (long long)sh->B, sh->r, (long long)t, labels[b * sh->Sr + i], want);
        }
}
TEST(shard_labels_shift_over_the_full_sequence_and_ignore_the_last_token) {
    each_shard(11, labels_of);
}

static void positions_of(const shard *sh) {
    int32_t pos[MAX_B * MAX_S];
    uly_status st = uly_positions(&sh->p, pos);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    for (int64_t b = 0; b < sh->B; b++)
        for (int64_t i = 0; i < sh->Sr; i++)
            CHECK(pos[b * sh->Sr + i] == sh->s0 + i, "P=%d B=%lld rank %d: pos[%lld] = %d",
                  sh->P, (long long)sh->B, sh->r, (long long)(b * sh->Sr + i),
                  pos[b * sh->Sr + i]);
}
TEST(positions_are_the_global_token_indices_of_the_shard) { each_shard(17, positions_of); }

/* ---------------------------------------------------------------------------------------------
   The loss over an SP group: every rank shards the same batch, adds its tokens' losses, and one
   allreduce gives everyone the unsharded mean */

enum { LB = 2, LS = 23, LV = 19, LMAXP = 8 };

typedef struct loss_job {
    int P;
    const int32_t *tokens;  /* [LB, LS] */
    const float *logits;    /* [LB, LS, LV], the logits every token would have unsharded */
    double mean[LMAXP], scale[LMAXP], sum[LMAXP];
    int64_t count[LMAXP];
    float *dlogits;         /* [LB, LS, LV], each rank scales and writes its tokens */
    float *unscaled;        /* the same before scaling by grad_scale */
    uly_status st[LMAXP];
} loss_job;

static void loss_rank(const uly_comm *comm, void *user) {
    loss_job *j = (loss_job *)user;
    int r = comm->rank;
    uly_plan p;
    j->st[r] = plan_of(&p, j->P, r, LB, LS);
    if (j->st[r].code) return;
    uly_range tok = uly_tokens(&p, r);
    int64_t Sr = tok.count;
    int32_t labels[LB * LS];
    float logits[LB * LS * LV], dl[LB * LS * LV];
    uly_shard_labels(&p, j->tokens, IGNORE, labels);
    for (int64_t b = 0; b < LB; b++)
        memcpy(logits + b * Sr * LV, j->logits + (b * LS + tok.start) * LV,
               (size_t)(Sr * LV) * sizeof(float));
    double sum = 0;
    int64_t count = 0;
    j->st[r] = uly_cross_entropy(logits, labels, LB * Sr, LV, IGNORE, &sum, &count, dl);
    if (j->st[r].code) return;
    j->sum[r] = sum;
    j->count[r] = count;
    j->st[r] = uly_loss_reduce(comm, sum, count, &j->mean[r], &j->scale[r]);
    for (int64_t b = 0; b < LB; b++)
        for (int64_t i = 0; i < Sr * LV; i++) {
            const int64_t at = (b * LS + tok.start) * LV + i;
            j->dlogits[at] = (float)(dl[b * Sr * LV + i] * j->scale[r]);
            j->unscaled[at] = dl[b * Sr * LV + i];
        }
}

/* Runs the SP loss on P ranks and checks it against the unsharded fp64 mean and gradient. */
static void check_sp_loss(int P, const int32_t *tokens, const char *what) {
    static float logits[LB * LS * LV], dlogits[LB * LS * LV], unscaled[LB * LS * LV];
    static double want_d[LB * LS * LV];
    int32_t labels[LB * LS];
    ref_fill(logits, LB * LS * LV, 31);
    for (int b = 0; b < LB; b++)
        for (int t = 0; t < LS; t++)
            labels[b * LS + t] = t == LS - 1 ? IGNORE : tokens[b * LS + t + 1];
    int64_t count;
    double sum = ref_ce(logits, labels, LB * LS, LV, &count, want_d);
    double mean = count ? sum / (double)count : 0, scale = count ? 1.0 / (double)count : 0;
    for (int i = 0; i < LB * LS * LV; i++) want_d[i] *= scale;

    loss_job j;
    memset(&j, 0, sizeof j);
    j.P = P;
    j.tokens = tokens;
    j.logits = logits;
    j.dlogits = dlogits, j.unscaled = unscaled;
    uly_status st = uly_local_run(P, loss_rank, &j);
    CHECK(st.code == ULY_OK, "%s P=%d: %s", what, P, st.msg);
    for (int r = 0; r < P; r++) {
        CHECK(j.st[r].code == ULY_OK, "%s P=%d rank %d: %s", what, P, r, j.st[r].msg);
        CHECK(!isnan(j.mean[r]) && !isnan(j.scale[r]), "%s P=%d rank %d: NaN", what, P, r);
        CHECK_NEAR(j.mean[r], mean, 1e-5, what);
        CHECK(j.scale[r] == scale, "%s P=%d rank %d: grad_scale %.17g want %.17g", what, P, r,
              j.scale[r], scale);
    }
    double e = ref_maxdiff_fd(dlogits, want_d, LB * LS * LV);
    CHECK(e <= 1e-7, "%s P=%d: scaled dlogits off by %g", what, P, e);
}

static void make_tokens(int32_t *tokens, uint64_t seed) {
    ref_rng r = ref_seed(seed);
    for (int i = 0; i < LB * LS; i++) tokens[i] = (int32_t)(ref_next(&r) % LV);
}

TEST(sp_mean_loss_and_grad_scale_equal_the_unsharded_ones) {
    int32_t tokens[LB * LS];
    make_tokens(tokens, 41);
    for (int i = 0; i < LB * LS; i += 6) tokens[i] = IGNORE; /* some padding */
    for (int P = 1; P <= LMAXP; P++) check_sp_loss(P, tokens, "mixed labels");
}

TEST(a_rank_whose_labels_are_all_ignored_contributes_zero_and_no_nan) {
    /* P = 4, S = 23: rank 1 owns tokens [6, 12), whose labels are tokens [7, 13). */
    int32_t tokens[LB * LS];
    make_tokens(tokens, 42);
    for (int b = 0; b < LB; b++)
        for (int t = 7; t < 13; t++) tokens[b * LS + t] = IGNORE;
    check_sp_loss(4, tokens, "rank 1 empty");
    loss_job j;
    static float logits[LB * LS * LV], dl[LB * LS * LV], unscaled[LB * LS * LV];
    ref_fill(logits, LB * LS * LV, 31);
    memset(&j, 0, sizeof j);
    j.P = 4;
    j.tokens = tokens;
    j.logits = logits;
    j.dlogits = dl, j.unscaled = unscaled;
    uly_status st = uly_local_run(4, loss_rank, &j);
    CHECK(st.code == ULY_OK, "%s", st.msg);
    CHECK(j.sum[1] == 0 && j.count[1] == 0, "rank 1: sum %g count %lld", j.sum[1],
          (long long)j.count[1]);
    for (int b = 0; b < LB; b++)
        for (int i = 6 * LV; i < 12 * LV; i++)
            CHECK(dl[b * LS * LV + i] == 0, "rank 1's dlogits[%d, %d] = %g", b, i,
                  dl[b * LS * LV + i]);
}

TEST(when_no_rank_has_a_valid_token_mean_and_grad_scale_are_zero) {
    int32_t tokens[LB * LS];
    for (int i = 0; i < LB * LS; i++) tokens[i] = IGNORE;
    for (int P = 1; P <= 4; P++) {
        loss_job j;
        static float logits[LB * LS * LV], dl[LB * LS * LV], unscaled[LB * LS * LV];
        ref_fill(logits, LB * LS * LV, 31);
        memset(&j, 0, sizeof j);
        j.P = P;
        j.tokens = tokens;
        j.logits = logits;
        j.dlogits = dl, j.unscaled = unscaled;
        uly_status st = uly_local_run(P, loss_rank, &j);
        CHECK(st.code == ULY_OK, "%s", st.msg);
        for (int r = 0; r < P; r++)
            CHECK(j.st[r].code == ULY_OK && j.mean[r] == 0 && j.scale[r] == 0,
                  "P=%d rank %d: mean %g scale %g (%s)", P, r, j.mean[r], j.scale[r], j.st[r].msg);
        int bad = 0; /* grad_scale is 0 here: the gradient must be 0 before it, too */
        for (int i = 0; i < LB * LS * LV; i++) bad += dl[i] != 0 || unscaled[i] != 0;
        CHECK(bad == 0, "P=%d: %d non-zero dlogits", P, bad);
    }
}

typedef struct reduce_job {
    double mean[LMAXP], scale[LMAXP];
    uly_status st[LMAXP];
} reduce_job;

static void reduce_rank(const uly_comm *comm, void *user) {
    reduce_job *j = (reduce_job *)user;
    int r = comm->rank;
    /* rank r: sum r + 0.25, count 3r (rank 0 has none) */
    j->st[r] = uly_loss_reduce(comm, r + 0.25, 3 * r, &j->mean[r], &j->scale[r]);
}

TEST(loss_reduce_gives_every_rank_sum_all_over_count_all) {
    for (int P = 2; P <= 6; P++) {
        reduce_job j;
        memset(&j, 0, sizeof j);
        uly_status st = uly_local_run(P, reduce_rank, &j);
        CHECK(st.code == ULY_OK, "%s", st.msg);
        double sum = 0, count = 0;
        for (int r = 0; r < P; r++) sum += r + 0.25, count += 3 * r;
        for (int r = 0; r < P; r++) {
            CHECK(j.st[r].code == ULY_OK, "P=%d rank %d: %s", P, r, j.st[r].msg);
            CHECK_NEAR(j.mean[r], sum / count, 1e-12, "mean");
            CHECK_NEAR(j.scale[r], 1 / count, 1e-15, "grad_scale");
        }
    }
}

/* One valid token in all: the mean is its loss, the scale 1. */
static void one_token_rank(const uly_comm *comm, void *user) {
    reduce_job *j = (reduce_job *)user;
    const int r = comm->rank;
    j->st[r] = uly_loss_reduce(comm, r ? 0 : 2.5, r ? 0 : 1, &j->mean[r], &j->scale[r]);
}

TEST(loss_reduce_of_one_valid_token_gives_its_loss) {
    reduce_job j;
    memset(&j, 0, sizeof j);
    CHECK(uly_local_run(3, one_token_rank, &j).code == ULY_OK, "local_run");
    for (int r = 0; r < 3; r++)
        CHECK(j.st[r].code == ULY_OK && j.mean[r] == 2.5 && j.scale[r] == 1,
              "rank %d: '%s', mean %g, scale %g", r, j.st[r].msg, j.mean[r], j.scale[r]);
}

int main(void) { return uly_run_tests(); }
