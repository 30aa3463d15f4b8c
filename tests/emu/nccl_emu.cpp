// nccl_emu.cpp: an in-process NCCL for the CUDA emulator, so the NCCL communicator of
// ulysses_cuda.cuh runs in make test. A test double, not part of the product: link it instead of
// -lnccl, with tests/emu/cuda_emu.cpp; tests/emu/nccl_emu.h declares its test hooks.
//
// What it models. Ranks are host threads of one process, each thread one rank of a communicator
// and standing for a process with its own GPU; emulated device memory is host memory, so a rank
// copies from its peers' buffers directly. It implements, with the signatures of <nccl.h> and
// the behaviour NCCL documents, the subset that ulysses_cuda.cuh and tests/test_nccl.cu call:
//   ncclGetUniqueId, ncclCommInitRank   the ranks meet on the id; init blocks until all arrive
//   ncclCommInitRankConfig              the same; of the config, only `blocking` is read
//   ncclCommSplit                       same color, same communicator; ranked by key, ties by
//                                       the old rank; NCCL_SPLIT_NOCOLOR gives NULL
//   ncclCommDestroy, ncclCommAbort, ncclCommCount, ncclCommUserRank
//   ncclCommGetAsyncError               and a communicator with an error refuses new work
//   ncclGetErrorString, ncclGetLastError   NCCL's strings; the last error is per thread (NCCL's
//                                       is per process, and a thread here is a process)
//   ncclGetVersion                      the header's version, or the one a test sets
//                                       (built with -DULY_EMU_NCCL_2_27: an older libnccl.so.2,
//                                       version 2.27.7 and no ncclAlltoAll)
//   ncclGroupStart, ncclGroupEnd        per thread, nested; the outermost end runs the group;
//                                       a call that failed inside drops the whole group
//   ncclSend, ncclRecv                  matched in call order per (sender, receiver) pair
//   ncclAlltoAll, ncclAllReduce         ncclAllReduce: ncclSum of ncclFloat64, in place or not,
//                                       summed in rank order (reproducible; so is NCCL's result
//                                       on a fixed topology, not this order)
// Every call that names a stream is noted in the calling thread's record of stream-ordered work
// (uly_emu_record_op, tests/emu/cuda_emu.h), with that stream, so tests can see that the library
// queues its exchanges where it should. A call first waits for the work queued on its stream
// (emulator streams run asynchronously), then completes before it returns, so the stream's later
// work finds it done: a collective blocks until every rank has called it (the last to arrive
// does it for all), a group until its sends are received and its receives filled. A
// group posts its sends before it waits on its receives, so exchanges in a group never deadlock,
// as NCCL promises.
//
// Where NCCL would hang or corrupt memory, the double fails loudly instead. With
// ncclInvalidUsage on every rank involved and the reason in ncclGetLastError: collectives that
// differ between ranks, a send and a receive of different byte counts, and a deadlock (every
// rank of a communicator waits on it and none can go on, say one in ncclAlltoAll while the
// others wait in ncclRecv), after which the communicator refuses new work. With a message and
// abort(): waiting on a peer that destroyed or aborted its communicator, waiting 60 s on a peer
// busy elsewhere, any call on a destroyed communicator, and anything outside the subset (other
// reductions or types, a config, collectives or init inside a group).
//
// Non-blocking communicators (config.blocking = 0, and their splits): every call that queues
// work (and their init and split) answers ncclInProgress once its work is done here, and
// ncclCommGetAsyncError then answers ncclInProgress twice more before the real state, so the
// caller must poll; any other call on the communicator before that aborts, as NCCL forbids it.
// A stream argument of cudaStreamPerThread is ncclInvalidUsage there: NCCL launches such a
// communicator's work from a thread of its own, whose per-thread stream is not the caller's.
//
// Not modeled: the network and topology (algorithms, channels, timing), a collective still
// running after its call returns (but for the busy stream of uly_emu_nccl_late), several ranks
// on one thread, and failures other than the ones the test hooks inject.
#include "cuda_emu.h"
#include <nccl.h>

