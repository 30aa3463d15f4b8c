/* test_nccl.cu - the NCCL communicator of ulysses_cuda.cuh (uly_nccl_comm, uly_nccl_split,
   uly_nccl_wait), run under the CUDA emulator against tests/emu/nccl_emu.cpp, an in-process
   NCCL whose ranks are threads (each a thread of uly_local_run with its own communicator).

   - The SP layer over uly_nccl_comm for P = 1..4 equals the same attention run unsharded: the
     forward and backward bit for bit (dK, dV of a split group: the ranks' shares summed as the
     layer sums them), and in fp32 the CPU reference (sp_cuda_case.h's check_layer). Where S,
     H and Hkv divide by P every block of every exchange has one size on every rank, and the
     layer calls alltoall: ncclAlltoAll; with uneven S none does, and alltoallv moves all with
     grouped ncclSend/ncclRecv. The double's call counts prove which path ran, and its record
     (each NCCL call with its stream) that every exchange was queued on the layer's stream.
   - alltoallv: every byte lands where the counts and offsets say and no other byte is written,
     through one ncclSend and one ncclRecv per non-empty block, never ncclAlltoAll (a collective
     all ranks would have to choose alike): for uniform counts, uneven counts with empty blocks,
     uniform counts with gaps, and counts uniform on one rank only; a failing ncclGroupEnd (the
     double's answer to a send/recv count mismatch, which real NCCL cannot see: it would hang
     until uly_nccl_wait's timeout) is ULY_ECOMM on both ranks. alltoall: one ncclAlltoAll per
     rank.
   - allreduce_sum: device memory directly, host memory through scratch in chunks of
     ULY_NCCL_SCRATCH, every rank getting the same sum, all on the caller's stream (given
     none: uly_nccl.stream, which uly_nccl_comm requires); without scratch, host memory and barrier
     are ULY_EUNSUPPORTED; barrier returns on no rank before every rank has called it; both
     give up on a stalled stream after uly_nccl.timeout_s. uly_layer_agree (two sums of host
     memory) fails on every rank when one rank's layer is not causal. Nothing to move (count 0,
     NULL buffers): allreduce_sum, alltoall and alltoallv succeed, each collective still called.
   - uly_nccl_split: SP groups of consecutive ranks and DP groups across them (sizes, ranks and
     members), by ncclCommSplit's color/key rule, checked on the double too; an sp_size that
     does not divide the world is ULY_EINVAL.
   - Non-blocking communicators: the layer, splits, allreduce_sum and barrier work when every
     call answers ncclInProgress (each waits until NCCL says the work is queued; calls given no
     stream take uly_nccl.stream), a split takes a world still joining its peers, and a call
     that stays in progress, as when a peer never arrives, is ULY_ECOMM after
     uly_nccl.timeout_s.
   - An NCCL older than 2.28 at run time (the double reports 2.27, and in build/test_nccl_2_27
     has no ncclAlltoAll symbol either): no alltoall.
   - Errors: a failing ncclSend, ncclAlltoAll or ncclAllReduce is ULY_ECOMM quoting NCCL's error
     string and last error; an asynchronous error fails the next call, and uly_nccl_wait reports
     it (on a stalled stream and on a finished one); so does a stream not done within the
     timeout; neither aborts the caller's communicator, and the message says to; a failed DP
     split returns what it made and destroys nothing; NULL arguments (uly_nccl.stream too) are
     ULY_EINVAL.

   Emulator only: NCCL refuses two ranks on one GPU, so this cannot run on a single real GPU.
   The NCCL code on GPUs is make test-gpu's MPI run of examples/sp_attention_nccl.cu (which make
   test runs here too, its ranks as threads: tests/emu/mpi_emu.cpp). */
#include "emu/cuda_emu.h"
#include <nccl.h>
#include "emu/nccl_emu.h"
#define ULYSSES_NCCL
/* A private copy (ULYSSES_STATIC): the compiler then drops the kernels this program never
   calls, a third of its build otherwise. */
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "ref64.h"
#include "sp_case.h"
#include "sp_cuda_case.h"

#include <time.h>

/* The injected failures' last error. */
static const char *const kFaultMsg = "emulated: the connection to rank 1 closed";

static unsigned long long calls(const char *call) { return uly_emu_nccl_calls(call); }

static ncclComm_t nccl_of(const uly_comm *c) { return ((const uly_nccl *)c->ctx)->comm; }

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---------------------------------------------------------------------------------------------
   Ranks on NCCL: the threads of uly_local_run, each a rank of one NCCL communicator */

typedef struct nccl_job {
    ncclUniqueId id;
    void (*fn)(const uly_comm *comm, void *user);
    void *user;
    double timeout_s; /* uly_nccl.timeout_s */
    int abort;        /* abort the communicators at the end (a test timed out on purpose) */
    int nonblocking;  /* ncclConfig_t.blocking = 0, with a stream of the rank's own */
    uly_status st[4];
} nccl_job;

static void nccl_rank(const uly_comm *local, void *user) {
    nccl_job *j = (nccl_job *)user;
    ncclComm_t comm = NULL;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = !j->nonblocking;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, local->size, j->id, local->rank, &config);
    if (r != ncclSuccess && !(j->nonblocking && r == ncclInProgress)) { /* uly_nccl_comm waits */
        CHECK(0, "rank %d: ncclCommInitRankConfig: %s", local->rank, ncclGetLastError(NULL));
        return;
    }
    double *scratch = NULL;
    cudaMalloc((void **)&scratch, ULY_NCCL_SCRATCH * sizeof(double));
    cudaStream_t own = NULL;
    cudaStreamCreate(&own);
    uly_nccl n = {comm, scratch, j->timeout_s, own};
    uly_comm c;
    j->st[local->rank] = uly_nccl_comm(&n, &c);
    if (!j->st[local->rank].code) j->fn(&c, j->user);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess || j->abort) ncclCommAbort(comm); /* as the library says to */
    else ncclCommDestroy(comm);
    cudaFree(scratch);
    cudaStreamDestroy(own);
}

/* fn on `size` ranks of a new NCCL communicator, each with ULY_NCCL_SCRATCH doubles of scratch
   and the given timeout; the first error of the run. */
static uly_status nccl_run_as(int size, void (*fn)(const uly_comm *comm, void *user),
                              void *user, double timeout_s, int nonblocking) {
    nccl_job j;
    memset(&j, 0, sizeof j);
    j.fn = fn, j.user = user, j.timeout_s = timeout_s, j.abort = timeout_s > 0;
    j.nonblocking = nonblocking;
    ncclGetUniqueId(&j.id);
    uly_status st = uly_local_run(size, nccl_rank, &j);
    for (int r = 0; r < size && !st.code; r++) st = j.st[r];
    return st;
}

static uly_status nccl_run_timed(int size, void (*fn)(const uly_comm *comm, void *user),
                                 void *user, double timeout_s) {
    return nccl_run_as(size, fn, user, timeout_s, 0);
}

/* The same with no time limit (an sp_runner). */
static uly_status nccl_run(int size, void (*fn)(const uly_comm *comm, void *user), void *user) {
    return nccl_run_timed(size, fn, user, 0);
}

/* On non-blocking communicators, each rank with a stream of its own (an sp_runner). */
static uly_status nccl_run_nonblocking(int size, void (*fn)(const uly_comm *comm, void *user),
                                       void *user) {
    return nccl_run_as(size, fn, user, 0, 1);
}

/* An injected failure: the next `call` on every rank's communicator returns r. */
typedef struct fault {
    const char *call;
    ncclResult_t r;
} fault;

static void inject(const uly_comm *c, const fault *f) {
    if (f->call) uly_emu_nccl_fail(nccl_of(c), f->call, f->r, kFaultMsg);
}

/* st is ULY_ECOMM with what NCCL's caller, NCCL's string for r and the last error say. */
static void check_ecomm(uly_status st, int rank, const char *what, ncclResult_t r,
                        const char *last) {
    CHECK(st.code == ULY_ECOMM && strstr(st.msg, what) && strstr(st.msg, ncclGetErrorString(r)) &&
              strstr(st.msg, last),
          "rank %d: code %d '%s', want ULY_ECOMM with '%s', '%s' and '%s'", rank, (int)st.code,
          st.msg, what, ncclGetErrorString(r), last);
}

/* ---------------------------------------------------------------------------------------------
   The SP layer over NCCL */

/* P, B, S, H, Hkv, D, causal, fused, scale. The first five divide S and H by P, and give every
   rank as many kv heads; the others split S unevenly. */
static const sp_case layer_cases[] = {
    {1, 2, 7, 4, 2, 8, 1, 1, 0},     /* one rank: the exchanges are copies to itself */
    {2, 1, 16, 4, 4, 8, 1, 0, 0},    /* MHA */
    {2, 2, 12, 4, 2, 8, 0, 1, 0},    /* GQA, B = 2, fused QKV */
    {4, 1, 16, 8, 4, 8, 1, 0, 0},    /* GQA over four ranks */
    {4, 1, 16, 8, 2, 8, 0, 1, 0},    /* Hkv < P: each kv head on two ranks, dK/dV copies summed */
    {2, 1, 7, 3, 1, 8, 1, 1, 0},     /* MQA, uneven H too */
    {3, 2, 17, 6, 2, 8, 1, 0, 0},    /* g = 3 over H_r = 2: a GQA group split across ranks */
    {4, 2, 67, 8, 2, 16, 1, 1, 0},   /* Hkv < P: replicated kv heads, summed gradients */
    {4, 1, 9, 6, 3, 8, 1, 0, 0.3f},  /* H_r = 2, 2, 1, 1; explicit scale */
};
enum { NLAYER = sizeof layer_cases / sizeof *layer_cases };

