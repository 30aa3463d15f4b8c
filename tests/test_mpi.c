/* test_mpi.c - the SP layer, uly_layer_agree and the loss over the MPI communicator, run as 4
   processes (make test runs `mpirun -np 4 build/test_mpi`).

   Every process makes the same full tensors from a seed and computes the unsharded references
   itself (uly_cpu_attention and the fp64 attention of ref64.h), runs the layer over
   uly_mpi_comm and checks its own shard. Checks are collective: a check passes when it holds
   on every rank (a failing rank prints its details on stderr), so every rank agrees on the
   result and only rank 0 prints the report and its "N passed, M failed" line. The chunked path
   (uly_mpi.chunk_bytes = 1000) must move per-peer counts far above the chunk exactly. */
#include <mpi.h>
#define ULYSSES_MPI
#define ULYSSES_IMPLEMENTATION
#include "../ulysses.h"
#include "check.h"
#include "ref64.h"
#include "sp_case.h"

static int world_rank, world_size;

/* ---------------------------------------------------------------------------------------------
   The MPI profiling interface: these wrap the library's point-to-point and all-to-all calls
   (which then go on to PMPI_*), so a test can see the size of every message the communicator
   hands to MPI: with chunk_bytes = 1000 none may be larger. */

static int64_t msg_max;   /* largest single message, bytes */
static int64_t msg_bytes; /* bytes sent, over every message */

static void msg_reset(void) { msg_max = 0, msg_bytes = 0; }
static void msg_seen(int count, int sent) {
    if (count > msg_max) msg_max = count;
    if (sent) msg_bytes += count;
}

int MPI_Isend(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm,
              MPI_Request *req) {
    msg_seen(count, 1);
    return PMPI_Isend(buf, count, type, dest, tag, comm, req);
}
int MPI_Irecv(void *buf, int count, MPI_Datatype type, int src, int tag, MPI_Comm comm,
              MPI_Request *req) {
    msg_seen(count, 0);
    return PMPI_Irecv(buf, count, type, src, tag, comm, req);
}
int MPI_Send(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
    msg_seen(count, 1);
    return PMPI_Send(buf, count, type, dest, tag, comm);
}
int MPI_Recv(void *buf, int count, MPI_Datatype type, int src, int tag, MPI_Comm comm,
             MPI_Status *status) {
    msg_seen(count, 0);
    return PMPI_Recv(buf, count, type, src, tag, comm, status);
}
/* While fail_waitall is set, MPI_Waitall completes its requests and then reports the first as
   truncated, as MPI reports a failed request among several. */
static int fail_waitall;
int MPI_Waitall(int n, MPI_Request *req, MPI_Status *status) {
    const int rc = PMPI_Waitall(n, req, status);
    if (rc != MPI_SUCCESS || !fail_waitall || n < 1 || status == MPI_STATUSES_IGNORE) return rc;
    status[0].MPI_ERROR = MPI_ERR_TRUNCATE;
    for (int i = 1; i < n; i++) status[i].MPI_ERROR = MPI_SUCCESS;
    return MPI_ERR_IN_STATUS;
}
/* Alltoallw's blocks are counts of per-peer types: their sizes in bytes are what MPI moves. */
int MPI_Alltoallw(const void *sbuf, const int *sc, const int *sd, const MPI_Datatype *st,
                  void *rbuf, const int *rc, const int *rd, const MPI_Datatype *rt, MPI_Comm comm) {
    int P, ss, rs;
    PMPI_Comm_size(comm, &P);
    for (int j = 0; j < P; j++) {
        PMPI_Type_size(st[j], &ss), PMPI_Type_size(rt[j], &rs);
        msg_seen(sc[j] * ss, 1), msg_seen(rc[j] * rs, 0);
    }
    return PMPI_Alltoallw(sbuf, sc, sd, st, rbuf, rc, rd, rt, comm);
}

/* How many ranks report !ok; every rank gets the same answer. */
static int ranks_failing(int ok) {
    int bad = !ok;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    return bad;
}

