/* bench_layer.cu - one SP attention layer, P = 4 device-local ranks on one GPU (make bench-gpu):
   the time of pack, exchange, attention and unpack, and their share of the layer.

   bf16, B = 1, H = 32, Hkv = 8, D = 128, causal, the flash kernels; S = 16K, 32K, 64K (or the
   arguments). The four virtual ranks run concurrently, each on its own stream, and each records
   events at the layer's on_phase hooks. A phase's time is, each time the layer enters it, the
   window from the first rank's start to the last rank's end: the GPU hands out one kernel's
   blocks before the next kernel's, so the ranks' attention kernels, released together by the
   exchange before them, run largely one after another, and one rank's marks alone would time
   anything from a quarter of the four ranks' attention to all of it. An exchange's window opens
   at the last rank's start instead: a rank's copies from peers already packed may start before
   it (by at most one pack's time, counted as packing), but the exchange ends only once every
   rank's blocks have come. The pass
   runs from the first rank's first mark to the last rank's last; "not attention" is the pass
   less the attention windows. Windows of two phases can still overlap a little (one rank
   packing while another attends), so the shares can add up to more than 100%. With B = 1 the
   query side needs no unpack and the output side no pack (the driver sends and receives in
   place). Medians over 7 runs after 3 warm-up runs (one of each in make test's emulated smoke
   run), the shares of each run's own times. Prints a table on stdout.
   The shares outside attention are upper bounds: each exchange meets the other ranks' threads
   on the host, so time the GPU spends waiting for the host counts as exchange time.
   One GPU plays four: attention does four ranks' work on it while the exchange is a copy in its
   memory, so the shares are not those of four GPUs, where attention is about 4x faster and the
   exchange crosses NVLink. For those, take a quarter of the attention time and the exchange's
   bytes over the link's bandwidth. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "bench_cuda.h"

enum { P = 4, H = 32, HKV = 8, D = 128, MARKS = 64 };
enum { WARMUP = BENCH_SMOKE ? 1 : 3, RUNS = BENCH_SMOKE ? 1 : 7 };
static const char *const phases[] = {"pack", "exchange", "attention", "unpack"};

/* Events at the phase hooks of one pass (forward or backward) on one rank's stream. */
typedef struct timeline {
    cudaStream_t stream;
    cudaEvent_t ev[MARKS];
    int phase[MARKS], n;
} timeline;

static void mark(void *user, uly_phase phase, int end) {
    timeline *t = (timeline *)user;
    if (t->n == MARKS) return;
    t->phase[t->n] = end ? -1 : (int)phase;
    CUDA_OK(cudaEventRecord(t->ev[t->n++], t->stream));
}

typedef struct bench {
    int64_t S;
    cudaEvent_t t0;                   /* on rank 0's stream, done before any rank's first mark */
    timeline t[P];                    /* every rank's marks of the pass that runs */
    float fwd[RUNS][5], bwd[RUNS][5]; /* each run: per phase, then the whole pass */
} bench;

/* Milliseconds from t0 to mark i of rank r. */
static float at(const bench *b, int r, int i) {
    float x;
    CUDA_OK(cudaEventElapsedTime(&x, b->t0, b->t[r].ev[i]));
    return x;
}

/* Adds each phase's windows to ms[0..3] and the pass's span to ms[4]. Every rank passes
   through the same phases (an even plan); an exchange opens when the last rank reaches it. */
static void add_up(const bench *b, float ms[5]) {
    const timeline &t = b->t[0];
    for (int r = 1; r < P; r++)
        if (b->t[r].n != t.n || memcmp(b->t[r].phase, t.phase, sizeof(int) * (size_t)t.n)) {
            fprintf(stderr, "bench_layer: rank %d marked other phases than rank 0\n", r);
            exit(1);
        }
    float first = at(b, 0, 0), last = at(b, 0, t.n - 1);
    for (int r = 1; r < P; r++)
        first = std::min(first, at(b, r, 0)), last = std::max(last, at(b, r, t.n - 1));
    for (int i = 0; i + 1 < t.n; i++) {
        if (t.phase[i] < 0) continue;
        const bool together = t.phase[i] == ULY_PHASE_EXCHANGE;
        float lo = at(b, 0, i), hi = at(b, 0, i + 1);
        for (int r = 1; r < P; r++) {
            const float x = at(b, r, i);
            lo = together ? std::max(lo, x) : std::min(lo, x);
            hi = std::max(hi, at(b, r, i + 1));
        }
        ms[t.phase[i]] += hi - lo;
    }
    ms[4] += last - first;
}

/* One pass, fn(), timed on every rank into ms (rank 0 adds it up; NULL: a warm-up). */
template <typename F>
static void timed_pass(const uly_comm *comm, bench *b, float *ms, F fn) {
    timeline *t = &b->t[comm->rank];
    if (comm->rank == 0) {
        CUDA_OK(cudaEventRecord(b->t0, t->stream));
        CUDA_OK(cudaEventSynchronize(b->t0));
    }
    bench_ok(comm->barrier(comm->ctx), "barrier"); /* t0 is done before any rank starts */
    fn();
    CUDA_OK(cudaStreamSynchronize(t->stream));
    bench_ok(comm->barrier(comm->ctx), "barrier"); /* every rank's marks are done */
    if (comm->rank == 0 && ms) add_up(b, ms);
    bench_ok(comm->barrier(comm->ctx), "barrier"); /* and read, before they are recorded again */
    t->n = 0;
}