/* Whether every rank has as many kv heads: with H % P == 0 rank r has query heads
   [r H/P, (r+1) H/P), and needs the kv heads of their groups. */
static int kv_even(const sp_case *c) {
    const int64_t hr = c->H / c->P, g = c->H / c->Hkv;
    for (int r = 1; r < c->P; r++)
        if ((r * hr + hr - 1) / g - r * hr / g != (hr - 1) / g) return 0;
    return 1;
}

/* check_layer over NCCL, and the path: with S and H divisible by P and as many kv heads on every
   rank, every block of every exchange has one size, so alltoall's ncclAlltoAll and no
   ncclSend; with S uneven the ranks' blocks differ in every exchange, so alltoallv's
   ncclSend/ncclRecv only; and only those where ULY_NCCL_ALLTOALL is 0 (make test builds this
   file both ways). */
static void check_nccl_layer(const sp_case *c, uly_dtype t) {
    const unsigned long long a0 = calls("ncclAlltoAll"), s0 = calls("ncclSend");
    const unsigned long long r0 = calls("ncclRecv");
    check_layer(c, t, nccl_run);
    const unsigned long long a = calls("ncclAlltoAll") - a0, s = calls("ncclSend") - s0;
    const unsigned long long r = calls("ncclRecv") - r0;
    const int even = c->S % c->P == 0 && c->H % c->P == 0 && kv_even(c);
    const int uneven = c->S % c->P != 0, a2a = ULY_NCCL_ALLTOALL && even;
    CHECK(a2a ? a > 0 && s == 0 && r == 0 : (even || uneven) && a == 0 && s > 0 && r == s,
          SP_CASE_FMT ": %llu ncclAlltoAll, %llu ncclSend, %llu ncclRecv calls; want %s",
          SP_CASE_ARGS(c), a, s, r, a2a ? "ncclAlltoAll only" : "ncclSend/ncclRecv only");
}

TEST(layer_over_nccl_f32_matches_unsharded_and_cpu) {
    for (int i = 0; i < NLAYER; i++) check_nccl_layer(&layer_cases[i], ULY_F32);
}

TEST(layer_over_nccl_bf16_matches_unsharded) {
    check_nccl_layer(&layer_cases[2], ULY_BF16); /* ncclAlltoAll */
    check_nccl_layer(&layer_cases[4], ULY_BF16); /* ncclAlltoAll, replicated kv summed */
    check_nccl_layer(&layer_cases[6], ULY_BF16); /* ncclSend/ncclRecv, split group summed */
}

/* ---------------------------------------------------------------------------------------------
   alltoallv

   Rank i sends count(i, j) bytes to rank j, byte b of them (37 i + 11 j + b + 1) mod 256. Each
   block is followed by `gap` bytes no one writes, in the send and in the receive buffer. */

typedef enum { UNIFORM, UNEVEN, GAPPED, RANK0_UNIFORM } a2a_shape;

static int64_t a2a_count(a2a_shape s, int i, int j) {
    switch (s) {
    case UNEVEN: return (i + 2 * j) % 4;
    case RANK0_UNIFORM: return i && j ? 1 + 2 * (i == j) : 2; /* rank 0's row and column: 2 */
    default: return 5;
    }
}
static int64_t a2a_gap(a2a_shape s) { return s == UNEVEN ? 1 : s == GAPPED ? 3 : 0; }
static unsigned char a2a_byte(int i, int j, int64_t b) {
    return (unsigned char)(37 * i + 11 * j + b + 1);
}

enum { A2A_BYTES = 64, UNTOUCHED = 0xee };

/* One exchange on c; the received bytes that are not what the counts say (mismatch: rank 1
   expects one byte more from rank 0, and nothing is compared). */