/* A check that holds on every rank; the ranks where it fails say why on stderr. */
#define ALL_CHECK(ok, ...)                                                                     \
    do {                                                                                       \
        int ok_ = (ok);                                                                        \
        if (!ok_) {                                                                            \
            fprintf(stderr, "     rank %d: ", world_rank);                                     \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fprintf(stderr, "\n");                                                             \
        }                                                                                      \
        int n_ = ranks_failing(ok_);                                                           \
        CHECK(n_ == 0, "on %d rank(s): %s", n_, #ok);                                          \
    } while (0)

static uly_comm mpi_comm(uly_mpi *m, MPI_Comm c, int64_t chunk) {
    uly_comm comm;
    memset(&comm, 0, sizeof comm);
    m->comm = c;
    m->chunk_bytes = chunk;
    uly_status st = uly_mpi_comm(m, &comm);
    ALL_CHECK(st.code == ULY_OK, "uly_mpi_comm: %s", st.msg);
    return comm;
}

/* ---------------------------------------------------------------------------------------------
   Comparing this rank's shard: its tokens of out, dq, dk, dv and its heads of lse */

typedef struct shard {
    int64_t s0, Sr, h0, Hr;
} shard;

static shard my_shard(const sp_case *c, int sp_rank) {
    shard s;
    s.Sr = c->S / c->P + (sp_rank < c->S % c->P);
    s.s0 = sp_rank * (c->S / c->P) + (sp_rank < c->S % c->P ? sp_rank : c->S % c->P);
    s.Hr = c->H / c->P + (sp_rank < c->H % c->P);
    s.h0 = sp_rank * (c->H / c->P) + (sp_rank < c->H % c->P ? sp_rank : c->H % c->P);
    return s;
}

/* Rows [s0, s0 + Sr) of [B, S, X, D] arrays, or (lse) heads [h0, h0 + Hr) of [B, H, S]. */
static double rows_diff_ff(const float *a, const float *b, int64_t B, int64_t S, int64_t row,
                           int64_t s0, int64_t n, int bits) {
    double m = 0;
    for (int64_t bi = 0; bi < B; bi++) {
        int64_t off = (bi * S + s0) * row;
        double e = bits ? (double)ref_bitdiff(a + off, b + off, n * row)
                        : ref_maxdiff_ff(a + off, b + off, n * row);
        if (!(e <= m)) m = e;
    }
    return m;
}
static double rows_diff_fd(const float *a, const double *b, int64_t B, int64_t S, int64_t row,
                           int64_t s0, int64_t n) {
    double m = 0;
    for (int64_t bi = 0; bi < B; bi++) {
        int64_t off = (bi * S + s0) * row;
        double e = ref_maxdiff_fd(a + off, b + off, n * row);
        if (!(e <= m)) m = e;
    }
    return m;
}

/* Runs case c on this rank over comm (an SP group; this process is `world_rank` of the world)
   and checks the shard against uly_cpu_attention (bits / 1e-6) and fp64 (1e-5). */
static void check_layer(const uly_comm *comm, const sp_case *c, uint64_t seed, const char *what) {
    sp_full f = sp_alloc(c, seed), cpu = sp_alloc(c, seed);
    uly_status st = sp_run_rank(comm, world_size, world_rank, c, &f, 0);
    ALL_CHECK(st.code == ULY_OK, "%s: %s", what, st.msg);
    st = sp_cpu_reference(c, &cpu);
    ALL_CHECK(st.code == ULY_OK, "%s: cpu reference: %s", what, st.msg);
    ref_shape rs = {c->B, c->S, c->S, c->H, c->Hkv, c->D, c->causal, c->scale};
    double *o = ref_alloc_d(sp_nq(c)), *lse = ref_alloc_d(sp_nlse(c)), *dq = ref_alloc_d(sp_nq(c));
    double *dk = ref_alloc_d(sp_nkv(c)), *dv = ref_alloc_d(sp_nkv(c));
    ref64_forward(&rs, f.q, f.k, f.v, o, lse);
    ref64_backward(&rs, f.q, f.k, f.v, f.dout, dq, dk, dv);

    shard s = my_shard(c, comm->rank);
    int64_t qrow = c->H * c->D, kvrow = c->Hkv * c->D, H = c->H;
    double out_bits = rows_diff_ff(f.out, cpu.out, c->B, c->S, qrow, s.s0, s.Sr, 1);
    double lse_bits = rows_diff_ff(f.lse, cpu.lse, c->B, H, c->S, s.h0, s.Hr, 1);
    double dq_bits = rows_diff_ff(f.dq, cpu.dq, c->B, c->S, qrow, s.s0, s.Sr, 1);
    ALL_CHECK(out_bits == 0 && lse_bits == 0 && dq_bits == 0,
              "%s " SP_CASE_FMT ": %g out, %g lse, %g dq values differ from uly_cpu_attention",
              what, SP_CASE_ARGS(c), out_bits, lse_bits, dq_bits);
    double ek = rows_diff_ff(f.dk, cpu.dk, c->B, c->S, kvrow, s.s0, s.Sr, 0);
    double ev = rows_diff_ff(f.dv, cpu.dv, c->B, c->S, kvrow, s.s0, s.Sr, 0);
    ALL_CHECK(ek <= 1e-6 && ev <= 1e-6, "%s " SP_CASE_FMT ": dk %g dv %g from uly_cpu_attention",
              what, SP_CASE_ARGS(c), ek, ev);
    double e[5] = {rows_diff_fd(f.out, o, c->B, c->S, qrow, s.s0, s.Sr),
                   rows_diff_fd(f.lse, lse, c->B, H, c->S, s.h0, s.Hr),
                   rows_diff_fd(f.dq, dq, c->B, c->S, qrow, s.s0, s.Sr),
                   rows_diff_fd(f.dk, dk, c->B, c->S, kvrow, s.s0, s.Sr),
                   rows_diff_fd(f.dv, dv, c->B, c->S, kvrow, s.s0, s.Sr)};
    ALL_CHECK(e[0] <= 1e-5 && e[1] <= 1e-5 && e[2] <= 1e-5 && e[3] <= 1e-5 && e[4] <= 1e-5,
              "%s " SP_CASE_FMT ": fp64 errors out %g lse %g dq %g dk %g dv %g", what,
              SP_CASE_ARGS(c), e[0], e[1], e[2], e[3], e[4]);
    free(o), free(lse), free(dq), free(dk), free(dv);
    sp_free(&f);
    sp_free(&cpu);
}

/* P = 4 cases, one per world of 4 processes. */
static const sp_case mpi_cases[] = {
    {4, 2, 67, 8, 8, 16, 1, 0, 0},  /* MHA, uneven S, B > 1 */
    {4, 2, 67, 8, 2, 16, 1, 1, 0},  /* GQA, Hkv < P, fused views */
    {4, 1, 31, 6, 1, 8, 0, 0, 0},   /* MQA, uneven H, not causal */
    {4, 3, 13, 5, 5, 8, 1, 1, 0},   /* uneven everything */
    {4, 2, 19, 6, 2, 8, 1, 0, 0},   /* g = 3: rank 1's heads 2, 3 span kv heads 0 and 1 */
};
enum { NMPI = sizeof mpi_cases / sizeof *mpi_cases };

/* ---------------------------------------------------------------------------------------------
   Tests */

TEST(mpi_comm_reports_size_and_rank_of_its_communicator) {
    uly_mpi m;
    uly_comm c = mpi_comm(&m, MPI_COMM_WORLD, 0);
    ALL_CHECK(c.size == world_size && c.rank == world_rank && c.device == 0,
              "size %d rank %d device %d", c.size, c.rank, c.device);
    ALL_CHECK(c.barrier(c.ctx).code == ULY_OK, "barrier failed");
}

TEST(layer_over_mpi_matches_the_unsharded_references_on_every_shard) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    for (int i = 0; i < NMPI; i++)
        check_layer(&comm, &mpi_cases[i], 2000 + (uint64_t)i, "unchunked");
}

