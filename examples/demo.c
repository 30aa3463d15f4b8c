/* demo.c - one Ulysses attention layer, forward and backward, on P ranks, checked against the
   same attention computed unsharded.

       make demo        P threads on the local communicator
       make demo-mpi    P MPI processes (built with -DULYSSES_MPI)

   Options: -s S -h H -k Hkv -d D -b B -p P, and -n for no causal mask.
   Defaults: S = 4096, H = 16, Hkv = 4, D = 64, B = 1, P = 4, causal, fp32.

   Every rank holds the full inputs (made from one seed), runs the layer on its own tokens, and
   computes its share of the unsharded reference: whole kv groups (a kv head and its query
   heads) over all tokens, which is exactly what the unsharded call computes for those heads.
   out and dQ must equal the reference bit for bit. dK and dV may differ slightly: the copies of
   a kv head that several ranks need are summed in another order (the layer adds up to P
   shares, each rounded once), so the check allows 4 P float epsilons of the largest value;
   a wrong share or a lost one is off by far more. */
#define _POSIX_C_SOURCE 200112L
#ifdef ULYSSES_MPI
#include <mpi.h>
#endif
#define ULYSSES_IMPLEMENTATION
#include "ulysses.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct demo {
    int P, causal;
    int64_t S, H, Hkv, D, B;
    float *q, *k, *v, *dout;     /* inputs, [B, S, H or Hkv, D] */
    float *out, *dq, *dk, *dv;   /* the SP layer's results, each rank writing its tokens */
    float *rout, *rdq, *rdk, *rdv; /* the reference, each rank writing its kv groups */
    int failed;
} demo;

typedef struct timer {
    double start[4], total[4];
} timer;

static const char *phase_name[4] = {"pack", "exchange", "attention", "unpack"};
static const char *xchg_name[4] = {"Q  (seq->head)", "KV (seq->head)", "O  (head->seq)",
                                   "DKV (head->seq)"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void on_phase(void *user, uly_phase phase, int end) {
    timer *t = (timer *)user;
    if (end)
        t->total[phase] += now() - t->start[phase];
    else
        t->start[phase] = now();
}

static float *alloc(int64_t n) {
    float *x = (float *)calloc((size_t)n, sizeof *x);
    if (!x) fprintf(stderr, "demo: out of memory (%lld floats)\n", (long long)n), exit(1);
    return x;
}

/* The same pseudo-random inputs on every rank: a hash of the element's index. */
static void fill(float *x, int64_t n, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed * 2246822519u;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = (float)(h >> 8) / 16777216.0f - 0.5f;
    }
}

/* [B, S, h, D] tensor of the demo's full buffers. */
static uly_tensor full(const demo *d, float *x, int64_t h) {
    return uly_dense(x, ULY_F32, d->B, d->S, h, d->D);
}

/* The view of tokens [s0, s0 + n) of a full buffer. */
static uly_tensor tokens(const demo *d, float *x, int64_t h, uly_range t) {
    uly_tensor v = full(d, x, h);
    v.data = x + t.start * h * d->D;
    v.s = t.count;
    return v;
}

/* Makes the results of every rank visible to every rank. With MPI each process holds only its
   own part (zeros elsewhere), so a sum assembles them exactly. */
static void share(const uly_comm *c, float *x, int64_t n) {
#ifdef ULYSSES_MPI
    (void)c;
    MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
#else
    (void)x, (void)n;
    c->barrier(c->ctx);
#endif
}

/* Max over the ranks of n <= 8 values, through the comm's allreduce_sum: rank r fills row r.
   A NaN anywhere stays NaN (fmax would drop it). */
static uly_status max_over_ranks(const uly_comm *c, double *v, int n) {
    double all[8 * ULY_MAX_SP] = {0};
    for (int i = 0; i < n; i++) all[c->rank * n + i] = v[i];
    uly_status st = c->allreduce_sum(c->ctx, all, (int64_t)c->size * n, NULL);
    if (st.code) return st;
    for (int r = 0; r < c->size; r++)
        for (int i = 0; i < n; i++)
            if (isnan(all[r * n + i]) || all[r * n + i] > v[i]) v[i] = all[r * n + i];
    return st;
}