#include "nccl_emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

// The calls uly_emu_nccl_calls counts. Those from kFirstFaultable on take a live communicator
// and serve its injected faults (enter); a fault queued for one of the others would never fire.
const char *const kCalls[] = {
    "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommDestroy",
    "ncclCommAbort", "ncclGroupStart", "ncclGroupEnd",
    "ncclCommSplit", "ncclCommCount", "ncclCommUserRank", "ncclCommGetAsyncError", "ncclSend",
    "ncclRecv", "ncclAlltoAll", "ncclAllReduce"};
constexpr int kNumCalls = sizeof kCalls / sizeof *kCalls;
const char *const kFirstFaultable = "ncclCommSplit";

// Long enough for any peer of a test to reach its matching call, even under ASan.
constexpr std::chrono::seconds kHang(60);

std::string vformat(const char *fmt, va_list ap) {
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    return buf;
}

__attribute__((format(printf, 1, 2))) std::string format(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

// Where NCCL would hang, crash or do something the double does not model.
[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nccl_emu: %s\n", vformat(fmt, ap).c_str());
    va_end(ap);
    abort();
}

int call_index(const char *call) {
    for (int i = 0; i < kNumCalls; i++)
        if (!strcmp(kCalls[i], call)) return i;
    fatal("tests/emu/nccl_emu.cpp has no NCCL call named '%s'", call);
}

thread_local std::string last_error;

__attribute__((format(printf, 2, 3))) ncclResult_t error(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    last_error = vformat(fmt, ap);
    va_end(ap);
    return r;
}

size_t type_size(ncclDataType_t t) {
    static const size_t size[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return t >= 0 && t < ncclNumTypes ? size[t] : 0;
}

struct Fault {
    std::string call;
    ncclResult_t r;
    std::string msg;
};

struct Clique;

}  // namespace

struct ncclComm {
    Clique *clique;
    int rank;
    unsigned long long colls = 0;  // collectives entered: the sequence number of the next one
    ncclResult_t async = ncclSuccess;
    std::string async_msg;
    std::vector<Fault> faults;
    const char *gone = nullptr;  // "ncclCommDestroy" or "ncclCommAbort" once called
    bool nonblocking = false;
    int pending = 0;      // polls that still answer ncclInProgress; -1: every poll
    bool stalls = false;  // uly_emu_nccl_stall: the next call stays in progress
    long late_ms = 0;     // uly_emu_nccl_late: the next collective's stream stays busy so long
};

namespace {

// A send of a group, until the peer's matching receive takes it.
struct Post {
    const ncclComm *from;
    int to;
    const void *buf;
    size_t bytes;
    bool taken;
    ncclResult_t r;  // ncclInvalidUsage when the receive wanted another size
    std::string msg;
};

// What one rank passed to a collective.
struct Arg {
    const char *call;
    const void *send;
    void *recv;
    size_t count;
    ncclDataType_t type;
    int color, key;  // ncclCommSplit
    ncclComm_t *newcomm;
};

// One collective of a clique: the ranks' arguments, then the outcome.
struct Coll {
    std::vector<Arg> args;
    int arrived = 0, left = 0;
    bool done = false;
    ncclResult_t r = ncclSuccess;  // the same for every rank
    std::string msg;
};

// A rank blocked on its communicator: what it waits in, and the condition that releases it.
struct Waiter {
    int rank;
    std::string what;
    std::function<bool()> ready;
};

// The ranks of one communicator and what is in flight between them.
struct Clique {
    int size;
    std::vector<ncclComm *> ranks;                            // null until they join
    std::map<std::pair<int, int>, std::vector<Post *>> posts;  // by (from, to), oldest first
    std::map<unsigned long long, Coll> colls;                  // by sequence number
    std::vector<const Waiter *> waiters;
    std::string deadlock;  // why its ranks gave up, once all waited on it and none could go on
};

// One lock for all: tests move kilobytes, so simplicity wins over concurrency.
std::mutex m;
std::condition_variable cv;
unsigned long long counts[kNumCalls];
// Never freed before exit: a destroyed communicator stays, so a later call on it is caught.
std::vector<std::unique_ptr<Clique>> cliques;
std::vector<std::unique_ptr<ncclComm>> comms;
std::map<std::string, Clique *> forming;  // ncclCommInitRank: unique id -> clique being formed
unsigned long long ids = 0;

Clique *new_clique(int size) {
    cliques.push_back(std::make_unique<Clique>());
    cliques.back()->size = size;
    cliques.back()->ranks.assign(size, nullptr);
    return cliques.back().get();
}

ncclComm *new_comm(Clique *c, int rank) {
    comms.push_back(std::make_unique<ncclComm>());
    ncclComm *comm = comms.back().get();
    comm->clique = c;
    comm->rank = rank;
    c->ranks[rank] = comm;
    return comm;
}

// Only a clique's own ranks can release its waiters, so when all of them wait on it and no
// condition holds, none ever will: NCCL would hang. Every waiter then gives up with the reason,
// and its sends on the clique are void at once (a peer that wakes first may destroy its end).
void find_deadlock(Clique &c) {
    if ((int)c.waiters.size() < c.size) return;
    std::vector<const Waiter *> w = c.waiters;
    for (const Waiter *x : w)
        if (x->ready()) return;
    std::sort(w.begin(), w.end(),
              [](const Waiter *a, const Waiter *b) { return a->rank < b->rank; });
    c.deadlock = "deadlock (NCCL would hang):";
    for (const Waiter *x : w)
        c.deadlock += format("%s rank %d in %s", x == w[0] ? "" : ",", x->rank, x->what.c_str());
    for (auto &q : c.posts) q.second.clear();  // the queues stay: waiters watch them
    cv.notify_all();
}

// Waits (holding m through lock) until ready(); false, with the reason as the last error, if
// me's communicator deadlocks. me waits on `peer`, or on every rank (-1); a rank it waits on
// that has left, or 60 s without progress, abort the process. me is null while a clique forms.
template <typename F>
bool wait(std::unique_lock<std::mutex> &lock, const ncclComm *me, int peer,
          const std::string &what, F ready) {
    if (ready()) return true;
    Clique *c = me ? me->clique : nullptr;
    const Waiter self = {me ? me->rank : -1, what, ready};
    if (c) c->waiters.push_back(&self), find_deadlock(*c);
    const auto stuck = [&] { return c && !c->deadlock.empty(); };
    const auto deadline = std::chrono::steady_clock::now() + kHang;
    while (!ready() && !stuck()) {
        for (int r = 0; me && r < c->size; r++) {
            const ncclComm *p = c->ranks[r];
            if ((peer < 0 || r == peer) && p->gone)
                fatal("rank %d waits in %s, but rank %d called %s: NCCL would hang here", me->rank,
                      what.c_str(), r, p->gone);
        }
        if (cv.wait_until(lock, deadline) == std::cv_status::timeout && !ready() && !stuck())
            fatal("%s waits in %s for %lld s: NCCL would hang here (a peer never made the "
                  "matching call)", me ? format("rank %d", me->rank).c_str() : "a rank",
                  what.c_str(), (long long)kHang.count());
    }
    if (c) c->waiters.erase(std::find(c->waiters.begin(), c->waiters.end(), &self));
    if (ready()) return true;
    error(ncclInvalidUsage, "%s", c->deadlock.c_str());
    return false;
}

void tally(const char *call) {
    std::lock_guard<std::mutex> lock(m);
    counts[call_index(call)]++;
}

// Every call on a communicator: counted, no use after destroy or while a non-blocking call is
// in progress, and an injected fault served.
ncclResult_t enter(const char *call, ncclComm *comm) {
    tally(call);
    if (!comm) return error(ncclInvalidArgument, "%s: comm is NULL", call);
    std::lock_guard<std::mutex> lock(m);
    if (comm->gone)
        fatal("%s on rank %d's communicator after %s: NCCL would use freed memory", call,
              comm->rank, comm->gone);
    if (comm->pending && strcmp(call, "ncclCommGetAsyncError"))
        fatal("%s on rank %d's non-blocking communicator while its last call is in progress: "
              "NCCL wants ncclCommGetAsyncError to say so first", call, comm->rank);
    for (auto f = comm->faults.begin(); f != comm->faults.end(); ++f)
        if (f->call == call) {
            const ncclResult_t r = error(f->r, "%s", f->msg.c_str());
            comm->faults.erase(f);
            return r;
        }
    return ncclSuccess;
}

// Calls that queue work: NCCL refuses them on a communicator with an asynchronous error, and
// a deadlocked one would still hang.
ncclResult_t enter_work(const char *call, ncclComm *comm) {
    if (ncclResult_t r = enter(call, comm)) return r;
    std::lock_guard<std::mutex> lock(m);
    if (!comm->clique->deadlock.empty())
        return error(ncclInvalidUsage, "%s: %s", call, comm->clique->deadlock.c_str());
    return comm->async ? error(comm->async, "%s", comm->async_msg.c_str()) : ncclSuccess;
}

// A finished call's answer: ncclInProgress on a non-blocking communicator, which then stays in
// progress for two polls (for ever once stalled).
ncclResult_t progress(ncclComm *comm, ncclResult_t r) {
    if (r != ncclSuccess || !comm->nonblocking) return r;
    std::lock_guard<std::mutex> lock(m);
    comm->pending = comm->stalls ? -1 : 2;
    return ncclInProgress;
}

// The answer r of a collective queued on stream, after which the stream stays busy for the
// milliseconds uly_emu_nccl_late set, as a GPU's collective kernel waits for a late peer.
ncclResult_t late(ncclComm *comm, cudaStream_t stream, ncclResult_t r) {
    long ms;
    {
        std::lock_guard<std::mutex> lock(m);
        ms = comm->late_ms;
        comm->late_ms = 0;
    }
    if (ms > 0)
        uly_emu_queue(stream, [ms] {
            const struct timespec t = {ms / 1000, ms % 1000 * 1000000L};
            nanosleep(&t, NULL);
        });
    return r;
}

// A non-blocking communicator's work starts on NCCL's thread, where cudaStreamPerThread is that
// thread's stream: the caller's work on its own per-thread stream would not be ordered with it.
// The call's stream: the work queued on it before the call has run when the call moves data.
ncclResult_t on_stream(const char *call, const ncclComm *comm, cudaStream_t stream) {
    if (comm && comm->nonblocking && stream == cudaStreamPerThread)
        return error(ncclInvalidUsage, "%s: cudaStreamPerThread on a non-blocking communicator "
                     "is NCCL's own thread's stream, not the caller's", call);
    uly_emu_drain(stream);
    return ncclSuccess;
}

// ---------------------------------------------------------------------------------------------
// Groups and point-to-point

struct Op {
    bool send;
    ncclComm *comm;
    int peer;
    void *buf;
    size_t bytes;
};

thread_local int depth = 0;
thread_local std::vector<Op> queued;
thread_local ncclResult_t group_error = ncclSuccess;

// As NCCL: a call that fails inside a group fails the group's ncclGroupEnd too.
ncclResult_t grouped(ncclResult_t r) {
    if (depth && r != ncclSuccess) group_error = r;
    return r;
}

// A group that gives up takes back the sends no peer took, on any communicator: they live in
// its frame.
ncclResult_t withdraw(std::vector<Post> &sends) {
    for (Post &p : sends) {
        std::vector<Post *> &q = p.from->clique->posts[{p.from->rank, p.to}];
        const auto it = std::find(q.begin(), q.end(), &p);
        if (it != q.end()) q.erase(it);
    }
    return ncclInvalidUsage;
}

// Posts the sends, fills the receives from the oldest post of each peer, then waits until the
// peers took every send. The first mismatch is the result; the last error says which.
ncclResult_t run_p2p(const std::vector<Op> &ops) {
    std::unique_lock<std::mutex> lock(m);
    std::vector<Post> sends;
    sends.reserve(ops.size());  // the peers hold pointers to these
    for (const Op &o : ops)
        if (o.send) {
            sends.push_back(Post{o.comm, o.peer, o.buf, o.bytes, false, ncclSuccess, ""});
            o.comm->clique->posts[{o.comm->rank, o.peer}].push_back(&sends.back());
        }
    cv.notify_all();
    ncclResult_t r = ncclSuccess;
    for (const Op &o : ops) {
        if (o.send) continue;
        std::vector<Post *> &from = o.comm->clique->posts[{o.peer, o.comm->rank}];
        if (!wait(lock, o.comm, o.peer, format("ncclRecv from rank %d", o.peer),
                  [&] { return !from.empty(); }))
            return withdraw(sends);
        Post *p = from.front();
        from.erase(from.begin());
        if (p->bytes == o.bytes) {
            std::copy_n((const char *)p->buf, o.bytes, (char *)o.buf);
        } else {
            p->r = ncclInvalidUsage;
            p->msg = format("ncclRecv: rank %d receives %zu bytes from rank %d, which sends %zu "
                            "(NCCL would hang or truncate)", p->to, o.bytes, p->from->rank,
                            p->bytes);
            r = error(p->r, "%s", p->msg.c_str());
        }
        p->taken = true;
        cv.notify_all();
    }
    for (Post &p : sends) {
        if (!wait(lock, p.from, p.to, format("ncclSend to rank %d", p.to),
                  [&] { return p.taken; }))
            return withdraw(sends);
        if (p.r && !r) r = error(p.r, "%s", p.msg.c_str());
    }
    return r;
}

// ---------------------------------------------------------------------------------------------
// Collectives

// Every rank passes the same call and shape, or NCCL would hang or mix up buffers.
std::string mismatch(const Coll &k) {
    const Arg &a = k.args[0];
    for (size_t r = 1; r < k.args.size(); r++) {
        const Arg &b = k.args[r];
        if (strcmp(a.call, b.call) || a.count != b.count || a.type != b.type)
            return format("%s: rank %zu calls %s (count %zu, type %d) while rank 0 calls %s (count "
                          "%zu, type %d): NCCL would hang or corrupt memory", b.call, r, b.call,
                          b.count, (int)b.type, a.call, a.count, (int)a.type);
    }
    return "";
}

// In rank order, so that every run adds the same numbers the same way.
std::string all_reduce(const Coll &k) {
    const size_t n = k.args[0].count;
    std::vector<double> sum((const double *)k.args[0].send, (const double *)k.args[0].send + n);
    for (size_t r = 1; r < k.args.size(); r++)
        for (size_t i = 0; i < n; i++) sum[i] += ((const double *)k.args[r].send)[i];
    for (const Arg &a : k.args) std::copy(sum.begin(), sum.end(), (double *)a.recv);
    return "";
}

#ifndef ULY_EMU_NCCL_2_27
bool overlap(const char *a, const char *b, size_t n) { return a < b + n && b < a + n; }

// Block j of rank i's send goes to block i of rank j's receive. NCCL has no in-place all-to-all.
std::string all_to_all(const Coll &k) {
    const size_t P = k.args.size(), bytes = k.args[0].count * type_size(k.args[0].type);
    for (size_t r = 0; r < P; r++)
        if (overlap((const char *)k.args[r].send, (const char *)k.args[r].recv, P * bytes))
            return format("ncclAlltoAll: rank %zu's sendbuff and recvbuff overlap (NCCL has no "
                          "in-place all-to-all)", r);
    for (size_t i = 0; i < P; i++)
        for (size_t j = 0; j < P; j++)
            std::copy_n((const char *)k.args[i].send + j * bytes, bytes,
                        (char *)k.args[j].recv + i * bytes);
    return "";
}
#endif

// One new clique per color; in it, ranks ordered by key, then by their rank in the old one.
std::string split(const Coll &k) {
    std::map<int, std::vector<std::pair<int, int>>> colors;  // color -> (key, old rank)
    for (size_t r = 0; r < k.args.size(); r++) {
        const Arg &a = k.args[r];
        if (a.color < 0 && a.color != NCCL_SPLIT_NOCOLOR)
            return format("ncclCommSplit: rank %zu passes color %d (colors are >= 0, or "
                          "NCCL_SPLIT_NOCOLOR)", r, a.color);
        if (a.color == NCCL_SPLIT_NOCOLOR) *a.newcomm = nullptr;
        else colors[a.color].push_back({a.key, (int)r});
    }
    for (auto &c : colors) {
        std::sort(c.second.begin(), c.second.end());
        Clique *q = new_clique((int)c.second.size());
        for (size_t i = 0; i < c.second.size(); i++)
            *k.args[c.second[i].second].newcomm = new_comm(q, (int)i);
    }
    return "";
}

// me enters its communicator's next collective; the last rank to arrive runs it for all. run
// returns why it could not, or "".
ncclResult_t collective(ncclComm *me, const Arg &arg, std::string (*run)(const Coll &)) {
    std::unique_lock<std::mutex> lock(m);
    Clique &c = *me->clique;
    const unsigned long long seq = me->colls++;
    Coll &k = c.colls[seq];
    k.args.resize(c.size);
    k.args[me->rank] = arg;
    if (++k.arrived == c.size) {
        k.msg = mismatch(k);
        if (k.msg.empty()) k.msg = run(k);
        k.r = k.msg.empty() ? ncclSuccess : ncclInvalidUsage;
        k.done = true;
        cv.notify_all();
    }
    if (!wait(lock, me, -1, arg.call, [&] { return k.done; })) return ncclInvalidUsage;
    const ncclResult_t r = k.r ? error(k.r, "%s", k.msg.c_str()) : ncclSuccess;
    if (++k.left == c.size) c.colls.erase(seq);
    return r;
}

void outside_group(const char *call) {
    if (depth) fatal("%s inside a group is not modeled (tests/emu/nccl_emu.cpp)", call);
}

}  // namespace

// =============================================================================================
// The NCCL API

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {  // NCCL's own strings, which callers' messages quote
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
        return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

// NCCL documents comm as unused.
const char *ncclGetLastError(ncclComm_t) { return last_error.c_str(); }

// The library's version, which a test may set below the header's (an older libnccl.so.2).
#ifdef ULY_EMU_NCCL_2_27
static std::atomic<int> lib_version{NCCL_VERSION(2, 27, 7)};
#else
static std::atomic<int> lib_version{NCCL_VERSION_CODE};
#endif

ncclResult_t ncclGetVersion(int *v) {
    if (!v) return error(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *v = lib_version;
    return ncclSuccess;
}

void uly_emu_nccl_version(int code) { lib_version = code; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    tally("ncclGetUniqueId");
    if (!id) return error(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    std::lock_guard<std::mutex> lock(m);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "nccl_emu communicator %llu", ++ids);
    return ncclSuccess;
}

static ncclResult_t init(const char *call, ncclComm_t *comm, int nranks, ncclUniqueId id,
                         int rank) {
    tally(call);
    outside_group(call);
    if (!comm) return error(ncclInvalidArgument, "%s: comm is NULL", call);
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return error(ncclInvalidArgument, "%s: rank %d of %d ranks", call, rank, nranks);
    std::unique_lock<std::mutex> lock(m);
    const std::string key(id.internal, sizeof id.internal);
    Clique *&forming_c = forming[key];
    if (!forming_c) forming_c = new_clique(nranks);
    Clique *c = forming_c;
    if (c->size != nranks)
        fatal("ncclCommInitRank: rank %d says %d ranks, an earlier rank %d: NCCL would hang", rank,
              nranks, c->size);
    if (c->ranks[rank])
        fatal("ncclCommInitRank: two threads are rank %d of one communicator", rank);
    *comm = new_comm(c, rank);
    const auto joined = [c] {
        for (ncclComm *r : c->ranks)
            if (!r) return false;
        return true;
    };
    if (joined()) {
        forming.erase(key);
        cv.notify_all();
    }
    wait(lock, nullptr, -1, call, joined);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    return init("ncclCommInitRank", comm, nranks, id, rank);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
    const ncclResult_t r = init("ncclCommInitRankConfig", comm, nranks, id, rank);
    if (r || !config || config->blocking != 0) return r;
    (*comm)->nonblocking = true;
    return progress(*comm, r);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
    if (ncclResult_t r = enter_work("ncclCommSplit", comm)) return r;
    outside_group("ncclCommSplit");
    if (config) fatal("ncclCommSplit with a config is not modeled (tests/emu/nccl_emu.cpp)");
    if (!newcomm) return error(ncclInvalidArgument, "ncclCommSplit: newcomm is NULL");
    Arg a = {"ncclCommSplit", nullptr, nullptr, 0, ncclUint8, color, key, newcomm};
    const ncclResult_t r = collective(comm, a, split);
    if (!r && *newcomm && comm->nonblocking) { /* the config of none is the parent's */
        (*newcomm)->nonblocking = true;
        progress(*newcomm, r);
    }
    return progress(comm, r);
}

// Both free the communicator in NCCL (Abort without waiting for its work), and accept NULL.
static ncclResult_t leave(const char *call, ncclComm_t comm) {
    tally(call);
    if (!comm) return ncclSuccess;
    std::lock_guard<std::mutex> lock(m);
    if (comm->gone) fatal("%s on rank %d's communicator after %s", call, comm->rank, comm->gone);
    for (const auto &q : comm->clique->posts)
        if (q.first.second == comm->rank && !q.second.empty())
            fatal("rank %d calls %s while rank %d's ncclSend of %zu bytes to it waits: NCCL "
                  "would hang", comm->rank, call, q.first.first, q.second.front()->bytes);
    comm->gone = call;
    cv.notify_all();
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return leave("ncclCommDestroy", comm); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return leave("ncclCommAbort", comm); }

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (ncclResult_t r = enter("ncclCommCount", comm)) return r;
    if (!count) return error(ncclInvalidArgument, "ncclCommCount: count is NULL");
    *count = comm->clique->size;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (ncclResult_t r = enter("ncclCommUserRank", comm)) return r;
    if (!rank) return error(ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async) {
    if (ncclResult_t r = enter("ncclCommGetAsyncError", comm)) return r;
    if (!async) return error(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
    std::lock_guard<std::mutex> lock(m);
    if (comm->pending) {
        comm->pending -= comm->pending > 0;
        *async = ncclInProgress;
        return ncclSuccess;
    }
    *async = comm->async;
    if (comm->async) error(comm->async, "%s", comm->async_msg.c_str());
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
    tally("ncclGroupStart");
    depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    tally("ncclGroupEnd");
    if (!depth) return error(ncclInvalidUsage, "ncclGroupEnd: not in a group call");
    if (--depth) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(queued);
    const ncclResult_t r = group_error;
    group_error = ncclSuccess;
    if (r) return r;  // a failed call dropped the group; the last error says why
    ncclResult_t done = run_p2p(ops);
    for (const Op &o : ops)  // each non-blocking communicator of the group is in progress
        if (o.comm->nonblocking && !o.comm->pending && progress(o.comm, done) == ncclInProgress)
            done = ncclInProgress;
    return done;
}

static ncclResult_t p2p(const char *call, bool send, void *buf, size_t count,
                        ncclDataType_t type, int peer, ncclComm_t comm) {
    if (ncclResult_t r = enter_work(call, comm)) return r;
    if (!type_size(type)) return error(ncclInvalidArgument, "%s: invalid datatype %d", call, type);
    if (peer < 0 || peer >= comm->clique->size)
        return error(ncclInvalidArgument, "%s: peer %d is not a rank of this %d-rank communicator",
                     call, peer, comm->clique->size);
    if (!buf && count) return error(ncclInvalidArgument, "%s: buffer is NULL", call);
    const Op o = {send, comm, peer, buf, count * type_size(type)};
    if (!depth) return progress(comm, run_p2p({o}));
    queued.push_back(o);
    return ncclSuccess;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    uly_emu_record_op("ncclSend", stream);
    if (ncclResult_t r = on_stream("ncclSend", comm, stream)) return grouped(r);
    return grouped(p2p("ncclSend", true, const_cast<void *>(buf), count, type, peer, comm));
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    uly_emu_record_op("ncclRecv", stream);
    if (ncclResult_t r = on_stream("ncclRecv", comm, stream)) return grouped(r);
    return grouped(p2p("ncclRecv", false, buf, count, type, peer, comm));
}

#ifndef ULY_EMU_NCCL_2_27
ncclResult_t ncclAlltoAll(const void *send, void *recv, size_t count, ncclDataType_t type,
                          ncclComm_t comm, cudaStream_t stream) {
    uly_emu_record_op("ncclAlltoAll", stream);
    if (ncclResult_t r = enter_work("ncclAlltoAll", comm)) return r;
    outside_group("ncclAlltoAll");
    if (!type_size(type))
        return error(ncclInvalidArgument, "ncclAlltoAll: invalid datatype %d", type);
    if (count && (!send || !recv))
        return error(ncclInvalidArgument, "ncclAlltoAll: a buffer is NULL");
    if (ncclResult_t r = on_stream("ncclAlltoAll", comm, stream)) return r;
    return late(comm, stream,
                progress(comm, collective(comm, Arg{"ncclAlltoAll", send, recv, count, type, 0,
                                                    0, nullptr}, all_to_all)));
}
#endif

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    uly_emu_record_op("ncclAllReduce", stream);
    if (ncclResult_t r = enter_work("ncclAllReduce", comm)) return r;
    outside_group("ncclAllReduce");
    if (type != ncclFloat64 || op != ncclSum)
        fatal("ncclAllReduce: only ncclSum of ncclFloat64 is modeled (tests/emu/nccl_emu.cpp)");
    if (count && (!send || !recv))
        return error(ncclInvalidArgument, "ncclAllReduce: a buffer is NULL");
    if (ncclResult_t r = on_stream("ncclAllReduce", comm, stream)) return r;
    return late(comm, stream,
                progress(comm, collective(comm, Arg{"ncclAllReduce", send, recv, count, type, 0,
                                                    0, nullptr}, all_reduce)));
}

// =============================================================================================
// Test hooks (nccl_emu.h)

void uly_emu_nccl_fail(ncclComm_t comm, const char *call, ncclResult_t r, const char *msg) {
    if (call_index(call) < call_index(kFirstFaultable))
        fatal("uly_emu_nccl_fail: %s serves no communicator's faults (%s and later do)", call,
              kFirstFaultable);
    std::lock_guard<std::mutex> lock(m);
    comm->faults.push_back(Fault{call, r, msg});
}

void uly_emu_nccl_async_error(ncclComm_t comm, ncclResult_t r, const char *msg) {
    std::lock_guard<std::mutex> lock(m);
    comm->async = r;
    comm->async_msg = msg;
}

void uly_emu_nccl_stall(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(m);
    comm->stalls = true;
}

void uly_emu_nccl_late(ncclComm_t comm, long ms) {
    std::lock_guard<std::mutex> lock(m);
    comm->late_ms = ms;
}

bool uly_emu_nccl_aborted(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(m);
    return comm->gone && !strcmp(comm->gone, "ncclCommAbort");
}

unsigned long long uly_emu_nccl_calls(const char *call) {
    std::lock_guard<std::mutex> lock(m);
    return counts[call_index(call)];
}
