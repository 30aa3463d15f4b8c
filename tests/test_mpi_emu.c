/* test_mpi_emu.c - the MPI double (tests/emu/mpi_emu.cpp) under which make test runs
   examples/sp_attention_nccl.cu, built as the example is and run as `test_mpi_emu -np N`. Each
   rank checks MPI_Bcast from every root, MPI_Allreduce by MPI_MAX and MPI_SUM, and the shared
   split, and exits with its own failures (the process with the most of any rank); rank 0 prints
   the tally. `test_mpi_emu -np N mismatch` has rank 0 enter another collective than its peers,
   which must end the process with a message naming both, where MPI would hang. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

/* A rank's tally: ranks are threads here, so nothing a rank writes is a global. */
typedef struct tally {
    int rank, checks, failed;
} tally;

static void check(tally *t, int ok, int line, const char *what) {
    t->checks++;
    if (!ok) t->failed++, fprintf(stderr, "rank %d: test_mpi_emu.c:%d: %s\n", t->rank, line, what);
}
#define CHECK(c) check(&t, c, __LINE__, #c)

int main(int argc, char **argv) {
    tally t = {0, 0, 0};
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    t.rank = rank;
    if (argc > 1 && !strcmp(argv[1], "mismatch")) {
        int x = rank, y;
        if (rank == 0) MPI_Bcast(&x, 1, MPI_INT, 0, MPI_COMM_WORLD);
        else MPI_Allreduce(&x, &y, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        return 0;
    }

    for (int root = 0; root < size; root++) {
        char buf[37];
        int same = 1;
        memset(buf, rank == root ? 'a' + root : '?', sizeof buf);
        MPI_Bcast(buf, (int)sizeof buf, MPI_BYTE, root, MPI_COMM_WORLD);
        for (size_t i = 0; i < sizeof buf; i++) same &= buf[i] == 'a' + root;
        CHECK(same);
    }

    int v[2] = {rank, 10 * rank + 1}, most[2], sum[2];
    MPI_Allreduce(v, most, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(v, sum, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(most[0] == size - 1 && most[1] == 10 * (size - 1) + 1);
    CHECK(sum[0] == size * (size - 1) / 2 && sum[1] == 5 * size * (size - 1) + size);
    CHECK(v[0] == rank && v[1] == 10 * rank + 1);

    MPI_Comm node;
    int node_rank, node_size;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &node_size);
    CHECK(node_rank == rank && node_size == size);
    MPI_Comm_free(&node);
    CHECK(node == MPI_COMM_NULL);

    int mine[2] = {t.checks, t.failed}, all[2];
    MPI_Allreduce(mine, all, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%d passed, %d failed\n", all[0] - all[1], all[1]);
    MPI_Finalize();
    return t.failed != 0;
}