static double max_err(uly_tensor a, uly_tensor b) {
    double m = 0, big = 0;
    for (int64_t i = 0; i < a.b; i++)
        for (int64_t s = 0; s < a.s; s++)
            for (int64_t h = 0; h < a.h; h++)
                for (int64_t e = 0; e < a.d; e++) {
                    float x = ((float *)a.data)[i * a.sb + s * a.ss + h * a.sh + e];
                    float y = ((float *)b.data)[i * b.sb + s * b.ss + h * b.sh + e];
                    double err = fabs((double)x - (double)y);
                    if (!(err <= m)) m = err; /* NaN sticks */
                    big = fmax(big, fabs((double)y));
                }
    return m > 0 ? m / big : m;
}

static void print_plan(const demo *d, const uly_plan *p) {
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
    printf("plan: P = %d, S = %lld, H = %lld, Hkv = %lld (group %lld), D = %lld, B = %lld, f32, "
           "%s\n", d->P, (long long)d->S, (long long)d->H, (long long)d->Hkv, (long long)p->group,
           (long long)d->D, (long long)d->B, d->causal ? "causal" : "not causal");
    printf("  rank  tokens            query heads  kv heads\n");
    for (int r = 0; r < d->P; r++) {
        uly_range t = uly_tokens(p, r), h = uly_heads(p, r), kv = uly_kv_heads(p, r);
        printf("  %-4d  [%6lld, %6lld)  [%3lld, %3lld)   [%3lld, %3lld)\n", r, (long long)t.start,
               (long long)(t.start + t.count), (long long)h.start, (long long)(h.start + h.count),
               (long long)kv.start, (long long)(kv.start + kv.count));
    }
    printf("  exchange          rank 0 sends  per peer\n");
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++) {
        uly_exchange_counts(p, (uly_xchg)x, sc, so, rc, ro);
        printf("  %-16s  %9.3f MB   ", xchg_name[x], (double)uly_send_bytes(p, (uly_xchg)x) / 1e6);
        for (int j = 0; j < d->P; j++) printf(" %lld", (long long)sc[j]);
        printf("\n");
    }
    printf("  saved for the backward: %.1f MB per rank\n", (double)uly_saved_bytes(p) / 1e6);
}

static void print_times(const char *what, double total, const timer *t) {
    printf("%-8s %7.3f s  ", what, total);
    for (int i = 0; i < 4; i++) printf("  %s %.3f", phase_name[i], t->total[i]);
    printf("   (rank 0)\n");
}

/* The kv heads whose reference this rank computes and checks (none for some ranks when
   Hkv < P). */
static uly_range ref_kv(const demo *d, const uly_comm *c) {
    uly_range kv;
    kv.start = d->Hkv * c->rank / c->size;
    kv.count = d->Hkv * (c->rank + 1) / c->size - kv.start;
    return kv;
}

/* The view of a full buffer for kv heads kv: those heads, or their query heads. */
static uly_tensor group_view(const demo *d, float *x, int query, uly_range kv) {
    int64_t g = d->H / d->Hkv;
    return query ? uly_head_slice(full(d, x, d->H), kv.start * g, kv.count * g)
                 : uly_head_slice(full(d, x, d->Hkv), kv.start, kv.count);
}