TEST(layer_over_mpi_with_1000_byte_chunks_matches_the_unsharded_references) {
    /* Per-peer counts of the first case: Q 2*17*2*16*4 = 4352 bytes, KV 2*17*2*16*4, all far
       above the 1000-byte chunk and not multiples of it. */
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 1000);
    msg_reset();
    for (int i = 0; i < NMPI; i++) check_layer(&comm, &mpi_cases[i], 2000 + (uint64_t)i, "chunked");
    ALL_CHECK(msg_max <= 1000 && msg_bytes > 4 * 4352, "largest MPI message %lld bytes, %lld sent",
              (long long)msg_max, (long long)msg_bytes);
}

/* Bytes rank i sends to rank j in the alltoallv tests: 0, below, at and above the chunk. */
static int64_t a2a_count(int i, int j) {
    static const int64_t c[16] = {0, 1, 999, 1000, 1001, 2000, 2999, 4321,
                                  7, 12345, 1999, 0, 3001, 5000, 998, 2048};
    return c[(i * 4 + j) % 16];
}
static unsigned char a2a_byte(int i, int j, int64_t k) {
    return (unsigned char)(i * 31 + j * 17 + k * 7 + k / 251);
}

static void check_alltoallv(int64_t chunk) {
    int P = world_size, me = world_rank;
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
    int64_t st = 0, rt = 0;
    for (int j = 0; j < P; j++) {
        /* blocks in reverse peer order with 3-byte gaps: offsets, not positions, place them */
        sc[j] = a2a_count(me, j);
        rc[j] = a2a_count(j, me);
    }
    for (int j = P - 1; j >= 0; j--) {
        so[j] = st, st += sc[j] + 3;
        ro[j] = rt, rt += rc[j] + 3;
    }
    unsigned char *send = (unsigned char *)malloc((size_t)st);
    unsigned char *recv = (unsigned char *)malloc((size_t)rt);
    memset(send, 0xEE, (size_t)st);
    memset(recv, 0xAB, (size_t)rt);
    for (int j = 0; j < P; j++)
        for (int64_t k = 0; k < sc[j]; k++) send[so[j] + k] = a2a_byte(me, j, k);
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, chunk);
    msg_reset();
    uly_status s = comm.alltoallv(comm.ctx, send, sc, so, recv, rc, ro, NULL);
    ALL_CHECK(s.code == ULY_OK, "alltoallv (chunk %lld): %s", (long long)chunk, s.msg);
    int64_t sent = 0, largest = 0;
    for (int j = 0; j < P; j++) sent += sc[j], largest = sc[j] > largest ? sc[j] : largest;
    for (int j = 0; j < P; j++) largest = rc[j] > largest ? rc[j] : largest;
    ALL_CHECK(msg_bytes == sent, "chunk %lld: MPI was handed %lld bytes to send, want %lld",
              (long long)chunk, (long long)msg_bytes, (long long)sent);
    ALL_CHECK(chunk ? msg_max <= chunk : msg_max == largest,
              "chunk %lld: the largest MPI message has %lld bytes (largest count %lld)",
              (long long)chunk, (long long)msg_max, (long long)largest);
    int64_t wrong = 0, gap = 0;
    for (int i = 0; i < P; i++) {
        for (int64_t k = 0; k < rc[i]; k++) wrong += recv[ro[i] + k] != a2a_byte(i, me, k);
        for (int64_t k = 0; k < 3; k++) gap += recv[ro[i] + rc[i] + k] != 0xAB;
    }
    ALL_CHECK(wrong == 0 && gap == 0, "chunk %lld: %lld wrong bytes, %lld gap bytes written",
              (long long)chunk, (long long)wrong, (long long)gap);
    free(send);
    free(recv);
}

