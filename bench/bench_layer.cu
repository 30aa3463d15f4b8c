/* bench_layer.cu - one SP attention layer, P = 4 device-local ranks on one GPU (make bench-gpu):
   the time of pack, exchange, attention and unpack, and their share of the layer.

   bf16, B = 1, H = 32, Hkv = 8, D = 128, causal, the flash kernels; S = 16K, 32K, 64K (or the
   arguments). The four virtual ranks run concurrently, each on its own stream. Rank 0 records
   events on its stream at the layer's on_phase hooks, so a phase's time is the GPU time until
   rank 0 is through it, with the other ranks' share of that phase running alongside; the
   exchange includes waiting for the slowest peer. With B = 1 the query side needs no unpack
   and the output side no pack (the driver sends and receives in place). Medians of 7 runs after
   3 warm-up runs. Prints a table on stdout.
   The shares outside attention are upper bounds: rank 0 drains its stream after each pass, so
   the first pack includes its launch, and each exchange meets the other ranks' threads on the
   host, so time the GPU spends waiting for the host counts as exchange time. The peers' last
   unpack of a pass runs after rank 0's last mark.
   One GPU plays four: attention does four ranks' work on it while the exchange is a copy in its
   memory, so the shares are not those of four GPUs, where attention is about 4x faster and the
   exchange crosses NVLink. For those, take one rank's attention time (a quarter of this one's)
   and the exchange's bytes over the link's bandwidth. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "bench_cuda.h"

enum { P = 4, H = 32, HKV = 8, D = 128, WARMUP = 3, RUNS = 7, MARKS = 64 };
static const char *const phases[] = {"pack", "exchange", "attention", "unpack"};

/* Events at the phase hooks of one pass (forward or backward) on rank 0's stream. */
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

/* Adds each phase's time (start mark to the next mark) to ms[0..3] and the pass's to ms[4]. */
static void add_up(timeline *t, float ms[5]) {
    CUDA_OK(cudaEventSynchronize(t->ev[t->n - 1]));
    for (int i = 0; i + 1 < t->n; i++) {
        float x;
        CUDA_OK(cudaEventElapsedTime(&x, t->ev[i], t->ev[i + 1]));
        if (t->phase[i] >= 0) ms[t->phase[i]] += x;
    }
    float all;
    CUDA_OK(cudaEventElapsedTime(&all, t->ev[0], t->ev[t->n - 1]));
    ms[4] += all;
    t->n = 0;
}

typedef struct bench {
    int64_t S;
    float fwd[RUNS][5], bwd[RUNS][5]; /* rank 0, each run: per phase, then the whole pass */
} bench;

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

    timeline t;
    memset(&t, 0, sizeof t);
    t.stream = s;
    for (int i = 0; i < MARKS; i++) CUDA_OK(cudaEventCreate(&t.ev[i]));
    uly_layer L = uly_cuda_layer(&plan, comm, s);
    L.causal = 1;
    if (comm->rank == 0) L.on_phase = mark, L.phase_user = &t;
    L.workspace_bytes = uly_layer_workspace(&L);
    void *saved;
    CUDA_OK(cudaMalloc(&L.workspace, (size_t)L.workspace_bytes));
    const int64_t nsaved = uly_saved_bytes(&plan);
    CUDA_OK(cudaMalloc(&saved, (size_t)nsaved));

    for (int run = -WARMUP; run < RUNS; run++) {
        bench_ok(uly_forward(&L, q, k, v, out, saved, nsaved), "uly_forward");
        if (comm->rank == 0 && run >= 0) add_up(&t, b->fwd[run]);
        t.n = 0;
        bench_ok(uly_backward(&L, dout, saved, nsaved, dq, dk, dv), "uly_backward");
        if (comm->rank == 0 && run >= 0) add_up(&t, b->bwd[run]);
        t.n = 0;
    }
    CUDA_OK(cudaStreamSynchronize(s));
    for (int i = 0; i < MARKS; i++) cudaEventDestroy(t.ev[i]);
    void *all[] = {qkv, dqkv, out.data, dout.data, L.workspace, saved};
    for (void *p : all) cudaFree(p);
    cudaStreamDestroy(s);
}

/* The median over the runs of each column. */
static void print_pass(const char *name, int64_t S, const float runs[RUNS][5]) {
    float ms[5], col[RUNS];
    for (int c = 0; c < 5; c++) {
        for (int r = 0; r < RUNS; r++) col[r] = runs[r][c];
        std::sort(col, col + RUNS);
        ms[c] = col[RUNS / 2];
    }
    printf("%7lld %-8s %9.2f", (long long)S, name, ms[4]);
    for (int p = 0; p < 4; p++) printf(" %8.2f %5.1f%%", ms[p], 100 * ms[p] / ms[4]);
    printf("   %5.1f%%\n", 100 * (ms[4] - ms[ULY_PHASE_ATTN]) / ms[4]);
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
        bench_ok(uly_cuda_local_run(P, rank_main, &b), "uly_cuda_local_run");
        print_pass("forward", S, b.fwd);
        print_pass("backward", S, b.bwd);
    }
    return 0;
}