/* This rank's share of the unsharded attention. */
static uly_status reference(demo *d, const uly_comm *c, double *seconds) {
    uly_range kv = ref_kv(d, c);
    uly_attn attn = uly_cpu_attention();
    uly_attn_args a;
    uly_status st = {ULY_OK, ""};
    if (!kv.count) return st;
    memset(&a, 0, sizeof a);
    a.q = group_view(d, d->q, 1, kv), a.o = group_view(d, d->rout, 1, kv);
    a.dout = group_view(d, d->dout, 1, kv), a.dq = group_view(d, d->rdq, 1, kv);
    a.k = group_view(d, d->k, 0, kv), a.v = group_view(d, d->v, 0, kv);
    a.dk = group_view(d, d->rdk, 0, kv), a.dv = group_view(d, d->rdv, 0, kv);
    a.causal = d->causal;
    a.lse = alloc(d->B * a.q.h * d->S);
    a.workspace_bytes = attn.workspace(attn.ctx, &a);
    a.workspace = malloc((size_t)a.workspace_bytes);
    double t0 = now();
    st = attn.fwd(attn.ctx, &a);
    if (!st.code) st = attn.bwd(attn.ctx, &a);
    *seconds = now() - t0;
    free(a.lse);
    free(a.workspace);
    return st;
}

/* A failure this rank may meet alone. Its peers would wait for it in their next collective:
   under MPI, end them all (ulysses.h, ERRORS); the local communicator tells its threads. */
static void rank_failed(demo *d) {
    d->failed = 1;
#ifdef ULYSSES_MPI
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
}

static void run_rank(const uly_comm *c, void *user) {
    demo *d = (demo *)user;
    uly_plan plan;
    uly_plan_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.world_size = c->size, desc.rank = c->rank, desc.sp_size = d->P;
    desc.batch = d->B, desc.seq_len = d->S, desc.n_heads = d->H, desc.n_kv_heads = d->Hkv;
    desc.head_dim = d->D, desc.dtype = ULY_F32;
    uly_status st = uly_plan_init(&plan, &desc);
    if (st.code) {
        if (c->rank == 0) fprintf(stderr, "demo: %s\n", st.msg);
        d->failed = 1;
        return;
    }
    if (c->rank == 0) print_plan(d, &plan);

    timer fwd_t = {{0}, {0}}, bwd_t = {{0}, {0}};
    uly_layer L;
    memset(&L, 0, sizeof L);
    L.plan = &plan, L.comm = c, L.attn = uly_cpu_attention(), L.layout = uly_cpu_layout();
    L.causal = d->causal, L.on_phase = on_phase;
    L.workspace_bytes = uly_layer_workspace(&L);
    L.workspace = malloc((size_t)L.workspace_bytes);
    const int64_t nsaved = uly_saved_bytes(&plan);
    void *saved = malloc((size_t)nsaved);
    uly_range t = uly_tokens(&plan, plan.sp_rank);
    st = uly_layer_agree(&L); /* every rank planned the same layer (once, a collective) */

    L.phase_user = &fwd_t;
    double t0 = now();
    if (!st.code)
        st = uly_forward(&L, tokens(d, d->q, d->H, t), tokens(d, d->k, d->Hkv, t),
                         tokens(d, d->v, d->Hkv, t), tokens(d, d->out, d->H, t), saved, nsaved);
    double t1 = now();
    L.phase_user = &bwd_t;
    if (!st.code)
        st = uly_backward(&L, tokens(d, d->dout, d->H, t), saved, nsaved,
                          tokens(d, d->dq, d->H, t), tokens(d, d->dk, d->Hkv, t),
                          tokens(d, d->dv, d->Hkv, t));
    double t2 = now();
    free(L.workspace);
    free(saved);
    if (st.code) {
        fprintf(stderr, "demo: rank %d: %s\n", c->rank, st.msg);
        rank_failed(d);
        return;
    }
    if (c->rank == 0) {
        print_times("forward", t1 - t0, &fwd_t);
        print_times("backward", t2 - t1, &bwd_t);
    }

    double err[5] = {0}; /* out, dq, dk, dv, then the reference's seconds */
    st = reference(d, c, &err[4]);
    if (st.code) fprintf(stderr, "demo: reference: %s\n", st.msg), rank_failed(d);
    int64_t nq = d->B * d->S * d->H * d->D, nkv = d->B * d->S * d->Hkv * d->D;
    share(c, d->out, nq), share(c, d->dq, nq), share(c, d->dk, nkv), share(c, d->dv, nkv);
    float *got[4] = {d->out, d->dq, d->dk, d->dv}, *want[4] = {d->rout, d->rdq, d->rdk, d->rdv};
    const uly_range kv = ref_kv(d, c);
    for (int i = 0; i < 4 && kv.count; i++)
        err[i] = max_err(group_view(d, got[i], i < 2, kv), group_view(d, want[i], i < 2, kv));
    st = max_over_ranks(c, err, 5);
    if (st.code) {
        fprintf(stderr, "demo: rank %d: comparing the errors: %s\n", c->rank, st.msg);
        rank_failed(d);
        return;
    }
    const double tol = 4 * d->P * FLT_EPSILON; /* dk, dv: P fp32 shares summed in rank order */
    int ok = err[0] == 0 && err[1] == 0 && err[2] <= tol && err[3] <= tol;
    if (c->rank == 0) {
        printf("reference (unsharded uly_cpu_attention, kv groups split over the ranks): %.3f s "
               "(slowest rank)\n", err[4]);
        printf("max |SP - unsharded| / max |unsharded|: out %.3g%s, dq %.3g%s, dk %.3g, dv %.3g "
               "(<= %.2g): %s\n", err[0],
               err[0] == 0 ? " (bitwise)" : "", err[1], err[1] == 0 ? " (bitwise)" : "", err[2],
               err[3], tol, ok ? "ok" : "FAILED");
    }
    if (!ok) d->failed = 1;
}