TEST(alltoallv_moves_counts_above_the_chunk_limit_exactly) { check_alltoallv(1000); }

TEST(alltoallv_with_tiny_7_byte_chunks_moves_every_byte) { check_alltoallv(7); }

/* Odd 1-byte blocks 2^33 bytes into their buffers: offsets that no int displacement reaches,
   in any unit that divides them. The buffer pointers are placed 2^33 bytes before small
   arrays (an address computed as an integer, which MPI adds the offsets back to). */
TEST(alltoallv_places_blocks_at_offsets_beyond_INT_MAX_bytes) {
    const int64_t far = (int64_t)1 << 33;
    int P = world_size, me = world_rank;
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
    unsigned char send[3 * ULY_MAX_SP], recv[3 * ULY_MAX_SP];
    memset(recv, 0xAB, sizeof recv);
    for (int j = 0; j < P; j++) {
        sc[j] = rc[j] = 1;
        so[j] = ro[j] = far + 3 * j;
        send[3 * j] = (unsigned char)(16 * me + j);
    }
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    uly_status s = comm.alltoallv(comm.ctx, (void *)((uintptr_t)send - (uintptr_t)far), sc, so,
                                  (void *)((uintptr_t)recv - (uintptr_t)far), rc, ro, NULL);
    ALL_CHECK(s.code == ULY_OK, "alltoallv at offset 2^33: %s", s.msg);
    int wrong = 0;
    for (int i = 0; i < P; i++) wrong += recv[3 * i] != (unsigned char)(16 * i + me);
    ALL_CHECK(wrong == 0, "%d of %d blocks wrong", wrong, P);
}