static uly_status exchange(const uly_comm *c, a2a_shape shape, int mismatch, int64_t *wrong) {
    const int P = c->size, r = c->rank;
    const int64_t gap = a2a_gap(shape);
    int64_t sc[4], so[4], rc[4], ro[4], at = 0, from = 0;
    unsigned char host[A2A_BYTES];
    memset(host, 0, sizeof host);
    for (int q = 0; q < P; q++) {
        sc[q] = a2a_count(shape, r, q), so[q] = at, at += sc[q] + gap;
        rc[q] = a2a_count(shape, q, r) + (mismatch && r == 1 && q == 0), ro[q] = from;
        from += rc[q] + gap;
        for (int64_t b = 0; b < sc[q]; b++) host[so[q] + b] = a2a_byte(r, q, b);
    }
    void *send, *recv;
    cudaStream_t s;
    cudaMalloc(&send, A2A_BYTES), cudaMalloc(&recv, A2A_BYTES);
    cudaMemcpy(send, host, A2A_BYTES, cudaMemcpyHostToDevice);
    cudaMemset(recv, UNTOUCHED, A2A_BYTES);
    cudaStreamCreate(&s);
    uly_status st = c->alltoallv(c->ctx, send, sc, so, recv, rc, ro, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(host, recv, A2A_BYTES, cudaMemcpyDeviceToHost);
    for (int64_t b = 0; b < A2A_BYTES && !mismatch; b++) {
        int want = UNTOUCHED;
        for (int q = 0; q < P; q++)
            if (b >= ro[q] && b < ro[q] + rc[q]) want = a2a_byte(q, r, b - ro[q]);
        *wrong += host[b] != want;
    }
    cudaStreamDestroy(s);
    cudaFree(send), cudaFree(recv);
    return st;
}

typedef struct a2a_job {
    a2a_shape shape;
    int mismatch;
    fault f;
    uly_status st[4];
    int64_t wrong[4];
} a2a_job;

static void a2a_main(const uly_comm *c, void *user) {
    a2a_job *j = (a2a_job *)user;
    inject(c, &j->f);
    j->st[c->rank] = exchange(c, j->shape, j->mismatch, &j->wrong[c->rank]);
}

/* P = 1..4: the bytes, and the path: one ncclSend and one ncclRecv per non-empty block. */
static void check_alltoallv(a2a_shape shape) {
    for (int P = 1; P <= 4; P++) {
        a2a_job j;
        memset(&j, 0, sizeof j);
        j.shape = shape;
        const unsigned long long a0 = calls("ncclAlltoAll"), s0 = calls("ncclSend");
        const unsigned long long r0 = calls("ncclRecv");
        uly_status st = nccl_run(P, a2a_main, &j);
        CHECK(!st.code, "P=%d: %s", P, st.msg);
        for (int r = 0; r < P; r++)
            CHECK(!j.st[r].code && !j.wrong[r], "P=%d rank %d: '%s', %lld wrong bytes", P, r,
                  j.st[r].msg, (long long)j.wrong[r]);
        unsigned long long blocks = 0;
        for (int a = 0; a < P; a++)
            for (int b = 0; b < P; b++) blocks += a2a_count(shape, a, b) != 0;
        const unsigned long long a = calls("ncclAlltoAll") - a0, s = calls("ncclSend") - s0;
        const unsigned long long r = calls("ncclRecv") - r0;
        CHECK(a == 0 && s == blocks && r == blocks,
              "P=%d: %llu ncclAlltoAll, %llu ncclSend, %llu ncclRecv; want 0, %llu, %llu", P, a,
              s, r, blocks, blocks);
    }
}

TEST(alltoallv_uniform_counts_go_through_send_recv_too) { check_alltoallv(UNIFORM); }
TEST(alltoallv_uneven_counts_and_empty_blocks_go_through_send_recv) { check_alltoallv(UNEVEN); }
TEST(alltoallv_uniform_counts_with_gaps_go_through_send_recv) { check_alltoallv(GAPPED); }

/* Counts uniform on rank 0 only (its row and column are all 2, while ranks 1.. exchange 1 and 3
   bytes): a valid alltoallv. A rank that took ncclAlltoAll because its own counts are uniform
   would wait there for peers in ncclRecv: NCCL hangs, the double reports the deadlock. */
TEST(alltoallv_with_counts_uniform_on_one_rank_only) {
    for (int P = 3; P <= 4; P++) {
        a2a_job j;
        memset(&j, 0, sizeof j);
        j.shape = RANK0_UNIFORM;
        uly_status st = nccl_run(P, a2a_main, &j);
        CHECK(!st.code, "P=%d: %s", P, st.msg);
        for (int r = 0; r < P; r++)
            CHECK(!j.st[r].code && !j.wrong[r], "P=%d rank %d: '%s', %lld wrong bytes", P, r,
                  j.st[r].msg, (long long)j.wrong[r]);
    }
}

/* Rank 1 expects 3 bytes from rank 0, which sends 2: the double fails ncclGroupEnd on both
   ranks (real NCCL would hang), and both calls return that as ULY_ECOMM. */
TEST(a_failing_ncclGroupEnd_is_ecomm_on_both_ranks) {
    a2a_job j;
    memset(&j, 0, sizeof j);
    j.shape = UNEVEN, j.mismatch = 1;
    uly_status st = nccl_run(2, a2a_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++)
        check_ecomm(j.st[r], r, "alltoallv: ncclGroupEnd", ncclInvalidUsage,
                    "rank 1 receives 3 bytes from rank 0, which sends 2");
}

static void comm_main(const uly_comm *c, void *user) { *(uly_comm *)user = *c; }

/* A one-rank NCCL communicator offers alltoallv and no alltoall. */
static void check_no_alltoall(void) {
    uly_comm c;
    memset(&c, 0xff, sizeof c);
    uly_status st = nccl_run(1, comm_main, &c);
    CHECK(!st.code, "%s", st.msg);
    CHECK(c.alltoallv && !c.alltoall, "alltoallv %p, alltoall %p; want set, NULL",
          (void *)c.alltoallv, (void *)c.alltoall);
}

#if ULY_NCCL_ALLTOALL
/* alltoall: rank i sends 5 bytes to each rank j, block j of its buffer. */
static uly_status exchange_uniform(const uly_comm *c, int64_t *wrong) {
    const int P = c->size, r = c->rank;
    enum { N = 5 };
    unsigned char host[4 * N];
    for (int q = 0; q < P; q++)
        for (int64_t b = 0; b < N; b++) host[q * N + b] = a2a_byte(r, q, b);
    void *send, *recv;
    cudaMalloc(&send, sizeof host), cudaMalloc(&recv, sizeof host);
    cudaMemcpy(send, host, sizeof host, cudaMemcpyHostToDevice);
    uly_status st = c->alltoall(c->ctx, send, recv, N, NULL);
    cudaMemcpy(host, recv, sizeof host, cudaMemcpyDeviceToHost);
    for (int q = 0; q < P; q++)
        for (int64_t b = 0; b < N; b++) *wrong += host[q * N + b] != a2a_byte(q, r, b);
    cudaFree(send), cudaFree(recv);
    return st;
}

static void a2a_uniform_main(const uly_comm *c, void *user) {
    a2a_job *j = (a2a_job *)user;
    inject(c, &j->f);
    j->st[c->rank] = exchange_uniform(c, &j->wrong[c->rank]);
}

TEST(alltoall_goes_through_ncclAlltoAll) {
    for (int P = 1; P <= 4; P++) {
        a2a_job j;
        memset(&j, 0, sizeof j);
        const unsigned long long a0 = calls("ncclAlltoAll"), s0 = calls("ncclSend");
        uly_status st = nccl_run(P, a2a_uniform_main, &j);
        CHECK(!st.code, "P=%d: %s", P, st.msg);
        for (int r = 0; r < P; r++)
            CHECK(!j.st[r].code && !j.wrong[r], "P=%d rank %d: '%s', %lld wrong bytes", P, r,
                  j.st[r].msg, (long long)j.wrong[r]);
        const unsigned long long a = calls("ncclAlltoAll") - a0, s = calls("ncclSend") - s0;
        CHECK(a == (unsigned)P && s == 0, "P=%d: %llu ncclAlltoAll, %llu ncclSend; want %d, 0", P,
              a, s, P);
    }
}

/* Built against NCCL 2.28 but run with an older library, which has no ncclAlltoAll: the
   communicator offers no alltoall, and the layer's uniform exchanges go through
   ncclSend/ncclRecv. Here the double reports the older version; in build/test_nccl_2_27 it
   also lacks the symbol, which the library's weak reference lets link (and load). */
TEST(an_older_nccl_at_run_time_gives_no_alltoall) {
    int version = 0;
    ncclGetVersion(&version);
    uly_emu_nccl_version(NCCL_VERSION(2, 27, 7));
    check_no_alltoall();
    const unsigned long long a0 = calls("ncclAlltoAll"), s0 = calls("ncclSend");
    check_layer(&layer_cases[2], ULY_F32, nccl_run); /* every block of one size */
    const unsigned long long a = calls("ncclAlltoAll") - a0, s = calls("ncclSend") - s0;
    CHECK(a == 0 && s > 0, "%llu ncclAlltoAll, %llu ncclSend; want 0, > 0", a, s);
    uly_emu_nccl_version(version);
}

/* The first library that has ncclAlltoAll, 2.28.0 itself, is used through it: the run-time
   version check includes its bound. */
TEST(nccl_2_28_0_at_run_time_gives_alltoall) {
    int version = 0;
    ncclGetVersion(&version);
    uly_emu_nccl_version(NCCL_VERSION(2, 28, 0));
    uly_comm c;
    memset(&c, 0, sizeof c);
    const uly_status st = nccl_run(1, comm_main, &c);
    CHECK(!st.code && c.alltoallv && c.alltoall, "'%s'; alltoallv %p, alltoall %p; want both set",
          st.msg, (void *)c.alltoallv, (void *)c.alltoall);
    uly_emu_nccl_version(version);
}
#else
TEST(without_ncclAlltoAll_the_communicator_has_no_alltoall) { check_no_alltoall(); }
#endif

/* ---------------------------------------------------------------------------------------------
   allreduce_sum and barrier */

/* Rank r's value i. Magnitudes 1e16 apart: the sum depends on the order of the additions. */
static double sum_value(int r, int64_t i) {
    return (r % 2 ? 1.0 + (double)i : 1e16) * (r == 2 ? -1 : 1) + 0.25 * r;
}

enum { SUM_MAX = 150 };

/* The sum of values i over P ranks, added in rank order. */
static double rank_order_sum(int P, int64_t i) {
    double s = sum_value(0, i);
    for (int r = 1; r < P; r++) s += sum_value(r, i);
    return s;
}

/* allreduce_sum of n values, in device memory or in host memory, on a stream of the rank's own;
   the results into got, and into *off_stream the first operation it queued elsewhere (NULL if
   none; emulated). */
static uly_status sum(const uly_comm *c, int64_t n, int on_device, double *got,
                      const char **off_stream) {
    for (int64_t i = 0; i < n; i++) got[i] = sum_value(c->rank, i);
    double *dev = NULL;
    cudaStream_t s;
    cudaStreamCreate(&s);
    if (on_device) {
        cudaMalloc((void **)&dev, (size_t)n * sizeof(double));
        cudaMemcpy(dev, got, (size_t)n * sizeof(double), cudaMemcpyHostToDevice);
    }
    uly_emu_record_reset();
    uly_status st = c->allreduce_sum(c->ctx, on_device ? dev : got, n, s);
    *off_stream = recorded_calls(s).off_stream;
    cudaStreamSynchronize(s);
    if (on_device) cudaMemcpy(got, dev, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost);
    cudaFree(dev);
    cudaStreamDestroy(s);
    return st;
}

typedef struct sum_job {
    int64_t n;
    int on_device, barrier; /* barrier: the job calls comm->barrier instead of a sum */
    fault f;
    uly_status st[4];
    const char *off_stream[4];
    double got[4][SUM_MAX];
} sum_job;

static void sum_main(const uly_comm *c, void *user) {
    sum_job *j = (sum_job *)user;
    inject(c, &j->f);
    double *got = j->got[c->rank];
    j->st[c->rank] = j->barrier ? c->barrier(c->ctx)
                                : sum(c, j->n, j->on_device, got, &j->off_stream[c->rank]);
}

/* P = 1..4: every rank gets the rank-order sum, bit for bit, from `chunks` ncclAllReduce calls
   per rank, all its work on its stream. */
static void check_sum(int64_t n, int on_device, int chunks) {
    for (int P = 1; P <= 4; P++) {
        sum_job j;
        memset(&j, 0, sizeof j);
        j.n = n, j.on_device = on_device;
        const unsigned long long a0 = calls("ncclAllReduce");
        uly_status st = nccl_run(P, sum_main, &j);
        CHECK(!st.code, "P=%d: %s", P, st.msg);
        int64_t wrong = 0;
        for (int r = 0; r < P; r++) {
            CHECK(!j.st[r].code && !j.off_stream[r], "P=%d rank %d: '%s', %s not on the "
                  "caller's stream", P, r, j.st[r].msg,
                  j.off_stream[r] ? j.off_stream[r] : "nothing");
            for (int64_t i = 0; i < n; i++) wrong += j.got[r][i] != rank_order_sum(P, i);
        }
        const unsigned long long a = calls("ncclAllReduce") - a0;
        CHECK(!wrong && a == (unsigned long long)(P * chunks),
              "P=%d: %lld wrong sums, %llu ncclAllReduce calls (want %d)", P, (long long)wrong, a,
              P * chunks);
    }
}

/* 150 values in one call: device memory needs no scratch. */
TEST(allreduce_of_device_memory_sums_in_place_in_one_call) { check_sum(SUM_MAX, 1, 1); }

/* 150 values: chunks of 64, 64 and 22 through the scratch buffer. */
TEST(allreduce_of_host_memory_goes_through_scratch_in_chunks) {
    check_sum(SUM_MAX, 0, (SUM_MAX + ULY_NCCL_SCRATCH - 1) / ULY_NCCL_SCRATCH);
}

/* Nothing to move, with NULL buffers, as uly_comm allows: every rank succeeds, still making the
   collective call (NCCL takes a count of 0), which a rank must not skip alone. */
typedef struct nothing_job {
    uly_status sum[4], a2a[4], a2av[4];
} nothing_job;

static void nothing_main(const uly_comm *c, void *user) {
    nothing_job *j = (nothing_job *)user;
    const int64_t zero[4] = {0, 0, 0, 0};
    j->sum[c->rank] = c->allreduce_sum(c->ctx, NULL, 0, NULL);
    if (c->alltoall) j->a2a[c->rank] = c->alltoall(c->ctx, NULL, NULL, 0, NULL);
    j->a2av[c->rank] = c->alltoallv(c->ctx, NULL, zero, zero, NULL, zero, zero, NULL);
}

TEST(allreduce_and_alltoall_of_nothing_take_null_buffers) {
    for (int P = 1; P <= 4; P++) {
        const unsigned long long s0 = calls("ncclAllReduce"), a0 = calls("ncclAlltoAll");
        const nothing_job j = run_job<nothing_job>(nccl_run, P, nothing_main);
        for (int r = 0; r < P; r++)
            CHECK(!j.sum[r].code && !j.a2a[r].code && !j.a2av[r].code,
                  "P=%d rank %d: allreduce_sum '%s', alltoall '%s', alltoallv '%s'", P, r,
                  j.sum[r].msg, j.a2a[r].msg, j.a2av[r].msg);
        const unsigned long long s = calls("ncclAllReduce") - s0, a = calls("ncclAlltoAll") - a0;
        const unsigned long long want_a = ULY_NCCL_ALLTOALL ? (unsigned)P : 0;
        CHECK(s == (unsigned)P && a == want_a, "P=%d: %llu ncclAllReduce, %llu ncclAlltoAll; "
              "want %d, %llu", P, s, a, P, want_a);
    }
}

/* No stream, as uly_loss_reduce calls it (host memory), and device memory: every operation on
   uly_nccl.stream, none on the legacy stream (which waits for every blocking stream, another
   communicator's collectives among them) or the per-thread one (another stream to NCCL's own
   thread). off[memory][rank]: the first operation elsewhere, if any. */
static void no_stream_main(const uly_comm *c, void *user) {
    const char *(*off)[2] = (const char *(*)[2])user;
    const cudaStream_t want = (cudaStream_t)((const uly_nccl *)c->ctx)->stream;
    double host[2] = {1, 2}, *dev = NULL;
    CHECK(cudaMalloc(&dev, sizeof host) == cudaSuccess, "cudaMalloc");
    cudaMemcpy(dev, host, sizeof host, cudaMemcpyHostToDevice);
    for (int on_device = 0; on_device < 2; on_device++) {
        uly_emu_record_reset();
        double *v = on_device ? dev : host;
        const uly_status st = c->allreduce_sum(c->ctx, v, 2, NULL);
        off[on_device][c->rank] = recorded_calls(want).off_stream;
        cudaStreamSynchronize(want);
        if (on_device) cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost);
        CHECK(!st.code && host[0] == c->size && host[1] == 2 * c->size,
              "rank %d, %s memory: '%s', sums %g %g", c->rank, on_device ? "device" : "host",
              st.msg, host[0], host[1]);
        host[0] = 1, host[1] = 2;
    }
    cudaFree(dev);
}

