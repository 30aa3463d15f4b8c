// mpi_emu.cpp: MPI ranks as threads of one process, so that examples/sp_attention_nccl.cu, an
// MPI program, runs in make test on a CPU: the CUDA emulator (cuda_emu.cpp) runs its kernels
// and nccl_emu.cpp its NCCL, whose ranks are threads too. A test double, not part of the product.
//
// The program is built with tests/emu/mpi on its include path (its <mpi.h> is mpi/mpi.h) and
// -Dmain=mpi_emu_main. This file's main takes mpirun's `-np N`, runs mpi_emu_main on N threads,
// one rank each, with the arguments after N, and exits with the largest status they return.
//
// The program's ranks share its globals, so a rank must write none (processes each have their
// own). What it models: the calls mpi/mpi.h declares, with MPI's semantics for ranks on one node.
// MPI_Bcast, MPI_Allreduce (MPI_INT by MPI_MAX or MPI_SUM), MPI_Comm_split_type and
// MPI_Finalize meet every rank.
// Where MPI would hang or corrupt memory, the double aborts with a message instead: ranks that
// enter different collectives (or the same with other counts, types, roots or operations), a
// rank that waits a minute for its peers, an unknown communicator, type or operation.
// MPI_Abort ends the process with its code, as mpirun ends the job.
#include "mpi/mpi.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

thread_local int my_rank = -1;
int n_ranks;

// A meeting of all ranks (meet): each names its call in what, and leaves its contribution (if
// any) in slot; the last to arrive checks the names and releases the others.
std::mutex mu;
std::condition_variable cv;
int arrived;
unsigned long generation;
std::vector<const void *> slot;
std::vector<std::string> what;

// Long enough for any rank of a test to reach its matching call, even under the emulator.
constexpr std::chrono::seconds kHang(60);

[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "mpi_emu: rank %d: %s\n", my_rank, buf);
    abort();
}

__attribute__((format(printf, 1, 2))) std::string format(const char *fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

// MPI_COMM_WORLD, or the copy of it that MPI_Comm_split_type makes.
constexpr MPI_Comm kNode = MPI_COMM_WORLD + 1;

void check_comm(MPI_Comm comm, const char *call) {
    if (comm != MPI_COMM_WORLD && comm != kNode) fatal("%s: no communicator %d", call, comm);
}

int type_size(MPI_Datatype type, const char *call) {
    if (type == MPI_BYTE) return 1;
    if (type == MPI_INT) return (int)sizeof(int);
    fatal("%s: datatype %d is not MPI_BYTE or MPI_INT", call, type);
}

// Waits until every rank has called meet with the same call. mine, unless NULL, is this rank's
// contribution: the others read it after the meeting, so the next meeting (which every rank
// reaches only once done reading) leaves slot as it is.
void meet(const std::string &call, const void *mine = nullptr) {
    std::unique_lock<std::mutex> lock(mu);
    if (mine) slot[my_rank] = mine;
    what[my_rank] = call;
    const unsigned long gen = generation;
    if (++arrived == n_ranks) {
        for (int r = 0; r < n_ranks; r++)
            if (what[r] != call)
                fatal("rank %d called %s while rank %d called %s", r, what[r].c_str(), my_rank,
                      call.c_str());
        arrived = 0, generation++;
        cv.notify_all();
    } else if (!cv.wait_for(lock, kHang, [&] { return generation != gen; })) {
        fatal("waited %lld s in %s for the other ranks", (long long)kHang.count(), call.c_str());
    }
}

} // namespace

int MPI_Init(int *, char ***) { return MPI_SUCCESS; }

int MPI_Finalize(void) {
    meet("MPI_Finalize");
    return MPI_SUCCESS;
}

int MPI_Comm_rank(MPI_Comm comm, int *rank) {
    check_comm(comm, "MPI_Comm_rank");
    *rank = my_rank;
    return MPI_SUCCESS;
}

int MPI_Comm_size(MPI_Comm comm, int *size) {
    check_comm(comm, "MPI_Comm_size");
    *size = n_ranks;
    return MPI_SUCCESS;
}

int MPI_Comm_split_type(MPI_Comm comm, int split_type, int, MPI_Info, MPI_Comm *out) {
    check_comm(comm, "MPI_Comm_split_type");
    if (split_type != MPI_COMM_TYPE_SHARED)
        fatal("MPI_Comm_split_type: split type %d is not MPI_COMM_TYPE_SHARED", split_type);
    meet("MPI_Comm_split_type");
    *out = kNode;
    return MPI_SUCCESS;
}

int MPI_Comm_free(MPI_Comm *comm) {
    if (*comm != kNode) fatal("MPI_Comm_free: communicator %d is not one MPI made", *comm);
    *comm = MPI_COMM_NULL;
    return MPI_SUCCESS;
}

int MPI_Bcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm) {
    check_comm(comm, "MPI_Bcast");
    const size_t bytes = (size_t)count * (size_t)type_size(type, "MPI_Bcast");
    if (root < 0 || root >= n_ranks) fatal("MPI_Bcast: root %d of %d ranks", root, n_ranks);
    meet(format("MPI_Bcast(count %d, type %d, root %d)", count, type, root), buf);
    if (my_rank != root) memcpy(buf, slot[root], bytes);
    meet("MPI_Bcast's copies");
    return MPI_SUCCESS;
}

int MPI_Allreduce(const void *send, void *recv, int count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm) {
    check_comm(comm, "MPI_Allreduce");
    if (type != MPI_INT || (op != MPI_MAX && op != MPI_SUM))
        fatal("MPI_Allreduce: only MPI_INT by MPI_MAX or MPI_SUM (type %d, op %d)", type, op);
    meet(format("MPI_Allreduce(count %d, type %d, op %d)", count, type, op), send);
    std::vector<int> sum((size_t)count);
    for (int i = 0; i < count; i++) {
        sum[i] = ((const int *)slot[0])[i];
        for (int r = 1; r < n_ranks; r++) {
            const int x = ((const int *)slot[r])[i];
            sum[i] = op == MPI_MAX ? std::max(sum[i], x) : sum[i] + x;
        }
    }
    meet("MPI_Allreduce's sums"); /* no rank returns while another reads its send */
    memcpy(recv, sum.data(), sum.size() * sizeof(int));
    return MPI_SUCCESS;
}

int MPI_Abort(MPI_Comm comm, int code) {
    check_comm(comm, "MPI_Abort");
    fprintf(stderr, "mpi_emu: rank %d called MPI_Abort(%d)\n", my_rank, code);
    fflush(stdout), fflush(stderr);
    _Exit(code);
}

int main(int argc, char **argv) {
    if (argc < 3 || strcmp(argv[1], "-np") || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: %s -np N [args...]: N ranks, as threads\n", argv[0]);
        return 2;
    }
    n_ranks = atoi(argv[2]);
    slot.resize((size_t)n_ranks), what.resize((size_t)n_ranks);
    std::vector<int> status((size_t)n_ranks);
    std::vector<std::thread> ranks;
    for (int r = 0; r < n_ranks; r++)
        ranks.emplace_back([&, r] {
            std::vector<char *> args{argv[0]};
            args.insert(args.end(), argv + 3, argv + argc);
            args.push_back(nullptr);
            my_rank = r;
            status[(size_t)r] = mpi_emu_main(argc - 2, args.data());
        });
    for (std::thread &t : ranks) t.join();
    return *std::max_element(status.begin(), status.end());
}