TEST(alltoallv_without_chunk_limit_honours_counts_and_offsets) { check_alltoallv(0); }

/* 3000 bytes from every rank to every other, in 1000-byte chunks: `bad` breaks one call on rank
   1 (1: expects 2000 from rank 0, 2: passes send NULL, 3: moves 2000-byte chunks). Every rank
   fails that call, before any byte moves (a chunk left behind would be taken by the next call's
   receive), and the next call, with the same buffers, moves every byte. st: this rank's status
   of the broken call; wrong: bytes the next call got wrong. */
static void broken_then_whole(int bad, uly_status *st, int64_t *wrong) {
    enum { N = 3000 };
    const int P = world_size, me = world_rank;
    int64_t sc[ULY_MAX_SP], so[ULY_MAX_SP], rc[ULY_MAX_SP], ro[ULY_MAX_SP];
    unsigned char *send = (unsigned char *)malloc((size_t)P * N);
    unsigned char *recv = (unsigned char *)malloc((size_t)P * N);
    for (int j = 0; j < P; j++) {
        sc[j] = rc[j] = N, so[j] = ro[j] = (int64_t)j * N;
        for (int64_t k = 0; k < N; k++) send[j * N + k] = a2a_byte(me, j, k);
    }
    uly_mpi m, m_bad;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 1000);
    uly_comm broken = mpi_comm(&m_bad, MPI_COMM_WORLD, me == 1 && bad == 3 ? 2000 : 1000);
    if (me == 1 && bad == 1) rc[0] = 2000;
    *st = broken.alltoallv(broken.ctx, me == 1 && bad == 2 ? NULL : send, sc, so, recv, rc, ro,
                           NULL);
    rc[0] = N;
    memset(recv, 0xAB, (size_t)P * N);
    uly_status next = comm.alltoallv(comm.ctx, send, sc, so, recv, rc, ro, NULL);
    ALL_CHECK(!next.code, "the next call: %s", next.msg);
    *wrong = 0;
    for (int i = 0; i < P; i++)
        for (int64_t k = 0; k < N; k++) *wrong += recv[i * N + k] != a2a_byte(i, me, k);
    free(send), free(recv);
}

TEST(alltoallv_counts_that_do_not_match_fail_every_rank_and_leave_nothing_behind) {
    uly_status st;
    int64_t wrong;
    broken_then_whole(1, &st, &wrong);
    const char *want = world_rank == 1 ? "rank 0 sends 3000 bytes to this rank, which expects 2000"
                                       : "1 rank(s) failed";
    ALL_CHECK(st.code == ULY_ECOMM && strstr(st.msg, want), "'%s', want '%s'", st.msg, want);
    ALL_CHECK(wrong == 0, "the next call got %lld bytes wrong", (long long)wrong);
}

TEST(alltoallv_bad_arguments_on_one_rank_fail_every_rank) {
    uly_status st;
    int64_t wrong;
    broken_then_whole(2, &st, &wrong);
    const char *want = world_rank == 1 ? "send is NULL" : "rank 1 failed (bad arguments)";
    ALL_CHECK(st.code == (world_rank == 1 ? ULY_EINVAL : ULY_ECOMM) && strstr(st.msg, want),
              "'%s', want '%s'", st.msg, want);
    ALL_CHECK(wrong == 0, "the next call got %lld bytes wrong", (long long)wrong);
}