static void check_no_stream(sp_runner run) {
    const char *off[2][2] = {{NULL, NULL}, {NULL, NULL}};
    const uly_status st = run(2, no_stream_main, off);
    for (int m = 0; m < 2; m++)
        CHECK(!st.code && !off[m][0] && !off[m][1], "'%s'; %s memory, off the stream: %s, %s",
              st.msg, m ? "device" : "host", off[m][0] ? off[m][0] : "nothing",
              off[m][1] ? off[m][1] : "nothing");
}

TEST(allreduce_without_a_stream_runs_on_uly_nccl_stream) { check_no_stream(nccl_run); }

typedef struct bare_job {
    uly_status host[4], dev[4], barrier[4];
    double got[4];
} bare_job;

/* A second uly_nccl over the rank's communicator, without scratch. */
static void bare_main(const uly_comm *c, void *user) {
    bare_job *j = (bare_job *)user;
    uly_nccl bare = {nccl_of(c), NULL, 0, ((const uly_nccl *)c->ctx)->stream};
    uly_comm b;
    if (uly_nccl_comm(&bare, &b).code) return;
    double host[2] = {1, 2};
    j->host[c->rank] = b.allreduce_sum(b.ctx, host, 2, NULL);
    j->barrier[c->rank] = b.barrier(b.ctx);
    const char *off_stream;
    j->dev[c->rank] = sum(&b, 1, 1, &j->got[c->rank], &off_stream);
}

TEST(without_scratch_host_memory_and_barrier_are_unsupported) {
    const bare_job j = run_job<bare_job>(nccl_run, 2, bare_main);
    for (int r = 0; r < 2; r++) {
        CHECK(j.host[r].code == ULY_EUNSUPPORTED &&
                  strstr(j.host[r].msg, "allreduce_sum of host memory: uly_nccl.scratch is NULL"),
              "rank %d host memory: '%s'", r, j.host[r].msg);
        CHECK(j.barrier[r].code == ULY_EUNSUPPORTED &&
                  strstr(j.barrier[r].msg, "barrier: uly_nccl.scratch is NULL"),
              "rank %d barrier: '%s'", r, j.barrier[r].msg);
        CHECK(!j.dev[r].code && j.got[r] == rank_order_sum(2, 0),
              "rank %d device memory needs no scratch: '%s', sum %g", r, j.dev[r].msg, j.got[r]);
    }
}

TEST(barrier_holds_every_rank_until_all_arrive) { check_barrier(nccl_run); }

/* Two sums of host memory through scratch; sp_cuda_case.h's check. */
TEST(layer_agree_fails_on_every_rank_when_one_is_not_causal) { check_agree(nccl_run); }

/* ---------------------------------------------------------------------------------------------
   uly_nccl_split */

typedef struct split_job {
    int sp_size;
    uly_status st[4];
    int size[4][2], rank[4][2]; /* SP, DP */
    double members[4][2];        /* the sum of 2^(world rank) over the members */
} split_job;

static void split_main(const uly_comm *c, void *user) {
    split_job *j = (split_job *)user;
    const int r = c->rank;
    ncclComm_t group[2] = {NULL, NULL};
    j->st[r] = uly_nccl_split(nccl_of(c), j->sp_size, 0, &group[0], &group[1]);
    for (int g = 0; g < 2 && !j->st[r].code; g++) {
        uly_nccl n = {group[g], NULL, 0, ((const uly_nccl *)c->ctx)->stream};
        uly_comm gc;
        j->st[r] = uly_nccl_comm(&n, &gc);
        j->size[r][g] = gc.size, j->rank[r][g] = gc.rank;
        double *dev, one = ldexp(1.0, r);
        cudaMalloc((void **)&dev, sizeof(double));
        cudaMemcpy(dev, &one, sizeof one, cudaMemcpyHostToDevice);
        if (!j->st[r].code) j->st[r] = gc.allreduce_sum(gc.ctx, dev, 1, NULL);
        cudaMemcpy(&j->members[r][g], dev, sizeof(double), cudaMemcpyDeviceToHost);
        cudaFree(dev);
    }
    ncclCommDestroy(group[0]), ncclCommDestroy(group[1]);
}

/* World rank r of 4: SP group r / P holds ranks [P (r / P), + P), where r has rank r % P; DP
   group r % P holds ranks r % P + k P, where r has rank r / P. */
static void check_split(sp_runner run) {
    const int sizes[] = {1, 2, 4};
    for (int P : sizes) {
        split_job j;
        memset(&j, 0, sizeof j);
        j.sp_size = P;
        uly_status st = run(4, split_main, &j);
        CHECK(!st.code, "sp_size %d: %s", P, st.msg);
        for (int r = 0; r < 4; r++) {
            double sp = 0, dp = 0;
            for (int q = 0; q < 4; q++) {
                sp += q / P == r / P ? ldexp(1.0, q) : 0;
                dp += q % P == r % P ? ldexp(1.0, q) : 0;
            }
            CHECK(!j.st[r].code && j.size[r][0] == P && j.rank[r][0] == r % P &&
                      j.size[r][1] == 4 / P && j.rank[r][1] == r / P && j.members[r][0] == sp &&
                      j.members[r][1] == dp,
                  "sp_size %d rank %d: '%s'; SP rank %d of %d, members %g (want %d of %d, %g); "
                  "DP rank %d of %d, members %g (want %d of %d, %g)", P, r, j.st[r].msg,
                  j.rank[r][0], j.size[r][0], j.members[r][0], r % P, P, sp, j.rank[r][1],
                  j.size[r][1], j.members[r][1], r / P, 4 / P, dp);
        }
    }
}

TEST(split_gives_sp_groups_of_consecutive_ranks_and_dp_groups_across) { check_split(nccl_run); }

/* A non-blocking world fresh from ncclCommInitRankConfig, still joining its peers, goes straight
   to uly_nccl_split, as the header's USAGE has it: the split waits for the world before it
   reads the world's size (the double aborts on a call to a communicator in progress). */
typedef struct fresh_job {
    ncclUniqueId id;
    uly_status st[4];
    int size[4], rank[4]; /* in the SP group */
} fresh_job;

static void fresh_split_rank(const uly_comm *local, void *user) {
    fresh_job *j = (fresh_job *)user;
    const int r = local->rank;
    ncclComm_t world = NULL, sp = NULL, dp = NULL;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t init = ncclCommInitRankConfig(&world, local->size, j->id, r, &config);
    j->st[r] = uly__nccl(init == ncclInProgress ? ncclSuccess : init, NULL, "init");
    if (!j->st[r].code) j->st[r] = uly_nccl_split(world, 2, 0, &sp, &dp);
    cudaStream_t s;
    cudaStreamCreate(&s);
    uly_nccl n = {sp, NULL, 0, s};
    uly_comm c;
    if (!j->st[r].code) j->st[r] = uly_nccl_comm(&n, &c);
    if (!j->st[r].code) j->size[r] = c.size, j->rank[r] = c.rank;
    ncclCommDestroy(sp), ncclCommDestroy(dp), ncclCommDestroy(world);
    cudaStreamDestroy(s);
}