static void rank_main(const uly_comm *comm, void *user) {
    bench *b = (bench *)user;
    uly_plan plan;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = P, d.rank = comm->rank, d.sp_size = P, d.batch = 1, d.seq_len = b->S;
    d.n_heads = H, d.n_kv_heads = HKV, d.head_dim = D, d.dtype = ULY_BF16;
    bench_ok(uly_plan_init(&plan, &d), "uly_plan_init");
    const int64_t Sr = uly_tokens(&plan, plan.sp_rank).count, nq = Sr * H * D;
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));

    uly_tensor q, k, v, dq, dk, dv;
    __nv_bfloat16 *qkv = bench_random(Sr * (H + 2 * HKV) * D, 1 + comm->rank, s);
    __nv_bfloat16 *dqkv = bench_random(Sr * (H + 2 * HKV) * D, 0, s);
    uly_qkv_views(qkv, ULY_BF16, 1, Sr, H, HKV, D, &q, &k, &v);
    uly_qkv_views(dqkv, ULY_BF16, 1, Sr, H, HKV, D, &dq, &dk, &dv);
    uly_tensor out = uly_dense(bench_random(nq, 0, s), ULY_BF16, 1, Sr, H, D);
    uly_tensor dout = uly_dense(bench_random(nq, 5 + comm->rank, s), ULY_BF16, 1, Sr, H, D);

    timeline *t = &b->t[comm->rank];
    t->stream = s;
    for (int i = 0; i < MARKS; i++) CUDA_OK(cudaEventCreate(&t->ev[i]));
    uly_layer L = uly_cuda_layer(&plan, comm, s);
    L.causal = 1;
    L.on_phase = mark, L.phase_user = t;
    L.workspace_bytes = uly_layer_workspace(&L);
    void *saved;
    CUDA_OK(cudaMalloc(&L.workspace, (size_t)L.workspace_bytes));
    const int64_t nsaved = uly_saved_bytes(&plan);
    CUDA_OK(cudaMalloc(&saved, (size_t)nsaved));

    for (int run = -WARMUP; run < RUNS; run++) {
        timed_pass(comm, b, run >= 0 ? b->fwd[run] : NULL, [&] {
            bench_ok(uly_forward(&L, q, k, v, out, saved, nsaved), "uly_forward");
        });
        timed_pass(comm, b, run >= 0 ? b->bwd[run] : NULL, [&] {
            bench_ok(uly_backward(&L, dout, saved, nsaved, dq, dk, dv), "uly_backward");
        });
    }
    for (int i = 0; i < MARKS; i++) cudaEventDestroy(t->ev[i]);
    void *all[] = {qkv, dqkv, out.data, dout.data, L.workspace, saved};
    for (void *p : all) cudaFree(p);
    cudaStreamDestroy(s);
}

static float median(float *x) {
    std::sort(x, x + RUNS);
    return x[RUNS / 2];
}

/* The median over the runs of each phase's time and of its share of its run's pass. */
static void print_pass(const char *name, int64_t S, const float runs[RUNS][5]) {
    float col[RUNS];
    for (int r = 0; r < RUNS; r++) col[r] = runs[r][4];
    printf("%7lld %-8s %9.2f", (long long)S, name, median(col));
    for (int p = 0; p < 4; p++) {
        float share[RUNS];
        for (int r = 0; r < RUNS; r++) col[r] = runs[r][p], share[r] = runs[r][p] / runs[r][4];
        printf(" %8.2f %5.1f%%", median(col), 100 * median(share));
    }
    for (int r = 0; r < RUNS; r++) col[r] = 1 - runs[r][ULY_PHASE_ATTN] / runs[r][4];
    printf("   %5.1f%%\n", 100 * median(col));
}

int main(int argc, char **argv) {
    std::vector<int64_t> seqs = {16384, 32768, 65536};
    if (argc > 1) seqs.assign(argc - 1, 0);
    for (int i = 1; i < argc; i++) seqs[i - 1] = atoll(argv[i]);
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("SP layer on %s: P=%d device-local ranks, B=1 H=%d Hkv=%d D=%d bf16 causal, flash\n",
           prop.name, P, H, HKV, D);
    printf("%7s %-8s %9s", "S", "pass", "layer ms");
    for (int p = 0; p < 4; p++) printf(" %8s %6s", phases[p], "share");
    printf("   %s\n", "not attention");
    for (int64_t S : seqs) {
        bench b;
        memset(&b, 0, sizeof b);
        b.S = S;
        CUDA_OK(cudaEventCreate(&b.t0));
        bench_ok(uly_cuda_local_run(P, rank_main, &b), "uly_cuda_local_run");
        cudaEventDestroy(b.t0);
        print_pass("forward", S, b.fwd);
        print_pass("backward", S, b.bwd);
    }
    return 0;
}