TEST(alltoallv_chunk_bytes_that_differ_fail_every_rank) {
    uly_status st;
    int64_t wrong;
    broken_then_whole(3, &st, &wrong);
    const char *want = world_rank == 1 ? "rank 0 sends messages of up to 1000 bytes, this rank of "
                                         "up to 2000"
                                       : "rank 1 sends messages of up to 2000 bytes, this rank of "
                                         "up to 1000";
    ALL_CHECK(st.code == ULY_ECOMM && strstr(st.msg, want), "'%s', want '%s'", st.msg, want);
    ALL_CHECK(wrong == 0, "the next call got %lld bytes wrong", (long long)wrong);
}

/* A failed request among those a chunked round waits for is reported by its own error, not as
   MPI_ERR_IN_STATUS ("see the statuses"). */
TEST(alltoallv_reports_a_failed_request_by_its_own_error) {
    char truncated[MPI_MAX_ERROR_STRING];
    int n;
    MPI_Error_string(MPI_ERR_TRUNCATE, truncated, &n);
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 1000);
    const int P = world_size;
    int64_t c[ULY_MAX_SP], o[ULY_MAX_SP];
    char *send = (char *)calloc((size_t)P, 2000), *recv = (char *)malloc((size_t)P * 2000);
    for (int j = 0; j < P; j++) c[j] = 2000, o[j] = 2000 * (int64_t)j;
    fail_waitall = 1;
    uly_status st = comm.alltoallv(comm.ctx, send, c, o, recv, c, o, NULL);
    fail_waitall = 0;
    ALL_CHECK(st.code == ULY_ECOMM && strstr(st.msg, "MPI_Waitall: ") && strstr(st.msg, truncated),
              "'%s', want MPI_Waitall: %s", st.msg, truncated);
    free(send), free(recv);
}

/* chunk_bytes is at most INT_MAX: MPI's counts are ints, and a larger chunk would let a block
   of more than INT_MAX bytes reach MPI as a truncated int count. */
TEST(mpi_comm_refuses_chunk_bytes_beyond_INT_MAX_or_negative) {
    static const int64_t bad[2] = {(int64_t)INT_MAX + 1, -1};
    for (int i = 0; i < 2; i++) {
        uly_mpi m = {MPI_COMM_WORLD, bad[i]};
        uly_comm c;
        uly_status st = uly_mpi_comm(&m, &c);
        ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, "chunk_bytes"), "chunk_bytes %lld: %s",
                  (long long)bad[i], st.code ? st.msg : "accepted");
    }
    uly_mpi m = {MPI_COMM_WORLD, INT_MAX};
    uly_comm c;
    uly_status st = uly_mpi_comm(&m, &c);
    ALL_CHECK(st.code == ULY_OK, "chunk_bytes INT_MAX: %s", st.msg);
}

/* An intercommunicator (two groups: ranks 0, 1 and ranks 2, 3) is refused, by uly_mpi_comm and
   by uly_mpi_split: its sizes and collectives are the other group's. */
TEST(mpi_comm_and_split_refuse_an_intercommunicator) {
    MPI_Comm half, inter, sp, dp;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank / 2, world_rank, &half);
    MPI_Intercomm_create(half, 0, MPI_COMM_WORLD, world_rank < 2 ? 2 : 0, 7, &inter);
    uly_mpi m = {inter, 0};
    uly_comm c;
    uly_status st = uly_mpi_comm(&m, &c);
    ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, "m->comm is an intercommunicator"), "%s",
              st.msg);
    st = uly_mpi_split(inter, 1, &sp, &dp);
    ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, "world is an intercommunicator"), "%s",
              st.msg);
    MPI_Comm_free(&inter), MPI_Comm_free(&half);
}

/* Every call leaves the caller's error handler on its communicator (the default: fatal). */
TEST(mpi_calls_give_the_callers_error_handler_back) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    double x = 1;
    int64_t z[ULY_MAX_SP] = {0};
    uly_status st = comm.allreduce_sum(comm.ctx, &x, 1, NULL);
    if (!st.code) st = comm.barrier(comm.ctx);
    if (!st.code) st = comm.alltoallv(comm.ctx, NULL, z, z, NULL, z, z, NULL);
    MPI_Comm sp, dp;
    if (!st.code) st = uly_mpi_split(MPI_COMM_WORLD, 2, &sp, &dp);
    ALL_CHECK(!st.code, "%s", st.msg);
    if (!st.code) MPI_Comm_free(&sp), MPI_Comm_free(&dp);
    MPI_Errhandler h;
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &h);
    ALL_CHECK(h == MPI_ERRORS_ARE_FATAL, "MPI_COMM_WORLD's handler is not MPI_ERRORS_ARE_FATAL");
    MPI_Errhandler_free(&h);
}