TEST(split_waits_for_a_nonblocking_world_still_joining_its_peers) {
    fresh_job j;
    memset(&j, 0, sizeof j);
    ncclGetUniqueId(&j.id);
    uly_status st = uly_local_run(4, fresh_split_rank, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 4; r++)
        CHECK(!j.st[r].code && j.size[r] == 2 && j.rank[r] == r % 2,
              "rank %d: '%s', SP rank %d of %d (want %d of 2)", r, j.st[r].msg, j.rank[r],
              j.size[r], r % 2);
}

TEST(split_rejects_an_sp_size_that_does_not_divide_the_world) {
    split_job j;
    memset(&j, 0, sizeof j);
    j.sp_size = 3;
    const unsigned long long s0 = calls("ncclCommSplit");
    uly_status st = nccl_run(4, split_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 4; r++)
        CHECK(j.st[r].code == ULY_EINVAL &&
                  !strcmp(j.st[r].msg,
                          "uly_nccl_split: sp_size (3) must divide the world's size (4)"),
              "rank %d: '%s'", r, j.st[r].msg);
    CHECK(calls("ncclCommSplit") == s0, "ncclCommSplit was called");
}

/* The DP split fails on every rank (the SP one went through): the error comes back with the SP
   communicator in *sp and *dp NULL, for the caller to abort; the library destroys nothing,
   since destroying is itself a collective that a peer stuck in the split would never join. */
static void split_fail_main(const uly_comm *c, void *user) {
    split_job *j = (split_job *)user;
    ncclComm_t sp = NULL, dp = NULL;
    uly_emu_nccl_fail(nccl_of(c), "ncclCommSplit", ncclSuccess, "");
    uly_emu_nccl_fail(nccl_of(c), "ncclCommSplit", ncclInternalError, kFaultMsg);
    j->st[c->rank] = uly_nccl_split(nccl_of(c), 2, 0, &sp, &dp);
    j->size[c->rank][0] = sp != NULL, j->size[c->rank][1] = dp != NULL;
    if (sp) ncclCommAbort(sp);
}

TEST(split_that_fails_returns_what_it_made_and_destroys_nothing) {
    split_job j;
    memset(&j, 0, sizeof j);
    const unsigned long long d0 = calls("ncclCommDestroy"), a0 = calls("ncclCommAbort");
    uly_status st = nccl_run(4, split_fail_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 4; r++) {
        check_ecomm(j.st[r], r, "ncclCommSplit (DP)", ncclInternalError, kFaultMsg);
        CHECK(j.size[r][0] && !j.size[r][1], "rank %d: sp %s, dp %s", r,
              j.size[r][0] ? "set" : "NULL", j.size[r][1] ? "set" : "NULL");
    }
    /* only the worlds, destroyed by nccl_run; the SP communicators are the test's aborts */
    CHECK(calls("ncclCommDestroy") - d0 == 4, "%llu ncclCommDestroy calls, want 4",
          calls("ncclCommDestroy") - d0);
    CHECK(calls("ncclCommAbort") - a0 == 4, "%llu ncclCommAbort calls, want 4",
          calls("ncclCommAbort") - a0);
}

/* The double itself, on what uly_nccl_split does not exercise: colors {0, 0, 0, NOCOLOR} and
   keys {1, 0, 1, 9} rank by key, then by old rank: old ranks 1, 0, 2 become 0, 1, 2, and rank
   3 gets no communicator (NCCL's documented rule). */
typedef struct color_job {
    int size[4], rank[4];
    ncclResult_t r[4];
    int null[4];
} color_job;

static void color_main(const uly_comm *c, void *user) {
    color_job *j = (color_job *)user;
    const int r = c->rank, color[4] = {0, 0, 0, NCCL_SPLIT_NOCOLOR}, key[4] = {1, 0, 1, 9};
    ncclComm_t sub = NULL;
    j->r[r] = ncclCommSplit(nccl_of(c), color[r], key[r], &sub, NULL);
    j->null[r] = !sub;
    if (!sub) return;
    ncclCommCount(sub, &j->size[r]);
    ncclCommUserRank(sub, &j->rank[r]);
    ncclCommDestroy(sub);
}

TEST(nccl_double_split_ranks_by_key_then_old_rank) {
    const color_job j = run_job<color_job>(nccl_run, 4, color_main);
    const int want[3] = {1, 0, 2};
    for (int r = 0; r < 3; r++)
        CHECK(j.r[r] == ncclSuccess && !j.null[r] && j.size[r] == 3 && j.rank[r] == want[r],
              "old rank %d: %s, rank %d of %d (want %d of 3)", r, ncclGetErrorString(j.r[r]),
              j.rank[r], j.size[r], want[r]);
    CHECK(j.r[3] == ncclSuccess && j.null[3], "NCCL_SPLIT_NOCOLOR: %s, %s communicator",
          ncclGetErrorString(j.r[3]), j.null[3] ? "no" : "a");
}

/* ---------------------------------------------------------------------------------------------
   The double's point-to-point, group and communicator rules, straight on NCCL's calls (two
   ranks; each rank's peer is the other) */

/* Four ints on the device, all v (a rank's buffers); the first of them read back. */
static int *ints_on_device(int v) {
    int h[4] = {v, v, v, v};
    int *d = NULL;
    cudaMalloc((void **)&d, sizeof h);
    cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
    return d;
}

static int first_int(const int *d) {
    int v = 0;
    cudaMemcpy(&v, d, sizeof v, cudaMemcpyDeviceToHost);
    return v;
}

typedef struct p2p_job {
    ncclResult_t call[2], inner[2], end[2], sub[2], async[2];
    int got[2][2]; /* what each rank's receives got */
    int polls[2];  /* polls of ncclCommGetAsyncError that answered ncclInProgress */
} p2p_job;

/* Two sends to one peer meet that peer's two receives in call order (NCCL: operations between
   a pair of ranks are matched in the order they are issued). */
static void in_order_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank, peer = 1 - r;
    ncclComm_t comm = nccl_of(c);
    int *a = ints_on_device(10 + r), *b = ints_on_device(20 + r);
    int *x = ints_on_device(-1), *y = ints_on_device(-1);
    ncclGroupStart();
    ncclSend(a, 1, ncclInt32, peer, comm, 0);
    ncclSend(b, 1, ncclInt32, peer, comm, 0);
    ncclRecv(x, 1, ncclInt32, peer, comm, 0);
    ncclRecv(y, 1, ncclInt32, peer, comm, 0);
    j->end[r] = ncclGroupEnd();
    j->got[r][0] = first_int(x), j->got[r][1] = first_int(y);
    cudaFree(a), cudaFree(b), cudaFree(x), cudaFree(y);
}

TEST(nccl_double_matches_sends_to_one_peer_in_call_order) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, in_order_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.end[r] == ncclSuccess && j.got[r][0] == 11 - r && j.got[r][1] == 21 - r,
              "rank %d: %s, got %d then %d; want %d then %d", r, ncclGetErrorString(j.end[r]),
              j.got[r][0], j.got[r][1], 11 - r, 21 - r);
}

/* Groups nest, and only the outermost ncclGroupEnd runs what was queued (NCCL, Group Calls):
   the inner one moves nothing. */
static void nested_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank, peer = 1 - r;
    ncclComm_t comm = nccl_of(c);
    int *a = ints_on_device(10 + r), *x = ints_on_device(-1);
    ncclGroupStart();
    ncclGroupStart();
    ncclSend(a, 1, ncclInt32, peer, comm, 0);
    ncclRecv(x, 1, ncclInt32, peer, comm, 0);
    j->inner[r] = ncclGroupEnd();
    j->got[r][0] = first_int(x);
    j->end[r] = ncclGroupEnd();
    j->got[r][1] = first_int(x);
    cudaFree(a), cudaFree(x);
}

TEST(nccl_double_runs_a_nested_group_at_the_outermost_end) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, nested_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.inner[r] == ncclSuccess && j.got[r][0] == -1 && j.end[r] == ncclSuccess &&
                  j.got[r][1] == 11 - r,
              "rank %d: inner end %s with %d received, outer end %s with %d (want -1, then %d)",
              r, ncclGetErrorString(j.inner[r]), j.got[r][0], ncclGetErrorString(j.end[r]),
              j.got[r][1], 11 - r);
}

/* A call that fails inside a group (a peer that is no rank: ncclInvalidArgument) fails the
   group's ncclGroupEnd too, on every rank, instead of running the rest. */
static void failed_call_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank, peer = 1 - r;
    ncclComm_t comm = nccl_of(c);
    int *a = ints_on_device(10 + r), *x = ints_on_device(-1);
    ncclGroupStart();
    ncclSend(a, 1, ncclInt32, peer, comm, 0);
    ncclRecv(x, 1, ncclInt32, peer, comm, 0);
    j->call[r] = ncclSend(a, 1, ncclInt32, c->size, comm, 0);
    j->end[r] = ncclGroupEnd();
    cudaFree(a), cudaFree(x);
}

TEST(nccl_double_a_call_failing_in_a_group_fails_ncclGroupEnd) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, failed_call_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.call[r] == ncclInvalidArgument && j.end[r] != ncclSuccess,
              "rank %d: ncclSend to rank 2 %s, ncclGroupEnd %s", r, ncclGetErrorString(j.call[r]),
              ncclGetErrorString(j.end[r]));
}