static int usage(void) {
    fprintf(stderr, "usage: demo [-s S] [-h H] [-k Hkv] [-d D] [-b B] [-p P] [-n]\n");
    return 2;
}

int main(int argc, char **argv) {
    demo d;
    memset(&d, 0, sizeof d);
    d.P = 4, d.causal = 1, d.S = 4096, d.H = 16, d.Hkv = 4, d.D = 64, d.B = 1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "-n")) {
            d.causal = 0;
            continue;
        }
        if (o[0] != '-' || !o[1] || o[2] || i + 1 == argc) return usage();
        long long v = atoll(argv[++i]);
        switch (o[1]) {
        case 's': d.S = v; break;
        case 'h': d.H = v; break;
        case 'k': d.Hkv = v; break;
        case 'd': d.D = v; break;
        case 'b': d.B = v; break;
        case 'p': d.P = (int)v; break;
        default: return usage();
        }
    }
    if (d.S < 1 || d.H < 1 || d.Hkv < 1 || d.D < 1 || d.B < 1) /* the plan checks the rest */
        return fprintf(stderr, "demo: S, H, Hkv, D and B must be positive\n"), 2;
#ifdef ULYSSES_MPI
    MPI_Init(&argc, &argv);
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    d.P = size; /* one SP group of all processes */
#endif
    int64_t nq = d.B * d.S * d.H * d.D, nkv = d.B * d.S * d.Hkv * d.D;
    d.q = alloc(nq), d.dout = alloc(nq), d.out = alloc(nq), d.dq = alloc(nq);
    d.rout = alloc(nq), d.rdq = alloc(nq);
    d.k = alloc(nkv), d.v = alloc(nkv), d.dk = alloc(nkv), d.dv = alloc(nkv);
    d.rdk = alloc(nkv), d.rdv = alloc(nkv);
    fill(d.q, nq, 1), fill(d.k, nkv, 2), fill(d.v, nkv, 3), fill(d.dout, nq, 4);
#ifdef ULYSSES_MPI
    uly_mpi m = {MPI_COMM_WORLD, 0};
    uly_comm comm;
    uly_status st = uly_mpi_comm(&m, &comm);
    if (st.code)
        fprintf(stderr, "demo: %s\n", st.msg), d.failed = 1;
    else
        run_rank(&comm, &d);
    MPI_Finalize();
#else
    uly_status st = uly_local_run(d.P, run_rank, &d);
    if (st.code) fprintf(stderr, "demo: %s\n", st.msg), d.failed = 1;
#endif
    float *bufs[] = {d.q, d.k, d.v, d.dout, d.out, d.dq, d.dk, d.dv, d.rout, d.rdq, d.rdk, d.rdv};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    return d.failed;
}