/* A split that one rank asks differently (another sp_size, one out of range, a NULL dp) fails
   on every rank, which makes no communicator, instead of leaving peers in a split. */
TEST(mpi_split_asked_differently_by_one_rank_fails_on_every_rank) {
    static const struct {
        int sp_size_of_rank_3, null_dp;
        const char *rank_3_says;
    } cases[] = {{4, 0, "differs between the world's ranks: from 2 to 4"},
                 {0, 0, "sp_size (0) must be in [1, 256]"},
                 {2, 1, "dp is NULL"}};
    for (int i = 0; i < 3; i++) {
        MPI_Comm sp = MPI_COMM_WORLD, dp = MPI_COMM_WORLD;
        const int me3 = world_rank == 3;
        uly_status st = uly_mpi_split(MPI_COMM_WORLD, me3 ? cases[i].sp_size_of_rank_3 : 2, &sp,
                                      me3 && cases[i].null_dp ? NULL : &dp);
        const char *want = me3 ? cases[i].rank_3_says : "sp_size differs between the world's";
        ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, want) && sp == MPI_COMM_NULL &&
                      (dp == MPI_COMM_NULL || (me3 && cases[i].null_dp)),
                  "case %d: '%s', want '%s'; sp %s, dp %s", i, st.msg, want,
                  sp == MPI_COMM_NULL ? "null" : "set", dp == MPI_COMM_NULL ? "null" : "set");
    }
}

TEST(mpi_split_of_a_null_world_fails_and_leaves_both_null) {
    MPI_Comm sp = MPI_COMM_WORLD, dp = MPI_COMM_WORLD;
    uly_status st = uly_mpi_split(MPI_COMM_NULL, 2, &sp, &dp);
    ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, "world is MPI_COMM_NULL"), "%s", st.msg);
    ALL_CHECK(sp == MPI_COMM_NULL && dp == MPI_COMM_NULL, "sp %s, dp %s",
              sp == MPI_COMM_NULL ? "null" : "set", dp == MPI_COMM_NULL ? "null" : "set");
}

TEST(allreduce_sum_adds_every_ranks_doubles_in_place) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    double buf[5];
    for (int i = 0; i < 5; i++) buf[i] = world_rank * 10.0 + i + 0.5;
    uly_status st = comm.allreduce_sum(comm.ctx, buf, 5, NULL);
    ALL_CHECK(st.code == ULY_OK, "%s", st.msg);
    int bad = 0;
    for (int i = 0; i < 5; i++) bad += buf[i] != 10.0 * (0 + 1 + 2 + 3) + 4 * (i + 0.5);
    ALL_CHECK(bad == 0, "%d sums wrong (buf[0] = %g)", bad, buf[0]);
}

TEST(mpi_split_makes_sp_groups_of_consecutive_ranks_and_dp_groups_across) {
    MPI_Comm sp = MPI_COMM_NULL, dp = MPI_COMM_NULL;
    uly_status st = uly_mpi_split(MPI_COMM_WORLD, 2, &sp, &dp);
    ALL_CHECK(st.code == ULY_OK, "%s", st.msg);
    if (st.code) return; /* the same on every rank */
    int sps, spr, dps, dpr, members[2];
    MPI_Comm_size(sp, &sps);
    MPI_Comm_rank(sp, &spr);
    MPI_Comm_size(dp, &dps);
    MPI_Comm_rank(dp, &dpr);
    MPI_Allgather(&world_rank, 1, MPI_INT, members, 1, MPI_INT, sp);
    ALL_CHECK(sps == 2 && spr == world_rank % 2 && dps == 2 && dpr == world_rank / 2,
              "sp %d/%d dp %d/%d", spr, sps, dpr, dps);
    int base = world_rank - world_rank % 2;
    ALL_CHECK(members[0] == base && members[1] == base + 1, "SP group {%d, %d}", members[0],
              members[1]);
    MPI_Comm_free(&sp);
    MPI_Comm_free(&dp);
}