/* A receive shorter than its send is an error on both ranks, as a longer one is (NCCL wants
   equal counts; it would hang or truncate). */
static void long_send_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank, peer = 1 - r;
    ncclComm_t comm = nccl_of(c);
    int *a = ints_on_device(10 + r), *x = ints_on_device(-1);
    ncclGroupStart();
    ncclSend(a, 2, ncclInt32, peer, comm, 0);
    ncclRecv(x, 1, ncclInt32, peer, comm, 0);
    j->end[r] = ncclGroupEnd();
    cudaFree(a), cudaFree(x);
}

TEST(nccl_double_a_send_longer_than_its_receive_is_invalid_usage) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, long_send_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.end[r] == ncclInvalidUsage, "rank %d: ncclGroupEnd %s", r,
              ncclGetErrorString(j.end[r]));
}

/* Collectives whose counts differ between ranks are an error on every rank (NCCL would hang or
   corrupt memory). */
static void uneven_allreduce_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    double *d = NULL;
    cudaMalloc((void **)&d, 2 * sizeof(double));
    cudaMemset(d, 0, 2 * sizeof(double));
    j->end[c->rank] = ncclAllReduce(d, d, 1 + c->rank, ncclFloat64, ncclSum, nccl_of(c), 0);
    cudaFree(d);
}

TEST(nccl_double_collectives_of_different_counts_fail_on_every_rank) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, uneven_allreduce_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.end[r] == ncclInvalidUsage, "rank %d: ncclAllReduce %s", r,
              ncclGetErrorString(j.end[r]));
}

/* ncclCommAbort ends the communicator as ncclCommDestroy does, and the double tells them apart
   (tests that a caller aborted, not destroyed, read uly_emu_nccl_aborted). */
static void abort_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank;
    ncclComm_t a = NULL, b = NULL;
    ncclCommSplit(nccl_of(c), 0, r, &a, NULL);
    ncclCommSplit(nccl_of(c), 0, r, &b, NULL);
    ncclCommAbort(a);
    ncclCommDestroy(b);
    j->got[r][0] = uly_emu_nccl_aborted(a), j->got[r][1] = uly_emu_nccl_aborted(b);
}

TEST(nccl_double_knows_an_aborted_communicator_from_a_destroyed_one) {
    const p2p_job j = run_job<p2p_job>(nccl_run, 2, abort_main);
    for (int r = 0; r < 2; r++)
        CHECK(j.got[r][0] == 1 && j.got[r][1] == 0, "rank %d: aborted %d, destroyed %d", r,
              j.got[r][0], j.got[r][1]);
}

/* Polls ncclCommGetAsyncError while it answers ncclInProgress (at most 100 times): how many
   did, and the state it settled on in *async. */
static int settle(ncclComm_t comm, ncclResult_t *async) {
    int polls = 0;
    while (ncclCommGetAsyncError(comm, async) == ncclSuccess && *async == ncclInProgress &&
           polls < 100)
        polls++;
    return polls;
}

/* On a non-blocking communicator the group's ncclGroupEnd answers ncclInProgress and the caller
   polls ncclCommGetAsyncError until it is done (NCCL, Fault Tolerance: non-blocking
   communicators); the double answers ncclInProgress to polls too, so a caller that does not
   poll fails. A split with no config inherits the parent's, so is non-blocking too (NCCL,
   ncclCommSplit). */
static void nonblocking_main(const uly_comm *c, void *user) {
    p2p_job *j = (p2p_job *)user;
    const int r = c->rank, peer = 1 - r;
    ncclComm_t comm = nccl_of(c), sub = NULL;
    ncclResult_t async;
    int *a = ints_on_device(10 + r), *x = ints_on_device(-1);
    ncclGroupStart();
    ncclSend(a, 1, ncclInt32, peer, comm, 0);
    ncclRecv(x, 1, ncclInt32, peer, comm, 0);
    j->end[r] = ncclGroupEnd();
    j->polls[r] = settle(comm, &j->async[r]);
    j->got[r][0] = first_int(x);
    j->call[r] = ncclCommSplit(comm, 0, r, &sub, NULL);
    settle(comm, &async);
    if (sub) {
        settle(sub, &async);
        double *d = NULL;
        cudaMalloc((void **)&d, sizeof(double));
        const double one = 1;
        cudaMemcpy(d, &one, sizeof one, cudaMemcpyHostToDevice);
        j->sub[r] = ncclAllReduce(d, d, 1, ncclFloat64, ncclSum, sub, 0);
        settle(sub, &async);
        double sum = 0;
        cudaMemcpy(&sum, d, sizeof sum, cudaMemcpyDeviceToHost);
        j->got[r][1] = (int)sum;
        cudaFree(d);
        ncclCommDestroy(sub);
    }
    cudaFree(a), cudaFree(x);
}

TEST(nccl_double_nonblocking_groups_and_splits_answer_in_progress) {
    const p2p_job j = run_job<p2p_job>(nccl_run_nonblocking, 2, nonblocking_main);
    for (int r = 0; r < 2; r++) {
        CHECK(j.end[r] == ncclInProgress && j.polls[r] > 0 && j.polls[r] < 100 &&
                  j.async[r] == ncclSuccess && j.got[r][0] == 11 - r,
              "rank %d: ncclGroupEnd %s, %d polls in progress, then %s; got %d", r,
              ncclGetErrorString(j.end[r]), j.polls[r], ncclGetErrorString(j.async[r]),
              j.got[r][0]);
        CHECK(j.call[r] == ncclInProgress && j.sub[r] == ncclInProgress && j.got[r][1] == 2,
              "rank %d: ncclCommSplit %s, ncclAllReduce on the split %s, sum %d", r,
              ncclGetErrorString(j.call[r]), ncclGetErrorString(j.sub[r]), j.got[r][1]);
    }
}

/* ---------------------------------------------------------------------------------------------
   Errors */

TEST(failing_ncclSend_is_ecomm_with_nccls_message) {
    a2a_job j;
    memset(&j, 0, sizeof j);
    j.shape = UNEVEN, j.f.call = "ncclSend", j.f.r = ncclSystemError;
    uly_status st = nccl_run(2, a2a_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++)
        check_ecomm(j.st[r], r, "alltoallv: ncclSend/ncclRecv", ncclSystemError, kFaultMsg);
}

#if ULY_NCCL_ALLTOALL
TEST(failing_ncclAlltoAll_is_ecomm_with_nccls_message) {
    a2a_job j;
    memset(&j, 0, sizeof j);
    j.f.call = "ncclAlltoAll", j.f.r = ncclUnhandledCudaError;
    uly_status st = nccl_run(2, a2a_uniform_main, &j);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++)
        check_ecomm(j.st[r], r, "alltoall: ncclAlltoAll", ncclUnhandledCudaError, kFaultMsg);
}
#endif

/* allreduce_sum directly and through scratch, and barrier (a one-value sum): each names itself. */
TEST(failing_ncclAllReduce_is_ecomm_with_nccls_message) {
    for (int m = 0; m < 3; m++) {
        sum_job j;
        memset(&j, 0, sizeof j);
        j.n = 3, j.on_device = m == 0, j.barrier = m == 2;
        j.f.call = "ncclAllReduce", j.f.r = ncclInternalError;
        uly_status st = nccl_run(2, sum_main, &j);
        CHECK(!st.code, "%s", st.msg);
        for (int r = 0; r < 2; r++)
            check_ecomm(j.st[r], r, m == 2 ? "barrier: ncclAllReduce"
                                           : "allreduce_sum: ncclAllReduce",
                        ncclInternalError, kFaultMsg);
    }
}

/* A peer died: every rank's communicator has the asynchronous error (one rank alone would
   leave the others waiting in the collective, as NCCL would). */
typedef struct async_job {
    int stall; /* the stream stalls, as behind a collective waiting on the dead peer */
    uly_status next[4], wait[4];
    int aborted[4];
} async_job;

static void async_next_main(const uly_comm *c, void *user) {
    async_job *j = (async_job *)user;
    int64_t wrong = 0;
    uly_emu_nccl_async_error(nccl_of(c), ncclRemoteError, kFaultMsg);
    j->next[c->rank] = exchange(c, UNEVEN, 0, &wrong);
}

TEST(an_async_error_fails_the_next_call) {
    const async_job j = run_job<async_job>(nccl_run, 2, async_next_main);
    for (int r = 0; r < 2; r++)
        check_ecomm(j.next[r], r, "alltoallv: ncclSend/ncclRecv", ncclRemoteError, kFaultMsg);
}

static void async_wait_main(const uly_comm *c, void *user) {
    async_job *j = (async_job *)user;
    cudaStream_t s;
    cudaStreamCreate(&s);
    uly_emu_stall_stream(s, j->stall);
    uly_emu_nccl_async_error(nccl_of(c), ncclRemoteError, kFaultMsg);
    j->wait[c->rank] = uly_nccl_wait(nccl_of(c), s, 0);
    j->aborted[c->rank] = uly_emu_nccl_aborted(nccl_of(c));
    uly_emu_stall_stream(s, false);
    cudaStreamDestroy(s);
}

/* Stalled or finished: a finished stream does not mean the peers are well. The communicator
   is the caller's: the library says to abort it and leaves that to its owner. */
