/* bench_mpi.c - the MPI communicator's alltoallv (uly_mpi_comm) against a raw MPI_Alltoallv of
   the same bytes: the Q exchange of an SP group of all processes at several sequence lengths.
   The target is a ratio <= 1.05. Run with one process a core (make bench runs 2 to 4); an
   argument caps the sequence lengths (S from 4096 to 65536, times 4). */
#include <mpi.h>
#define ULYSSES_MPI
#define ULYSSES_IMPLEMENTATION
#include "ulysses.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { REPS = 10 };

/* Seconds of the slowest rank, so every rank reports the same time. */
static double timed(uly_comm *c, const int64_t *cnt[4], const int *icnt[4], void *send,
                    void *recv, int raw) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    if (raw)
        MPI_Alltoallv(send, icnt[0], icnt[1], MPI_BYTE, recv, icnt[2], icnt[3], MPI_BYTE,
                      MPI_COMM_WORLD);
    else {
        uly_status st = c->alltoallv(c->ctx, send, cnt[0], cnt[1], recv, cnt[2], cnt[3], NULL);
        if (st.code) fprintf(stderr, "bench_mpi: %s\n", st.msg), MPI_Abort(MPI_COMM_WORLD, 1);
    }
    t = MPI_Wtime() - t;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return t;
}

int main(int argc, char **argv) {
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int64_t max_s = argc > 1 ? atoll(argv[1]) : 65536;
    uly_mpi m = {MPI_COMM_WORLD, 0};
    uly_comm c;
    uly_status st = uly_mpi_comm(&m, &c);
    if (st.code) fprintf(stderr, "bench_mpi: %s\n", st.msg), MPI_Abort(MPI_COMM_WORLD, 1);
    if (rank == 0)
        printf("bench_mpi: uly_mpi_comm alltoallv vs raw MPI_Alltoallv, Q exchange, P = %d, "
               "H = 16, D = 128, f32 (best of %d; target ratio <= 1.05)\n"
               "  S        MB per rank  raw ms    uly ms    ratio\n", size, REPS);
    for (int64_t S = 4096; S <= max_s; S *= 4) {
        uly_plan p;
        uly_plan_desc d;
        int64_t cnt[4][ULY_MAX_SP];
        int icnt[4][ULY_MAX_SP];
        memset(&d, 0, sizeof d);
        d.world_size = d.sp_size = size, d.rank = rank, d.batch = 1, d.seq_len = S;
        d.n_heads = 16, d.head_dim = 128, d.dtype = ULY_F32;
        st = uly_plan_init(&p, &d);
        if (st.code) fprintf(stderr, "bench_mpi: %s\n", st.msg), MPI_Abort(MPI_COMM_WORLD, 1);
        uly_exchange_counts(&p, ULY_X_Q, cnt[0], cnt[1], cnt[2], cnt[3]);
        for (int a = 0; a < 4; a++)
            for (int j = 0; j < size; j++) icnt[a][j] = (int)cnt[a][j];
        const int64_t *cp[4] = {cnt[0], cnt[1], cnt[2], cnt[3]};
        const int *ip[4] = {icnt[0], icnt[1], icnt[2], icnt[3]};
        int64_t bytes = uly_send_bytes(&p, ULY_X_Q);
        int64_t got = uly_recv_bytes(&p, ULY_X_Q);
        char *send = (char *)malloc((size_t)bytes), *recv = (char *)malloc((size_t)got);
        memset(send, rank, (size_t)bytes); /* touch every page before timing */
        memset(recv, 0, (size_t)got);
        double best[2] = {1e30, 1e30};
        for (int i = 0; i < REPS; i++) /* interleaved, so both see the same machine */
            for (int raw = 1; raw >= 0; raw--) {
                double t = timed(&c, cp, ip, send, recv, raw);
                if (t < best[raw]) best[raw] = t;
            }
        if (rank == 0)
            printf("  %-7lld  %11.1f  %8.3f  %8.3f  %5.3f\n", (long long)S, bytes / 1e6,
                   best[1] * 1e3, best[0] * 1e3, best[0] / best[1]);
        free(send), free(recv);
    }
    MPI_Finalize();
    return 0;
}