TEST(two_dp_groups_of_sp_2_each_run_their_own_layer) {
    MPI_Comm sp = MPI_COMM_NULL, dp = MPI_COMM_NULL;
    uly_status st = uly_mpi_split(MPI_COMM_WORLD, 2, &sp, &dp);
    ALL_CHECK(st.code == ULY_OK, "%s", st.msg);
    if (st.code) return;
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, sp, 1000);
    /* Each DP group has its own data (seed) and checks against its own references. */
    sp_case c = {2, 2, 23, 5, 1, 8, 1, 0, 0};
    check_layer(&comm, &c, 3000 + (uint64_t)(world_rank / 2), "dp group");
    MPI_Comm_free(&sp);
    MPI_Comm_free(&dp);
}

/* uly_layer_agree over MPI: the same layer on every rank, then world rank 3 with S = 67, then
   with sp_size 2 (a plan for another split of the world, not this communicator's): no rank may
   wait for it in a collective. */
static uly_status agree_over_mpi(const uly_comm *comm, int64_t S_of_rank_3, int sp_of_rank_3) {
    uly_plan p;
    uly_plan_desc d = {.world_size = world_size, .rank = world_rank,
                       .sp_size = world_rank == 3 ? sp_of_rank_3 : world_size, .batch = 1,
                       .seq_len = world_rank == 3 ? S_of_rank_3 : 64, .n_heads = 8,
                       .n_kv_heads = 2, .head_dim = 16, .dtype = ULY_F32};
    uly_status st = uly_plan_init(&p, &d);
    uly_layer l = {.plan = &p, .comm = comm, .causal = 1};
    return st.code ? st : uly_layer_agree(&l);
}

TEST(layer_agree_over_mpi_passes_alike_layers_and_fails_everywhere_on_another_S_or_split) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    uly_status st = agree_over_mpi(&comm, 64, world_size);
    ALL_CHECK(st.code == ULY_OK, "%s", st.msg);
    st = agree_over_mpi(&comm, 67, world_size);
    const char *want = world_rank == 3 ? "seq_len is 67 on this rank (sp rank 3), 64 on sp rank 0"
                                       : "1 of 4 sp ranks";
    ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, want), "%s (want \"%s\")", st.msg, want);
    st = agree_over_mpi(&comm, 64, 2);
    want = world_rank == 3 ? "layer.comm is rank 3 of 4, the plan's sp rank 1 of 2"
                           : "1 of 4 sp ranks";
    ALL_CHECK(st.code == ULY_EINVAL && strstr(st.msg, want), "%s (want \"%s\")", st.msg, want);
}

TEST(loss_reduce_over_mpi_with_an_empty_rank_is_sum_all_over_count_all) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    /* rank r adds r * 1.5 over 2r tokens: rank 0 has none */
    double mean = -1, scale = -1;
    uly_status st = uly_loss_reduce(&comm, world_rank * 1.5, 2 * world_rank, &mean, &scale);
    ALL_CHECK(st.code == ULY_OK, "%s", st.msg);
    ALL_CHECK(fabs(mean - 9.0 / 12.0) <= 1e-12 && fabs(scale - 1.0 / 12.0) <= 1e-15,
              "mean %.17g scale %.17g", mean, scale);
}

TEST(loss_reduce_over_mpi_with_no_valid_token_anywhere_is_zero_not_nan) {
    uly_mpi m;
    uly_comm comm = mpi_comm(&m, MPI_COMM_WORLD, 0);
    double mean = -1, scale = -1;
    uly_status st = uly_loss_reduce(&comm, 0.0, 0, &mean, &scale);
    ALL_CHECK(st.code == ULY_OK && mean == 0 && scale == 0, "mean %g scale %g (%s)", mean, scale,
              st.msg);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    /* Checks are collective, so every rank has the same results: rank 0 reports them. */
    if (world_rank != 0 && !freopen("/dev/null", "w", stdout)) return 1;
    int rc = world_size == 4 ? uly_run_tests() : (printf("0 passed, 1 failed (needs -np 4)\n"), 1);
    MPI_Finalize();
    return rc;
}