TEST(wait_reports_an_async_error_and_leaves_the_abort_to_the_caller) {
    for (int stall = 1; stall >= 0; stall--) {
        async_job j;
        memset(&j, 0, sizeof j);
        j.stall = stall;
        uly_status st = nccl_run(2, async_wait_main, &j);
        CHECK(!st.code, "%s", st.msg);
        for (int r = 0; r < 2; r++) {
            check_ecomm(j.wait[r], r, "uly_nccl_wait", ncclRemoteError, kFaultMsg);
            CHECK(strstr(j.wait[r].msg, "ncclCommAbort it") && !j.aborted[r],
                  "rank %d (%s stream): '%s'%s", r, stall ? "stalled" : "finished",
                  j.wait[r].msg, j.aborted[r] ? ", aborted by the library" : "");
        }
    }
}

typedef struct timeout_job {
    uly_status idle[4], stalled[4];
    double waited[4];
    int aborted_idle[4], aborted[4];
} timeout_job;

static void timeout_main(const uly_comm *c, void *user) {
    timeout_job *j = (timeout_job *)user;
    const int r = c->rank;
    cudaStream_t s;
    cudaStreamCreate(&s);
    j->idle[r] = uly_nccl_wait(nccl_of(c), s, 0.05);
    j->aborted_idle[r] = uly_emu_nccl_aborted(nccl_of(c));
    uly_emu_stall_stream(s, true);
    const double t0 = seconds();
    j->stalled[r] = uly_nccl_wait(nccl_of(c), s, 0.05);
    j->waited[r] = seconds() - t0;
    j->aborted[r] = uly_emu_nccl_aborted(nccl_of(c));
    uly_emu_stall_stream(s, false);
    cudaStreamDestroy(s);
}

TEST(wait_gives_up_on_a_stalled_stream_after_the_timeout) {
    const timeout_job j = run_job<timeout_job>(nccl_run, 2, timeout_main);
    for (int r = 0; r < 2; r++) {
        CHECK(!j.idle[r].code && !j.aborted_idle[r], "rank %d, a finished stream: '%s'%s", r,
              j.idle[r].msg, j.aborted_idle[r] ? ", aborted" : "");
        CHECK(j.stalled[r].code == ULY_ECOMM && strstr(j.stalled[r].msg, "not done after") &&
                  strstr(j.stalled[r].msg, "ncclCommAbort it") && !j.aborted[r] &&
                  j.waited[r] >= 0.05,
              "rank %d: '%s' after %.3f s%s", r, j.stalled[r].msg, j.waited[r],
              j.aborted[r] ? ", aborted by the library" : "");
    }
}

/* The waits inside the communicator: host-memory allreduce_sum and barrier on a stalled stream
   (as behind a collective stuck on a dead peer) return after uly_nccl.timeout_s. */
typedef struct stuck_job {
    uly_status sum[4], barrier[4];
    double sum_s[4], barrier_s[4];
} stuck_job;

static void stuck_main(const uly_comm *c, void *user) {
    stuck_job *j = (stuck_job *)user;
    const int r = c->rank;
    cudaStream_t s;
    cudaStreamCreate(&s);
    double host[2] = {1, 2};
    uly_emu_stall_stream(s, true);
    double t0 = seconds();
    j->sum[r] = c->allreduce_sum(c->ctx, host, 2, s);
    j->sum_s[r] = seconds() - t0;
    uly_emu_stall_stream(s, false);
    const cudaStream_t own = (cudaStream_t)((const uly_nccl *)c->ctx)->stream; /* barrier's */
    uly_emu_stall_stream(own, true);
    t0 = seconds();
    j->barrier[r] = c->barrier(c->ctx);
    j->barrier_s[r] = seconds() - t0;
    uly_emu_stall_stream(own, false);
    cudaStreamDestroy(s);
}

TEST(host_allreduce_and_barrier_give_up_after_the_communicators_timeout) {
    stuck_job j;
    memset(&j, 0, sizeof j);
    uly_status st = nccl_run_timed(2, stuck_main, &j, 0.05);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++) {
        CHECK(j.sum[r].code == ULY_ECOMM &&
                  !strncmp(j.sum[r].msg, "allreduce_sum: the stream is not done after", 43) &&
                  j.sum_s[r] >= 0.05,
              "rank %d allreduce: '%s' after %.3f s", r, j.sum[r].msg, j.sum_s[r]);
        CHECK(j.barrier[r].code == ULY_ECOMM &&
                  !strncmp(j.barrier[r].msg, "barrier: the stream is not done after", 37) &&
                  j.barrier_s[r] >= 0.05,
              "rank %d barrier: '%s' after %.3f s", r, j.barrier[r].msg, j.barrier_s[r]);
    }
}

TEST(null_arguments_are_einval) {
    ncclUniqueId id;
    ncclComm_t world, sp, dp;
    ncclGetUniqueId(&id);
    CHECK(ncclCommInitRank(&world, 1, id, 0) == ncclSuccess, "%s", ncclGetLastError(NULL));
    uly_nccl n = {world, NULL, 0, NULL}, none = {NULL, NULL, 0, NULL};
    uly_comm c;
    const struct {
        uly_status st;
        const char *msg;
    } cases[] = {
        {uly_nccl_comm(NULL, &c), "uly_nccl_comm: n is NULL"},
        {uly_nccl_comm(&n, NULL), "uly_nccl_comm: out is NULL"},
        {uly_nccl_comm(&none, &c), "uly_nccl_comm: n->comm is NULL"},
        {uly_nccl_split(NULL, 1, 0, &sp, &dp), "uly_nccl_split: world is NULL"},
        {uly_nccl_split(world, 1, 0, NULL, &dp), "uly_nccl_split: sp is NULL"},
        {uly_nccl_split(world, 1, 0, &sp, NULL), "uly_nccl_split: dp is NULL"},
    };
    for (const auto &k : cases)
        CHECK(k.st.code == ULY_EINVAL && !strcmp(k.st.msg, k.msg), "'%s', want ULY_EINVAL '%s'",
              k.st.msg, k.msg);
    const uly_status st = uly_nccl_comm(&n, &c);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "uly_nccl_comm: n->stream is NULL"),
          "stream NULL: '%s'", st.msg);
    ncclCommDestroy(world);
}

int main(void) { return uly_run_tests(); }

/* ---------------------------------------------------------------------------------------------
   Non-blocking communicators: every call waits until NCCL has queued its work (the double
   answers ncclInProgress, then aborts on any call but ncclCommGetAsyncError until that says
   so), and calls given no stream take uly_nccl.stream (the double refuses cudaStreamPerThread
   there, NCCL's own thread's stream). */

TEST(nonblocking_layer_matches_unsharded) {
    const int cases[] = {0, 2, 6}; /* one rank; ncclAlltoAll; ncclSend/ncclRecv */
    for (int i : cases) check_layer(&layer_cases[i], ULY_F32, nccl_run_nonblocking);
}

TEST(nonblocking_split_allreduce_and_barrier) {
    check_split(nccl_run_nonblocking);
    check_no_stream(nccl_run_nonblocking);
    barrier_job j;
    memset(&j, 0, sizeof j);
    uly_status st = nccl_run_nonblocking(4, barrier_main, &j);
    for (int r = 0; r < 4; r++)
        CHECK(!st.code && !j.st[r].code && !j.early[r], "rank %d: '%s' '%s', left while %d ranks "
              "had not arrived", r, st.msg, j.st[r].msg, j.early[r]);
}

/* A peer that never arrives: rank 0's allreduce stays in progress, and its uly_nccl.timeout_s
   ends the wait with ULY_ECOMM (on a blocking communicator NCCL could hold the thread). */
typedef struct stall_job {
    uly_status st[2];
    double waited[2];
    cudaError_t last[2]; /* the last error after the call */
} stall_job;

static void stall_main(const uly_comm *c, void *user) {
    stall_job *j = (stall_job *)user;
    double *dev = NULL;
    cudaMalloc((void **)&dev, sizeof(double));
    cudaMemset(dev, 0, sizeof(double));
    if (c->rank == 0) uly_emu_nccl_stall(nccl_of(c));
    const double t0 = seconds();
    j->st[c->rank] = c->allreduce_sum(c->ctx, dev, 1, NULL);
    j->waited[c->rank] = seconds() - t0;
    cudaFree(dev);
}

TEST(nonblocking_call_that_never_completes_is_ecomm_after_the_timeout) {
    stall_job j;
    memset(&j, 0, sizeof j);
    uly_status st = nccl_run_as(2, stall_main, &j, 0.05, 1);
    CHECK(!st.code, "%s", st.msg);
    CHECK(j.st[0].code == ULY_ECOMM && strstr(j.st[0].msg, "still in progress after") &&
              strstr(j.st[0].msg, "ncclCommAbort it on every rank") && j.waited[0] >= 0.05,
          "rank 0: '%s' after %.3f s", j.st[0].msg, j.waited[0]);
    CHECK(!j.st[1].code, "rank 1: '%s'", j.st[1].msg);
}

/* A collective whose peer comes late keeps its stream busy after the call has returned (on a
   GPU its kernel waits; for a peer that is gone, for ever). allreduce_sum of host memory then
   copies the sum back to pageable memory, a copy that waits for the stream with no time limit,
   so it waits for the stream first, under uly_nccl.timeout_s: on rank 0, whose collective keeps
   the stream busy for 1 s, a blocking communicator with a 0.05 s timeout gives ULY_ECOMM. */
typedef struct late_job {
    uly_status st[2];
    double waited[2];
} late_job;

static void late_main(const uly_comm *c, void *user) {
    late_job *j = (late_job *)user;
    double x = 1;
    if (c->rank == 0) uly_emu_nccl_late(nccl_of(c), 1000);
    const double t0 = seconds();
    j->st[c->rank] = c->allreduce_sum(c->ctx, &x, 1, NULL);
    j->waited[c->rank] = seconds() - t0;
}

TEST(host_memory_sum_behind_a_late_collective_is_ecomm_after_the_timeout) {
    late_job j;
    memset(&j, 0, sizeof j);
    const uly_status st = nccl_run_timed(2, late_main, &j, 0.05);
    CHECK(!st.code, "%s", st.msg);
    CHECK(j.st[0].code == ULY_ECOMM && strstr(j.st[0].msg, "the stream is not done after") &&
              j.waited[0] < 0.8,
          "rank 0: '%s' after %.3f s", j.st[0].msg, j.waited[0]);
    CHECK(!j.st[1].code, "rank 1: '%s'", j.st[1].msg);
}

/* The caller's own call on a non-blocking communicator answers ncclInProgress until NCCL's
   thread has queued its work, so an idle stream is not yet done: uly_nccl_wait returns once
   NCCL answers success. When the call never completes on rank 0 (stall: a peer that never
   arrives), its wait gives up after the timeout, though its stream is idle. */
typedef struct own_call_job {
    int stall;
    ncclResult_t answer[2], after[2];
    uly_status st[2];
} own_call_job;

static void own_call_main(const uly_comm *c, void *user) {
    own_call_job *j = (own_call_job *)user;
    const int r = c->rank;
    double *dev;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc((void **)&dev, sizeof(double));
    cudaMemset(dev, 0, sizeof(double));
    if (j->stall && r == 0) uly_emu_nccl_stall(nccl_of(c));
    j->answer[r] = ncclAllReduce(dev, dev, 1, ncclFloat64, ncclSum, nccl_of(c), s);
    j->st[r] = uly_nccl_wait(nccl_of(c), s, j->stall ? 0.05 : 0);
    j->after[r] = ncclInProgress;
    ncclCommGetAsyncError(nccl_of(c), &j->after[r]);
    cudaFree(dev);
    cudaStreamDestroy(s);
}

static own_call_job run_own_call(int stall) {
    own_call_job j;
    memset(&j, 0, sizeof j);
    j.stall = stall;
    const uly_status st = nccl_run_nonblocking(2, own_call_main, &j);
    CHECK(!st.code, "%s", st.msg);
    return j;
}

TEST(wait_on_a_nonblocking_call_returns_once_nccl_has_queued_its_work) {
    const own_call_job j = run_own_call(0);
    for (int r = 0; r < 2; r++)
        CHECK(j.answer[r] == ncclInProgress && !j.st[r].code && j.after[r] == ncclSuccess,
              "rank %d: ncclAllReduce answered %d, uly_nccl_wait '%s', then NCCL says '%s'", r,
              (int)j.answer[r], j.st[r].msg, ncclGetErrorString(j.after[r]));
}

TEST(wait_on_a_nonblocking_call_that_never_completes_gives_up_after_the_timeout) {
    const own_call_job j = run_own_call(1);
    CHECK(j.st[0].code == ULY_ECOMM &&
              !strncmp(j.st[0].msg, "uly_nccl_wait: NCCL's call still in progress after", 50) &&
              strstr(j.st[0].msg, "ncclCommAbort it"),
          "rank 0: '%s'", j.st[0].msg);
    CHECK(!j.st[1].code, "rank 1: '%s'", j.st[1].msg);
}

/* A timeout of 0 is no limit: uly_nccl_wait on a stream busy for 50 ms waits for it, and
   leaves no "not ready" of its queries as the last error, where the next launch's check would
   read it. */
static void busy_main(const uly_comm *c, void *user) {
    stall_job *j = (stall_job *)user;
    const int r = c->rank;
    cudaStream_t s;
    cudaStreamCreate(&s);
    sleep_on_stream(s, 50);
    const double t0 = seconds();
    j->st[r] = uly_nccl_wait(nccl_of(c), s, 0);
    j->waited[r] = seconds() - t0;
    j->last[r] = cudaGetLastError();
    cudaStreamDestroy(s);
}

TEST(wait_without_a_timeout_waits_for_a_busy_stream) {
    const stall_job j = run_job<stall_job>(nccl_run, 2, busy_main);
    for (int r = 0; r < 2; r++)
        CHECK(!j.st[r].code && j.waited[r] >= 0.04 && j.last[r] == cudaSuccess,
              "rank %d: '%s' after %.3f s, last error '%s'; want success once the stream is "
              "done, and no error left", r, j.st[r].msg, j.waited[r],
              cudaGetErrorName(j.last[r]));
}

#if ULY_NCCL_ALLTOALL
/* alltoall's own arguments: a negative size, a NULL buffer with bytes to move, or send and
   recv overlapping (NCCL's ncclAlltoAll does not run in place) is EINVAL on the rank that
   passed it, before any collective (each rank here calls it alone); buffers that only touch
   are apart, and alltoallv refuses in place too. */
enum { A2A_ARGS = 6 };
typedef struct a2a_args_job {
    uly_status st[2][A2A_ARGS];
    int none; /* an NCCL without ncclAlltoAll at run time: nothing to check */
} a2a_args_job;

static void a2a_args_main(const uly_comm *c, void *user) {
    a2a_args_job *j = (a2a_args_job *)user;
    const int r = c->rank;
    char *buf;
    if (!c->alltoall) {
        j->none = 1;
        return;
    }
    cudaMalloc((void **)&buf, 64);
    const int64_t cnt[2] = {8, 8}, off[2] = {0, 8};
    j->st[r][0] = c->alltoall(c->ctx, buf, buf + 32, -2, NULL);
    j->st[r][1] = c->alltoall(c->ctx, NULL, buf, 8, NULL);
    j->st[r][2] = c->alltoall(c->ctx, buf, NULL, 8, NULL);
    j->st[r][3] = c->alltoall(c->ctx, buf, buf + 15, 8, NULL); /* one byte in common */
    j->st[r][4] = c->alltoallv(c->ctx, buf + 15, cnt, off, buf, cnt, off, NULL);
    j->st[r][5] = c->alltoall(c->ctx, buf, buf + 16, 8, NULL); /* both ranks: a collective */
    cudaStreamSynchronize(NULL);
    cudaFree(buf);
}

TEST(alltoall_rejects_a_negative_size_null_buffers_and_running_in_place) {
    static const char *const says[A2A_ARGS] = {"alltoall: bytes", "alltoall: bytes",
                                                "alltoall: bytes", "overlap", "overlap", ""};
    const a2a_args_job j = run_job<a2a_args_job>(nccl_run, 2, a2a_args_main);
    for (int r = 0; r < 2 && !j.none; r++)
        for (int k = 0; k < A2A_ARGS; k++)
            CHECK(j.st[r][k].code == (says[k][0] ? ULY_EINVAL : ULY_OK) &&
                      strstr(j.st[r][k].msg, says[k]),
                  "rank %d, case %d: code %d '%s', want '%s'", r, k, (int)j.st[r][k].code,
                  j.st[r][k].msg, says[k]);
}
#endif

/* A host-memory allreduce_sum behind work stuck on its stream (queued, never run: a collective
   waiting on a dead peer) gives up after the timeout; it must not start the copy of pageable
   memory, which would wait for the stream with no timeout (the emulator aborts there). */
typedef struct queued_job {
    uly_status st[2];
} queued_job;

static void queued_main(const uly_comm *c, void *user) {
    queued_job *j = (queued_job *)user;
    const int r = c->rank;
    cudaStream_t s;
    double host[2] = {1, 2}, *dev;
    cudaMalloc((void **)&dev, sizeof(double));
    cudaStreamCreate(&s);
    uly_emu_stall_stream(s, true);
    cudaMemsetAsync(dev, 0, sizeof(double), s); /* stuck behind the stall */
    j->st[r] = c->allreduce_sum(c->ctx, host, 2, s);
    uly_emu_stall_stream(s, false);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    cudaFree(dev);
}

TEST(host_allreduce_behind_stuck_work_gives_up_before_copying) {
    queued_job j;
    memset(&j, 0, sizeof j);
    uly_status st = nccl_run_timed(2, queued_main, &j, 0.05);
    CHECK(!st.code, "%s", st.msg);
    for (int r = 0; r < 2; r++)
        CHECK(j.st[r].code == ULY_ECOMM && strstr(j.st[r].msg, "not done after"),
              "rank %d: '%s'", r, j.st[r].msg);
}

/* sp_size must be positive: 0 and -2 (which "divides" 4) are EINVAL, before any split. */
typedef struct badsp_job {
    uly_status st[4][2];
} badsp_job;

static void badsp_main(const uly_comm *c, void *user) {
    badsp_job *j = (badsp_job *)user;
    const int bad[2] = {0, -2};
    for (int k = 0; k < 2; k++) {
        ncclComm_t sp = NULL, dp = NULL;
        j->st[c->rank][k] = uly_nccl_split(nccl_of(c), bad[k], 0, &sp, &dp);
        if (sp) ncclCommDestroy(sp);
        if (dp) ncclCommDestroy(dp);
    }
}

TEST(split_rejects_an_sp_size_below_one) {
    const badsp_job j = run_job<badsp_job>(nccl_run, 4, badsp_main);
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < 2; k++)
            CHECK(j.st[r][k].code == ULY_EINVAL && strstr(j.st[r][k].msg, "sp_size"),
                  "rank %d, sp_size %d: '%s'", r, k ? -2 : 0, j.st[r][k].msg);
}
