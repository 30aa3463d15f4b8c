// cuda_emu.cpp: fibers, the block scheduler, warp operations and the CUDA runtime subset behind
// cuda_emu.h. Sections: context switch, state, failure reports, scheduling, barriers and warp
// operations, tensor-core and async-copy instructions, blocks and grids, streams, runtime API.
#include "cuda_emu.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ULY__ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ULY__ASAN 1
#endif
#endif
#ifdef ULY__ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
// ULY_EMU_TSAN: this file is built without -fsanitize=thread (its bookkeeping is shared by the
// fibers of a block by design) and linked into a program whose kernels are built with it.
#ifdef ULY_EMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_read_range(void *addr, unsigned long size);
extern "C" void __tsan_write_range(void *addr, unsigned long size);
#endif

namespace {

// =============================================================================================
// Context switch. On x86-64 a fiber's context is its stack pointer: uly__switch pushes the
// callee-saved registers, swaps stacks and pops them, so a switch costs a few nanoseconds and no
// system call. Elsewhere ucontext does the same job, slower (it saves the signal mask).

#if defined(__x86_64__) && !defined(ULY_EMU_UCONTEXT)

struct Context {
    void *sp;
};

extern "C" void uly__switch(void **save_sp, void *load_sp);
asm(R"(
    .text
    .p2align 4
    .type uly__switch, @function
uly__switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size uly__switch, .-uly__switch
)");

// Lays out the top of a fresh stack as uly__switch leaves a suspended one, so the first switch
// "returns" into entry with the stack aligned as after a call; the zero return address above it
// ends backtraces in gdb.
void ctx_init(Context *c, char *stack, size_t size, void (*entry)()) {
    auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
    void **sp = reinterpret_cast<void **>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void *>(entry);
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    c->sp = sp;
}

void ctx_switch(Context *from, Context *to) { uly__switch(&from->sp, to->sp); }

#else

}  // namespace
#include <ucontext.h>
namespace {

struct Context {
    ucontext_t uc;
};

void ctx_init(Context *c, char *stack, size_t size, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}

void ctx_switch(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }

#endif

// =============================================================================================
// State. A Worker is one OS thread of the pool with the fibers, stacks and shared-memory arena
// it reuses from block to block; the block it runs is part of it.

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kSmemPerBlock = 227 * 1024;  // H100: opt-in maximum of dynamic shared memory
constexpr size_t kSmemDefault = 48 * 1024;    // usable without cudaFuncSetAttribute
constexpr unsigned long long kPoison = ~0ull;  // all ones: NaN as float, bf16 and half

enum { OP_MMA = 100, OP_LDMATRIX };

enum class State : unsigned char { ready, running, barrier, warp, exited };

// What a lane brought to a warp rendezvous and what it takes back. Lanes of a warp share an OS
// thread, so the lane that completes the operation reads and writes the others' operands in
// place (their stack frames stay alive while they wait).
struct WarpOp {
    int op;
    unsigned mask;
    const char *file;  // call site for CUDA intrinsics ...
    int line;
    const void *pc;    // ... or the return address for PTX wrappers
    unsigned long long value;
    int b, c;
    const void *in[3];
    void *out;
    unsigned long long result;
};

struct Copy {  // one pending cp.async
    uint32_t dst;
    const void *src;
    int bytes, src_bytes;
};

struct Fiber {
    Context ctx;
    void *tsan;         // the fiber's ThreadSanitizer context (ULY_EMU_TSAN)
    char *stack;        // usable stack, above a guard page
    bool dirty;         // abandoned mid-kernel by a failed block: reset ASan's shadow on reuse
    void *fake_stack;   // ASan's fake stack while switched out
    unsigned id, lane, warp;
    uint3 idx;
    State state;
    const char *file;   // the __syncthreads it waits at
    int line;
    WarpOp op;
    std::vector<Copy> copies;       // issued cp.async, oldest first
    std::vector<size_t> group_end;  // committed groups: end index into copies
    size_t copies_done;
};

struct Warp {
    unsigned present;  // lanes that exist (a block need not be a multiple of 32 threads)
    unsigned waiting;  // lanes suspended in a warp operation
    unsigned exited;
};

struct Grid;

struct Worker {
    Worker();
    ~Worker();
    std::vector<Fiber> fibers;
    size_t stack_size = 0;
    Context sched;  // the OS thread's own stack, where blocks start and end
    void *sched_tsan = nullptr;
    void *sched_fake = nullptr;
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
    unsigned char *smem = nullptr;  // dynamic shared memory arena
    unsigned long long switches = 0;

    // The block being run.
    Grid *grid = nullptr;
    Fiber *cur = nullptr;
    size_t smem_size = 0;
    unsigned n = 0, live = 0, exited = 0, at_bar = 0, bar_gen = 0;
    const char *bar_file = nullptr;
    int bar_line = 0;
    std::vector<unsigned> ready;  // ring of runnable fibers
    unsigned ready_head = 0, ready_count = 0;
    Warp warps[32];
    unsigned long long rng = 0;
    bool failed = false;
    // What CUDA orders, as ThreadSanitizer synchronization objects (their addresses): a block's
    // start after the launch, its threads' ends, the two most recent __syncthreads (a thread
    // cannot leave barrier g + 2 before every thread has left g), each warp's __syncwarp.
    struct {
        char start, end, bar[2], warp[32];
    } sync;
};

struct Grid {
    uly_emu_grid g;
    unsigned long long launch;
    unsigned nblocks;
    std::atomic<unsigned> next{0};
    std::atomic<bool> failed{false};
    std::mutex m;  // guards the first failure's error and report
    cudaError_t err = cudaSuccess;
    std::string report;
};

struct Config {
    unsigned long long seed;
    unsigned threads;
    size_t stack_size;
    bool abort_on_failure;
};

unsigned long long env_number(const char *name, unsigned long long fallback) {
    const char *s = getenv(name);
    return s && *s ? strtoull(s, nullptr, 0) : fallback;
}

const Config &config() {
    static const Config c = [] {
        Config k;
        k.seed = env_number("ULY_EMU_SEED", std::random_device{}());
        unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        k.threads = (unsigned)std::min<unsigned long long>(64, env_number("ULY_EMU_THREADS", hw));
        k.threads = std::max(1u, k.threads);
        // AddressSanitizer's redzones make frames several times larger.
#ifdef ULY__ASAN
        k.stack_size = env_number("ULY_EMU_STACK_KB", 1024) * 1024;
#else
        k.stack_size = env_number("ULY_EMU_STACK_KB", 256) * 1024;
#endif
        k.abort_on_failure = env_number("ULY_EMU_ABORT", 0) != 0;
        return k;
    }();
    return c;
}

// The Worker of the calling OS thread (null until it runs a block).
__thread Worker *tw;

// What a host thread's device work reports: CUDA's last error (per host thread, as in CUDA) and
// the last grid's failure report. The work runs on stream workers, which report into the state
// of the host thread that queued it. A grid's failure also stops the rest of that thread's
// queued work, as a fault ends a GPU's context, until the host takes the error
// (cudaGetLastError): the emulator's errors are not sticky, so a test goes on.
struct Host {
    std::mutex m;
    cudaError_t error = cudaSuccess;
    bool faulted = false;
    std::string failure;
};
thread_local std::shared_ptr<Host> host = std::make_shared<Host>();
// What the host thread asked of the device (uly_emu_recorded_ops, uly_emu_recorded_allocs): per
// host thread, as each rank thread models its own GPU; a few bytes a call until the next reset.
thread_local std::vector<uly_emu_op> recorded_ops;
thread_local unsigned long long recorded_allocs = 0;
// uly_emu_fail_call's: the call to fail, the calls of it still to let through, the error.
thread_local const char *fail_what = nullptr;
thread_local int fail_skip = 0;
thread_local cudaError_t fail_error = cudaSuccess;
std::atomic<bool> quiet{false};
std::atomic<unsigned long long> total_switches{0};
std::atomic<unsigned long long> ldmatrix_conflicts{0};

unsigned long long splitmix(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// A uniform integer below n from the block's generator (xorshift64*; never zero).
unsigned random_below(Worker &w, unsigned n) {
    w.rng ^= w.rng >> 12;
    w.rng ^= w.rng << 25;
    w.rng ^= w.rng >> 27;
    unsigned long long r = w.rng * 0x2545f4914f6cdd1dull;
    return (unsigned)(((r >> 32) * n) >> 32);
}

void shuffle(Worker &w, unsigned *v, unsigned n) {
    for (unsigned i = n; i > 1; i--) std::swap(v[i - 1], v[random_below(w, i)]);
}

// =============================================================================================
// ASan fiber annotations: tell the sanitizer which stack is live, so it neither reports the
// switch as a stack overflow nor mixes the fibers' fake stacks.

void asan_start(void **fake_save, const void *bottom, size_t size) {
#ifdef ULY__ASAN
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
    (void)fake_save, (void)bottom, (void)size;
#endif
}

void asan_finish(void *fake) {
#ifdef ULY__ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)fake;
#endif
}

void asan_unpoison(const void *p, size_t size) {
#ifdef ULY__ASAN
    __asan_unpoison_memory_region(p, size);
#else
    (void)p, (void)size;
#endif
}

void asan_poison(const void *p, size_t size) {
#ifdef ULY__ASAN
    __asan_poison_memory_region(p, size);
#else
    (void)p, (void)size;
#endif
}

// =============================================================================================
// ThreadSanitizer annotations (ULY_EMU_TSAN). Every CUDA thread is a TSan fiber and a switch
// between fibers orders nothing, so the only orderings TSan sees are the ones CUDA guarantees
// (Worker::sync): a shared- or global-memory access that no barrier orders against another
// thread's conflicting access is reported as a data race, whatever order the schedule ran them
// in. Reads and writes the emulator makes for a thread (ldmatrix, cp.async) are declared as that
// thread's: an ldmatrix row is read by the lane that names it, when it reaches the instruction.
// Lanes of a warp are ordered only by __syncwarp (mma, ldmatrix and shuffles order no memory).
// Blocks that run one after another on the same OS thread count as ordered (they reuse its
// shared-memory arena), so a race between two blocks shows only when they run on two threads.

// A fiber for the block's thread `id`, named as reports should name it.
void *tsan_fiber(unsigned id) {
#ifdef ULY_EMU_TSAN
    void *f = __tsan_create_fiber(0);
    char name[64];
    snprintf(name, sizeof name, "CUDA thread %u (warp %u lane %u)", id, id / 32, id % 32);
    __tsan_set_fiber_name(f, name);
    return f;
#else
    (void)id;
    return nullptr;
#endif
}

void tsan_free(void *fiber) {
#ifdef ULY_EMU_TSAN
    __tsan_destroy_fiber(fiber);
#else
    (void)fiber;
#endif
}

void *tsan_current() {
#ifdef ULY_EMU_TSAN
    return __tsan_get_current_fiber();
#else
    return nullptr;
#endif
}

void tsan_switch(void *fiber) {
#ifdef ULY_EMU_TSAN
    __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync);
#else
    (void)fiber;
#endif
}

void tsan_release(char *sync) {
#ifdef ULY_EMU_TSAN
    __tsan_release(sync);
#else
    (void)sync;
#endif
}

// Releases `sync` as `fiber` from the scheduler's stack: for the threads a failed block
// abandoned, so that what they did comes before the next block on the same arena.
void tsan_release_as(void *fiber, void *self, char *sync) {
    tsan_switch(fiber);
    tsan_release(sync);
    tsan_switch(self);
}

void tsan_acquire(char *sync) {
#ifdef ULY_EMU_TSAN
    __tsan_acquire(sync);
#else
    (void)sync;
#endif
}

void tsan_read(const void *p, size_t size) {
#ifdef ULY_EMU_TSAN
    __tsan_read_range(const_cast<void *>(p), size);
#else
    (void)p, (void)size;
#endif
}

void tsan_write(void *p, size_t size) {
#ifdef ULY_EMU_TSAN
    __tsan_write_range(p, size);
#else
    (void)p, (void)size;
#endif
}

// =============================================================================================
// Failure reports. The first failure of a launch is printed with the kernel, block, threads and
// seed, becomes the launch's error, and ends the block (its fibers are abandoned).

std::string format(const char *fmt, va_list ap) {
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    return buf;
}

std::string strprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = format(fmt, ap);
    va_end(ap);
    return s;
}

// "0-31,64,66-70"
std::string ranges(const std::vector<unsigned> &ids) {
    std::string s;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) j++;
        if (!s.empty()) s += ",";
        s += j == i ? strprintf("%u", ids[i]) : strprintf("%u-%u", ids[i], ids[j]);
        i = j + 1;
    }
    return s;
}

// A code address as module+offset, which addr2line resolves to a source line.
std::string code_address(const void *pc) {
    Dl_info info;
    if (dladdr(pc, &info) && info.dli_fname)
        return strprintf("%s+0x%lx", info.dli_fname,
                         (unsigned long)((const char *)pc - (const char *)info.dli_fbase));
    return strprintf("%p", pc);
}

const char *op_name(int op) {
    switch (op) {
    case ULY_EMU_SHFL_IDX: return "__shfl_sync";
    case ULY_EMU_SHFL_UP: return "__shfl_up_sync";
    case ULY_EMU_SHFL_DOWN: return "__shfl_down_sync";
    case ULY_EMU_SHFL_BFLY: return "__shfl_xor_sync";
    case ULY_EMU_VOTE: return "a vote (__ballot_sync/__any_sync/__all_sync)";
    case ULY_EMU_SYNCWARP: return "__syncwarp";
    case OP_MMA: return "mma.sync";
    case OP_LDMATRIX: return "ldmatrix";
    }
    return "?";
}

std::string op_site(const WarpOp &o) {
    return o.file ? strprintf("%s:%d", o.file, o.line) : "pc " + code_address(o.pc);
}

std::string describe(const Fiber &f) {
    switch (f.state) {
    case State::ready:
    case State::running: return "not waiting yet";
    case State::exited: return "exited";
    case State::barrier: return strprintf("wait at __syncthreads (%s:%d)", f.file, f.line);
    case State::warp:
        return strprintf("wait in %s, member mask 0x%08x (%s)", op_name(f.op.op), f.op.mask,
                         op_site(f.op).c_str());
    }
    return "?";
}

// One line per distinct state, with the threads in it.
std::string thread_states(const Worker &w) {
    std::vector<std::pair<std::string, std::vector<unsigned>>> groups;
    for (unsigned i = 0; i < w.n; i++) {
        std::string d = describe(w.fibers[i]);
        auto g = std::find_if(groups.begin(), groups.end(), [&](auto &x) { return x.first == d; });
        if (g == groups.end()) g = groups.insert(groups.end(), {d, {}});
        g->second.push_back(i);
    }
    std::string s;
    for (auto &g : groups)
        s += (g.second.size() == 1 ? "  thread " : "  threads ") + ranges(g.second) + ": " +
             g.first + "\n";
    return s;
}

void switch_to(Worker &w, Fiber *from, Fiber *to, bool from_dies);

[[noreturn]] void outside_kernel(const char *what) {
    fprintf(stderr, "cuda_emu: %s called outside a kernel launched with ULY_LAUNCH\n", what);
    abort();
}

Fiber *current(Worker *w, const char *what) {
    if (!w || !w->cur) outside_kernel(what);
    return w->cur;
}

void record_failure(Worker &w, cudaError_t err, const std::string &msg) {
    Grid &g = *w.grid;
    std::lock_guard<std::mutex> lock(g.m);
    if (g.failed.exchange(true)) return;  // a launch reports its first failure only
    g.err = err;
    g.report = msg + strprintf("cuda_emu: seed %llu (ULY_EMU_SEED=%llu replays it)\n",
                               config().seed, config().seed);
    if (!quiet) fputs(g.report.c_str(), stderr);
}

// Fails the running block. Called on a fiber, it abandons the fiber for the scheduler and does
// not return, so nothing on the fiber's stack may own memory then: the report is built and
// freed in its own scope, and callers pass plain C strings (see Name).
void fail(Worker &w, cudaError_t err, bool list_threads, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void fail(Worker &w, cudaError_t err, bool list_threads, const char *fmt, ...) {
    {
        va_list ap;
        va_start(ap, fmt);
        std::string what = format(fmt, ap);
        va_end(ap);
        const uint3 b = blockIdx;
        std::string msg = strprintf("cuda_emu: kernel %s, block (%u,%u,%u): %s\n",
                                    w.grid->g.name, b.x, b.y, b.z, what.c_str());
        if (list_threads) msg += "  (threads by linear index in the block)\n" + thread_states(w);
        record_failure(w, err, msg);
    }
    w.failed = true;
    if (config().abort_on_failure) abort();
    if (w.cur) switch_to(w, w.cur, nullptr, true);
}

// A thread's name for reports, in a buffer that needs no freeing.
struct Name {
    char s[96];
    const char *c_str() const { return s; }
};

Name who(const Fiber &f) {
    Name n;
    snprintf(n.s, sizeof n.s, "thread %u (%u,%u,%u), warp %u lane %u", f.id, f.idx.x, f.idx.y,
             f.idx.z, f.warp, f.lane);
    return n;
}

// =============================================================================================
// Scheduling. Runnable fibers wait in a ring; a fiber that must wait switches straight to the
// next runnable one, or to the scheduler when there is none (the block is done or stuck).

void push_ready(Worker &w, unsigned id) {
    unsigned slot = w.ready_head + w.ready_count++;
    w.ready[slot >= w.n ? slot - w.n : slot] = id;
    w.fibers[id].state = State::ready;
}

Fiber *pop_ready(Worker &w) {
    if (!w.ready_count) return nullptr;
    Fiber *f = &w.fibers[w.ready[w.ready_head]];
    if (++w.ready_head == w.n) w.ready_head = 0;
    w.ready_count--;
    return f;
}

const void *stack_bottom(Worker &w, Fiber *f) { return f ? f->stack : w.sched_bottom; }
size_t stack_size(Worker &w, Fiber *f) { return f ? w.stack_size : w.sched_size; }

// Switches from one fiber (nullptr: the scheduler) to another; returns when `from` is resumed.
// A fiber that will never resume (exited or abandoned) gives up its ASan fake stack.
void switch_to(Worker &w, Fiber *from, Fiber *to, bool from_dies) {
    w.cur = to;
    if (to) {
        to->state = State::running;
        threadIdx = to->idx;
    }
    w.switches++;
    void **fake = from_dies ? nullptr : from ? &from->fake_stack : &w.sched_fake;
    asan_start(fake, stack_bottom(w, to), stack_size(w, to));
    tsan_switch(to ? to->tsan : w.sched_tsan);
    ctx_switch(from ? &from->ctx : &w.sched, to ? &to->ctx : &w.sched);
    asan_finish(from ? from->fake_stack : w.sched_fake);
}

// The running fiber has to wait: run the next runnable fiber, which may be itself.
void wait(Worker &w, Fiber *self) {
    Fiber *next = pop_ready(w);
    if (next == self) {
        self->state = State::running;
        return;
    }
    switch_to(w, self, next, false);
}

// Makes the lanes in `lanes` runnable, in random order.
void wake(Worker &w, unsigned warp, unsigned lanes) {
    unsigned ids[32], k = 0;
    for (; lanes; lanes &= lanes - 1) ids[k++] = warp * 32 + __builtin_ctz(lanes);
    shuffle(w, ids, k);
    for (unsigned i = 0; i < k; i++) push_ready(w, ids[i]);
}

void thread_exits(Worker &w, Fiber *self) {
    self->state = State::exited;
    w.live--;
    w.exited++;
    Warp &wp = w.warps[self->warp];
    wp.exited |= 1u << self->lane;
    if (w.at_bar)
        fail(w, cudaErrorLaunchFailure, true,
             "%s exited while other threads wait at __syncthreads (%s:%d); a barrier must be "
             "reached by every thread of the block",
             who(*self).c_str(), w.bar_file, w.bar_line);
    for (unsigned l = wp.waiting; l; l &= l - 1) {
        const Fiber &f = w.fibers[self->warp * 32 + __builtin_ctz(l)];
        if (f.op.mask & (1u << self->lane))
            fail(w, cudaErrorLaunchFailure, true,
                 "%s exited while lanes that name it in their member mask wait in %s",
                 who(*self).c_str(), op_name(f.op.op));
    }
}

void fiber_main() {
    Worker &w = *tw;
    asan_finish(nullptr);
    Fiber *self = w.cur;
    tsan_acquire(&w.sync.start);
    w.grid->g.call();
    tsan_release(&w.sync.end);
    thread_exits(w, self);
    switch_to(w, self, pop_ready(w), true);
    abort();  // an exited fiber is never resumed
}

// =============================================================================================
// Barriers and warp operations.

bool same_site(const char *f1, int l1, const char *f2, int l2) {
    return l1 == l2 && (f1 == f2 || strcmp(f1, f2) == 0);
}

void release_barrier(Worker &w) {
    w.at_bar = 0;
    w.bar_gen++;
    unsigned k = 0;
    for (unsigned i = 0; i < w.n; i++)
        if (w.fibers[i].state == State::barrier) w.ready[k++] = i;
    shuffle(w, w.ready.data(), k);
    w.ready_head = 0;
    w.ready_count = k;
    for (unsigned i = 0; i < k; i++) w.fibers[w.ready[i]].state = State::ready;
}

// The lane a shuffle reads, as the PTX ISA defines shfl.sync: c holds the segment mask (bits
// 12:8) and the clamp (bits 4:0); a source past the clamp means the lane's own value.
unsigned shfl_source(int op, unsigned lane, int b, int c) {
    const int bval = b & 31, cval = c & 31, seg = (c >> 8) & 31;
    const int max_lane = ((int)lane & seg) | (cval & ~seg);
    const int min_lane = (int)lane & seg;
    int j;
    bool valid;
    switch (op) {
    case ULY_EMU_SHFL_UP: j = (int)lane - bval; valid = j >= max_lane; break;
    case ULY_EMU_SHFL_DOWN: j = (int)lane + bval; valid = j <= max_lane; break;
    case ULY_EMU_SHFL_BFLY: j = (int)lane ^ bval; valid = j <= max_lane; break;
    default: j = min_lane | (bval & ~seg); valid = j <= max_lane; break;
    }
    return valid ? (unsigned)j : lane;
}

Fiber *lanes_of(Worker &w, unsigned warp) { return &w.fibers[warp * 32]; }

void complete_shfl(Worker &w, unsigned warp, unsigned mask) {
    Fiber *lane = lanes_of(w, warp);
    for (unsigned m = mask; m; m &= m - 1) {
        unsigned i = __builtin_ctz(m);
        unsigned j = shfl_source(lane[i].op.op, i, lane[i].op.b, lane[i].op.c);
        // Reading a lane outside the member mask is undefined: hand back poison.
        lane[i].op.result = (mask >> j) & 1 ? lane[j].op.value : kPoison;
    }
}

void complete_vote(Worker &w, unsigned warp, unsigned mask) {
    Fiber *lane = lanes_of(w, warp);
    unsigned ballot = 0;
    for (unsigned m = mask; m; m &= m - 1)
        ballot |= (unsigned)(lane[__builtin_ctz(m)].op.value & 1) << __builtin_ctz(m);
    for (unsigned m = mask; m; m &= m - 1) lane[__builtin_ctz(m)].op.result = ballot;
}

// The tensor-core completions move registers (the lanes' operands) and rows of shared memory
// whose bounds they check themselves: nothing there for ASan or UBSan, under which they took
// half of an emulated flash test's time.
#define UNCHECKED __attribute__((no_sanitize("address", "undefined")))

// mma's operands as numbers: bf16 is the top half of a float's bits, fp16 goes through a table
// of its 65536 values (an mma converts 384 operands).
struct HalfTable {
    float value[65536];
    HalfTable() {
        for (unsigned i = 0; i < 65536; i++) {
            __half_raw r;
            r.x = (unsigned short)i;
            value[i] = __half2float(__half(r));
        }
    }
};
const HalfTable kHalf;

UNCHECKED double operand(uint16_t h, int type) {
    if (type != ULY_EMU_BF16) return kHalf.value[h];
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// D = A*B + C for mma.m16n8k16.row.col.f32, with the fragment layouts of the PTX ISA
// (groupID = lane / 4, threadID_in_group = lane % 4). The products are exact; they are summed
// with C in double, in order of k, and rounded once to float. Hardware rounds its own way in the
// last bits.
UNCHECKED void complete_mma(Worker &w, unsigned warp) {
    Fiber *lane = lanes_of(w, warp);
    const int k = 16, type = lane[0].op.c;
    double A[16][16], B[16][8];
    float D[16][8];  // C, then the result
    for (unsigned t = 0; t < 32; t++) {
        const uint32_t *a = static_cast<const uint32_t *>(lane[t].op.in[0]);
        const uint32_t *b = static_cast<const uint32_t *>(lane[t].op.in[1]);
        const float *c = static_cast<const float *>(lane[t].op.in[2]);
        unsigned g = t / 4, q = t % 4;
        for (int r = 0; r < k / 4; r++) {  // a register holds 2 elements along a row of A
            unsigned row = g + 8 * (r & 1), col = 2 * q + 8 * (r >> 1);
            A[row][col] = operand(a[r] & 0xffff, type);
            A[row][col + 1] = operand(a[r] >> 16, type);
        }
        for (int r = 0; r < k / 8; r++) {  // ... and 2 elements along a column of B
            unsigned row = 2 * q + 8 * r;
            B[row][g] = operand(b[r] & 0xffff, type);
            B[row + 1][g] = operand(b[r] >> 16, type);
        }
        for (int i = 0; i < 4; i++) D[g + 8 * (i >> 1)][2 * q + (i & 1)] = c[i];
    }
    // Each output adds its products in order of k; the loop runs along n so the 8 sums of a
    // row advance together (independent, vectorizable) instead of one long dependency chain.
    for (int m = 0; m < 16; m++) {
        double row[8];
        for (int n = 0; n < 8; n++) row[n] = D[m][n];
        for (int i = 0; i < k; i++)
            for (int n = 0; n < 8; n++) row[n] += A[m][i] * B[i][n];
        for (int n = 0; n < 8; n++) D[m][n] = (float)row[n];
    }
    for (unsigned t = 0; t < 32; t++) {  // after all reads: d may alias c
        float *d = static_cast<float *>(lane[t].op.out);
        for (int i = 0; i < 4; i++) d[i] = D[t / 4 + 8 * (i >> 1)][2 * (t % 4) + (i & 1)];
    }
}

UNCHECKED uint16_t load16(const unsigned char *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// The extra wavefronts of one ldmatrix matrix whose row addresses lanes r[0..7] give: the most
// distinct addresses in one 16-byte bank group, less one (a repeated address is a broadcast).
int bank_conflicts(const Fiber *r) {
    uint32_t seen[8];
    int n = 0, in_group[8] = {0};
    for (int a = 0; a < 8; a++) {
        const uint32_t x = (uint32_t)r[a].op.value;
        if (std::find(seen, seen + n, x) != seen + n) continue;
        seen[n++] = x;
        in_group[x / 16 % 8]++;
    }
    return *std::max_element(in_group, in_group + 8) - 1;
}

// ldmatrix.m8n8.b16: lane 8*i + r gives the address of row r of matrix i; lane t receives, of
// each matrix, row t/4, elements 2*(t%4) and 2*(t%4)+1 (with .trans: of the transposed matrix).
UNCHECKED void complete_ldmatrix(Worker &w, unsigned warp) {
    Fiber *lane = lanes_of(w, warp);
    const int n = lane[0].op.b;
    const bool trans = lane[0].op.c != 0;
    const unsigned char *rows[4][8];
    for (int l = 0; l < 8 * n; l++) {
        uint32_t addr = (uint32_t)lane[l].op.value;
        if (addr % 16)
            fail(w, cudaErrorMisalignedAddress, false,
                 "ldmatrix: %s gives row address 0x%x, not 16-byte aligned",
                 who(lane[l]).c_str(), addr);
        if ((size_t)addr + 16 > w.smem_size)
            fail(w, cudaErrorIllegalAddress, false,
                 "ldmatrix: %s gives row address 0x%x, row ends past the %zu bytes of dynamic "
                 "shared memory",
                 who(lane[l]).c_str(), addr, w.smem_size);
        rows[l / 8][l % 8] = w.smem + addr;
    }
    for (int i = 0; i < n; i++) ldmatrix_conflicts += bank_conflicts(&lane[8 * i]);
    for (unsigned t = 0; t < 32; t++) {
        uint32_t *r = static_cast<uint32_t *>(lane[t].op.out);
        for (int i = 0; i < n; i++) {
            uint16_t lo, hi;
            if (trans) {
                lo = load16(rows[i][2 * (t % 4)] + 2 * (t / 4));
                hi = load16(rows[i][2 * (t % 4) + 1] + 2 * (t / 4));
            } else {
                lo = load16(rows[i][t / 4] + 4 * (t % 4));
                hi = load16(rows[i][t / 4] + 4 * (t % 4) + 2);
            }
            r[i] = (uint32_t)lo | (uint32_t)hi << 16;
        }
    }
}

void complete(Worker &w, unsigned warp, int op, unsigned mask) {
    switch (op) {
    case ULY_EMU_VOTE: complete_vote(w, warp, mask); break;
    case ULY_EMU_SYNCWARP: break;
    case OP_MMA: complete_mma(w, warp); break;
    case OP_LDMATRIX: complete_ldmatrix(w, warp); break;
    default: complete_shfl(w, warp, mask); break;
    }
}

// Lanes meet when all of the member mask wait in the same operation with the same mask;
// the .aligned instructions (mma, ldmatrix) must also be the same instruction.
bool all_met(Worker &w, const Fiber &self) {
    const Warp &wp = w.warps[self.warp];
    const WarpOp &o = self.op;
    if ((wp.waiting & o.mask) != o.mask) return false;
    const bool aligned = o.op == OP_MMA || o.op == OP_LDMATRIX;
    Fiber *lane = lanes_of(w, self.warp);
    for (unsigned m = o.mask; m; m &= m - 1) {
        const WarpOp &p = lane[__builtin_ctz(m)].op;
        if (p.op != o.op || p.mask != o.mask) return false;
        if (aligned && (p.pc != o.pc || p.b != o.b || p.c != o.c)) return false;
    }
    return true;
}

void check_mask(Worker &w, const Fiber &self) {
    const Warp &wp = w.warps[self.warp];
    const unsigned mask = self.op.mask;
    const char *name = op_name(self.op.op);
    if (!(mask >> self.lane & 1))
        fail(w, cudaErrorLaunchFailure, false, "%s: %s is not in its own member mask 0x%08x",
             name, who(self).c_str(), mask);
    if (mask & ~wp.present)
        fail(w, cudaErrorLaunchFailure, false,
             "%s: member mask 0x%08x of %s names lanes 0x%08x that do not exist (block of %u "
             "threads)",
             name, mask, who(self).c_str(), mask & ~wp.present, w.n);
    if (mask & wp.exited)
        fail(w, cudaErrorLaunchFailure, true,
             "%s: member mask 0x%08x of %s names lanes 0x%08x that have exited", name, mask,
             who(self).c_str(), mask & wp.exited);
}

// The per-warp rendezvous: the last lane to arrive computes every lane's result and goes on;
// the others wait, and only they (the rest of the block keeps running).
void meet(Worker &w, Fiber *self) {
    check_mask(w, *self);
    Warp &wp = w.warps[self->warp];
    self->state = State::warp;
    wp.waiting |= 1u << self->lane;
    if (!all_met(w, *self)) {
        wait(w, self);
        return;
    }
    const unsigned mask = self->op.mask;
    complete(w, self->warp, self->op.op, mask);
    wp.waiting &= ~mask;
    self->state = State::running;
    wake(w, self->warp, mask & ~(1u << self->lane));
}

WarpOp &new_op(Fiber *self, int op, unsigned mask) {
    WarpOp &o = self->op;
    o = WarpOp{};
    o.op = op;
    o.mask = mask;
    return o;
}

// The .aligned instructions need the whole warp.
void check_full_warp(Worker &w, const Fiber &self, const char *name) {
    if (w.warps[self.warp].present != kFullMask)
        fail(w, cudaErrorLaunchFailure, false,
             "%s needs all 32 lanes of a warp, but warp %u of a block of %u threads is partial",
             name, self.warp, w.n);
}

// =============================================================================================
// Blocks and grids.

size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }

// Stacks are mapped once per fiber and reused; the page below each is a guard page, so a
// stack overflow faults instead of corrupting a neighbour.
char *map_stack(size_t size) {
    size_t guard = page_size();
    void *p = mmap(nullptr, size + guard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        perror("cuda_emu: mmap of a fiber stack");
        abort();
    }
    mprotect(p, guard, PROT_NONE);
    return static_cast<char *>(p) + guard;
}

void thread_stack_bounds(const void **bottom, size_t *size) {
    pthread_attr_t attr;
    void *addr = nullptr;
    size_t sz = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        pthread_attr_getstack(&attr, &addr, &sz);
        pthread_attr_destroy(&attr);
    }
    *bottom = addr;
    *size = sz;
}

Worker::Worker() {
    stack_size = config().stack_size;
    void *p = mmap(nullptr, kSmemPerBlock, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) {
        perror("cuda_emu: mmap of shared memory");
        abort();
    }
    smem = static_cast<unsigned char *>(p);
}

Worker::~Worker() {
    for (Fiber &f : fibers) {
        munmap(f.stack - page_size(), stack_size + page_size());
        tsan_free(f.tsan);
    }
    asan_unpoison(smem, kSmemPerBlock);
    munmap(smem, kSmemPerBlock);
}

// Host threads come and go (the local communicator runs a thread per rank): a thread's Worker
// goes back to `spare` when it exits, and the next new thread takes it, stacks and all.
std::mutex spare_m;
std::vector<std::unique_ptr<Worker>> spare;

// A fiber that overflows its stack faults on the guard page; without ASan (which reports stack
// overflows itself) this handler, on a stack of its own, says so before the crash.
constexpr size_t kAltStack = 64 * 1024;

#ifndef ULY__ASAN
void on_segv(int sig, siginfo_t *info, void *) {
    const Worker *w = tw;
    const char *a = static_cast<const char *>(info->si_addr);
    if (w && w->cur && a < w->cur->stack && a >= w->cur->stack - page_size()) {
        static const char msg[] =
            "cuda_emu: a CUDA thread overflowed its fiber stack; set ULY_EMU_STACK_KB higher\n";
        ssize_t ignored = write(2, msg, sizeof msg - 1);
        (void)ignored;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}
#endif

void catch_stack_overflow(void *altstack) {
#ifdef ULY__ASAN
    (void)altstack;
#else
    stack_t ss{};
    ss.ss_sp = altstack;
    ss.ss_size = kAltStack;
    sigaltstack(&ss, nullptr);
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa {};
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigaction(SIGSEGV, &sa, nullptr);
    });
#endif
}

// Owns the calling thread's Worker and the stack its signal handler runs on.
struct WorkerOwner {
    std::unique_ptr<Worker> w;
    std::unique_ptr<char[]> altstack;
    ~WorkerOwner() {
        if (!w) return;
        stack_t off{};
        off.ss_flags = SS_DISABLE;
        sigaltstack(&off, nullptr);
        tw = nullptr;
        std::lock_guard<std::mutex> lock(spare_m);
        spare.push_back(std::move(w));
    }
};
thread_local WorkerOwner owner;

Worker &worker() {
    if (tw) return *tw;
    {
        std::lock_guard<std::mutex> lock(spare_m);
        if (!spare.empty()) {
            owner.w = std::move(spare.back());
            spare.pop_back();
        }
    }
    if (!owner.w) owner.w = std::make_unique<Worker>();
    owner.altstack.reset(new char[kAltStack]);
    catch_stack_overflow(owner.altstack.get());
    tw = owner.w.get();
    thread_stack_bounds(&tw->sched_bottom, &tw->sched_size);
    return *tw;
}

void ensure_fibers(Worker &w, unsigned n) {
    while (w.fibers.size() < n) {
        w.fibers.emplace_back();
        Fiber &f = w.fibers.back();
        f.stack = map_stack(w.stack_size);
        f.dirty = false;
        f.fake_stack = nullptr;
        f.tsan = tsan_fiber((unsigned)w.fibers.size() - 1);
    }
    w.ready.resize(std::max<size_t>(w.ready.size(), n));
}

void init_fiber(Worker &w, Fiber &f, unsigned id, const dim3 &bd) {
    if (f.dirty) asan_unpoison(f.stack, w.stack_size);
    f.dirty = false;
    f.id = id;
    f.lane = id % 32;
    f.warp = id / 32;
    f.idx = uint3{id % bd.x, id / bd.x % bd.y, id / (bd.x * bd.y)};
    f.state = State::ready;
    f.op = WarpOp{};
    f.copies.clear();
    f.group_end.clear();
    f.copies_done = 0;
    ctx_init(&f.ctx, f.stack, w.stack_size, fiber_main);
}

void init_block(Worker &w, Grid &grid, unsigned block) {
    const uly_emu_grid &g = grid.g;
    w.grid = &grid;
    blockIdx = uint3{block % g.grid.x, block / g.grid.x % g.grid.y,
                     block / (g.grid.x * g.grid.y)};
    blockDim = g.block;
    gridDim = g.grid;
    w.n = g.block.x * g.block.y * g.block.z;
    ensure_fibers(w, w.n);
    for (unsigned i = 0; i < w.n; i++) init_fiber(w, w.fibers[i], i, g.block);
    for (unsigned i = 0; i < 32; i++) {
        unsigned first = i * 32;
        w.warps[i].present = first >= w.n ? 0 : w.n - first >= 32 ? kFullMask
                                                                  : (1u << (w.n - first)) - 1;
        w.warps[i].waiting = w.warps[i].exited = 0;
    }
    w.live = w.n;
    w.exited = w.at_bar = 0;
    w.failed = false;
    w.rng = splitmix(splitmix(config().seed ^ grid.launch * 0x9e3779b97f4a7c15ull) + block) | 1;
    // Shared memory starts as garbage, as on a GPU; past the launch's size ASan guards it.
    w.smem_size = g.smem;
    asan_unpoison(w.smem, kSmemPerBlock);
    memset(w.smem, 0xff, g.smem);
    asan_poison(w.smem + g.smem, kSmemPerBlock - g.smem);
    for (unsigned i = 0; i < w.n; i++) w.ready[i] = i;
    shuffle(w, w.ready.data(), w.n);
    w.ready_head = 0;
    w.ready_count = w.n;
}

// A copy in flight may land at any time before the wait that completes it, so a store to its
// destination in between races with it (on a GPU the copy may land after the store, as when the
// wait before a tile's reuse is missing): its bytes must still hold the issue's poison, which
// only a store or another copy landing there changes. when: "completing it", or "at the end
// of the block" for the copies never waited for.
void check_in_flight(Worker &w, const Fiber &f, const Copy &c, const char *when) {
    const unsigned char *d = w.smem + c.dst;
    if (std::all_of(d, d + c.bytes, [](unsigned char x) { return x == 0xff; })) return;
    fail(w, cudaErrorLaunchFailure, false,
         "cp.async: shared 0x%x..0x%x, where a copy by %s is in flight, was written before a "
         "wait completed the copy (found %s): the copy may land after that store",
         c.dst, c.dst + c.bytes, who(f).c_str(), when);
}

void run_block(Worker &w, Grid &grid, unsigned block) {
    init_block(w, grid, block);
    w.sched_tsan = tsan_current();
    tsan_release(&w.sync.start);
    switch_to(w, nullptr, pop_ready(w), false);
    // Back on the scheduler: every fiber has exited, or none can go on, or the block failed.
    if (!w.failed && w.live)
        fail(w, cudaErrorLaunchFailure, true, "deadlock: no thread can continue");
    if (w.failed)
        for (unsigned i = 0; i < w.n; i++) {
            Fiber &f = w.fibers[i];
            f.dirty = f.state != State::exited;
            if (f.dirty) tsan_release_as(f.tsan, w.sched_tsan, &w.sync.end);
        }
    tsan_acquire(&w.sync.end);  // all the block did comes before the next block
    for (unsigned i = 0; i < w.n && !w.failed; i++)  // the copies never waited for
        for (size_t k = w.fibers[i].copies_done; k < w.fibers[i].copies.size() && !w.failed; k++)
            check_in_flight(w, w.fibers[i], w.fibers[i].copies[k], "at the end of the block");
    total_switches += w.switches;
    w.switches = 0;
    w.grid = nullptr;
}

void run_blocks(Grid &grid) {
    Worker &w = worker();
    for (;;) {
        if (grid.failed) return;  // like a GPU, a faulting kernel stops the whole grid
        unsigned b = grid.next++;
        if (b >= grid.nblocks) return;
        run_block(w, grid, b);
    }
}

// OS threads that run blocks alongside the launching thread.
class Pool {
public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(m_);
            quit_ = true;
        }
        wake_.notify_all();
        for (auto &t : threads_) t.join();
    }

    // Runs a grid with the pool's threads; a grid launched while another host thread holds the
    // pool runs on its own thread alone.
    void run(Grid &grid) {
        std::unique_lock<std::mutex> own(use_, std::try_to_lock);
        if (!own || std::min(config().threads, grid.nblocks) == 1) {
            run_blocks(grid);
            return;
        }
        {
            std::lock_guard<std::mutex> lock(m_);
            while (threads_.size() < config().threads - 1)
                threads_.emplace_back([this] { loop(); });
            grid_ = &grid;
            gen_++;
            busy_ = (unsigned)threads_.size();
        }
        wake_.notify_all();
        run_blocks(grid);
        std::unique_lock<std::mutex> lock(m_);
        done_.wait(lock, [&] { return busy_ == 0; });
    }

private:
    void loop() {
        unsigned long long seen = 0;
        for (;;) {
            Grid *grid;
            {
                std::unique_lock<std::mutex> lock(m_);
                wake_.wait(lock, [&] { return quit_ || gen_ != seen; });
                if (quit_) return;
                seen = gen_;
                grid = grid_;
            }
            run_blocks(*grid);
            std::lock_guard<std::mutex> lock(m_);
            if (--busy_ == 0) done_.notify_one();
        }
    }

    std::mutex use_;  // held by the launch that uses the pool
    std::mutex m_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> threads_;
    Grid *grid_ = nullptr;
    unsigned long long gen_ = 0;
    unsigned busy_ = 0;
    bool quit_ = false;
};

Pool pool;  // after `spare`: joining its threads hands their Workers back

std::mutex attr_m;
std::unordered_map<const void *, int> max_dyn_smem;  // cudaFuncSetAttribute, per kernel

void set_error(cudaError_t e) {
    std::lock_guard<std::mutex> lock(host->m);
    if (e != cudaSuccess) host->error = e;
}

cudaError_t take_error() {
    std::lock_guard<std::mutex> lock(host->m);
    cudaError_t e = host->error;
    host->error = cudaSuccess;
    host->faulted = false;
    return e;
}

// A launch configuration the device cannot run: CUDA 13's runtime answers cudaErrorInvalidValue
// (seen on an H100, CUDA 13.0, driver 580), earlier runtimes cudaErrorInvalidConfiguration.
constexpr cudaError_t kBadConfiguration =
    CUDART_VERSION >= 13000 ? cudaErrorInvalidValue : cudaErrorInvalidConfiguration;

cudaError_t check_launch(const uly_emu_grid &g) {
    const dim3 b = g.block, gr = g.grid;
    unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (threads == 0 || threads > 1024 || b.z > 64 || gr.x == 0 || gr.y == 0 || gr.z == 0 ||
        gr.x > 0x7fffffffu || gr.y > 65535 || gr.z > 65535 ||
        (unsigned long long)gr.x * gr.y * gr.z > 0xffffffffull)
        return kBadConfiguration;
    if (g.smem > kSmemDefault) {
        std::lock_guard<std::mutex> lock(attr_m);
        auto it = max_dyn_smem.find(g.fn);
        if (it == max_dyn_smem.end() || g.smem > (size_t)it->second) return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

// =============================================================================================
// Streams. A stream is a queue and a worker thread that runs the queue in order while the host
// goes on, as a GPU runs a stream: a host that reads a result before waiting for it, or a stream
// that uses another's result with no event between them, reads stale memory here too (a grid
// takes milliseconds on a CPU, so such a race is lost every time). The default stream is one such
// stream per host thread (each rank thread of tests/emu/nccl_emu.cpp models its own GPU), named
// by 0, cudaStreamLegacy and cudaStreamPerThread alike. Work named on the legacy handles (0 and
// cudaStreamLegacy) and the synchronous calls (cudaMemcpy, cudaMemset, cudaFree, ...) first wait
// for the work of every stream, then run before they return: the legacy stream's implicit
// synchronization, made strict. A stalled stream (uly_emu_stall_stream) runs nothing until it is
// released, and only what names it waits for it.

}  // namespace

struct CUstream_st {
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::function<void()>> work;
    unsigned long long queued = 0, done = 0;
    bool stalled = false, quit = false;
    std::thread worker;

    CUstream_st() : worker([this] { loop(); }) {}
    // Runs what is queued first; a stalled stream's work is dropped.
    ~CUstream_st() {
        {
            std::lock_guard<std::mutex> lock(m);
            quit = true;
        }
        cv.notify_all();
        worker.join();
    }
    void loop() {
        std::unique_lock<std::mutex> lock(m);
        for (;;) {
            cv.wait(lock, [&] { return quit || (!stalled && !work.empty()); });
            if (stalled || work.empty()) return;
            std::function<void()> f = std::move(work.front());
            work.pop_front();
            lock.unlock();
            f();
            lock.lock();
            done++;
            cv.notify_all();
        }
    }
    void push(std::function<void()> f) {
        {
            std::lock_guard<std::mutex> lock(m);
            work.push_back(std::move(f));
            queued++;
        }
        cv.notify_all();
    }
    // Waits until what was queued before the call has run; false if the stream is stalled first.
    bool drain() {
        std::unique_lock<std::mutex> lock(m);
        const unsigned long long target = queued;
        cv.wait(lock, [&] { return done >= target || stalled; });
        return done >= target;
    }
    bool idle() {
        std::lock_guard<std::mutex> lock(m);
        return !stalled && done == queued;
    }
};

namespace {

// Every live stream, for the waits of the legacy stream. Held while draining them, so none is
// destroyed meanwhile; stream workers never take it.
std::mutex streams_m;
std::vector<CUstream_st *> streams;

CUstream_st *new_stream() {
    CUstream_st *s = new CUstream_st;
    std::lock_guard<std::mutex> lock(streams_m);
    streams.push_back(s);
    return s;
}

void delete_stream(CUstream_st *s) {
    {
        std::lock_guard<std::mutex> lock(streams_m);
        streams.erase(std::find(streams.begin(), streams.end(), s));
    }
    delete s;
}

struct DefaultStream {
    CUstream_st *s = nullptr;
    ~DefaultStream() {
        if (s) delete_stream(s);
    }
};
thread_local DefaultStream default_stream;

bool legacy(cudaStream_t s) { return !s || s == cudaStreamLegacy; }

CUstream_st *stream_of(cudaStream_t s) {
    if (!legacy(s) && s != cudaStreamPerThread) return s;
    if (!default_stream.s) default_stream.s = new_stream();
    return default_stream.s;
}

// Every stream's work queued so far, but a stalled stream's.
void drain_all() {
    std::lock_guard<std::mutex> lock(streams_m);
    for (CUstream_st *s : streams) s->drain();
}

// A call that would wait for a stalled stream, which never drains: a hang on a GPU, so the
// test ends here, loudly.
void never_returns(const char *what) {
    fprintf(stderr, "cuda_emu: %s waits for a stalled stream: it would never return\n", what);
    abort();
}

// What the host waits for before it goes on: the stream's work, or on the legacy stream every
// stream's.
void wait_stream(cudaStream_t s, const char *what) {
    if (legacy(s)) drain_all();
    if (!stream_of(s)->drain()) never_returns(what);
}

// Queues f on s; on the legacy stream it runs before queue returns (unless the stream is
// stalled, and then when it is released).
void queue(cudaStream_t s, std::function<void()> f) {
    CUstream_st *q = stream_of(s);
    if (legacy(s)) {
        drain_all();
        if (q->idle()) return f();
    }
    q->push(std::move(f));
}

// Queues device work, which reports into the calling host thread's state; after a fault that
// thread's device runs no more of it.
void queue_work(cudaStream_t s, std::function<void(Host &)> fn) {
    queue(s, [h = host, fn = std::move(fn)] {
        {
            std::lock_guard<std::mutex> lock(h->m);
            if (h->faulted) return;
        }
        fn(*h);
    });
}

// An event counts the records asked for and the records its streams reached; a wait is for the
// records asked before it.
struct Event {
    std::mutex m;
    std::condition_variable cv;
    unsigned long long asked = 0, reached = 0;
    std::chrono::steady_clock::time_point t;  // when the last reached record ran

    unsigned long long last() {
        std::lock_guard<std::mutex> lock(m);
        return asked;
    }
    unsigned long long ask() {
        std::lock_guard<std::mutex> lock(m);
        return ++asked;
    }
    void reach(unsigned long long n) {
        {
            std::lock_guard<std::mutex> lock(m);
            reached = std::max(reached, n);
            t = std::chrono::steady_clock::now();
        }
        cv.notify_all();
    }
    void wait(unsigned long long n) {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return reached >= n; });
    }
    // When the last record ran; false if it has not run, or e was never recorded.
    bool reached_at(std::chrono::steady_clock::time_point *at) {
        std::lock_guard<std::mutex> lock(m);
        *at = t;
        return reached && reached == asked;
    }
};

}  // namespace

// =============================================================================================
// Entry points of cuda_emu.h.

__thread uint3 threadIdx;
__thread uint3 blockIdx;
__thread dim3 blockDim;
__thread dim3 gridDim;

void uly_emu_launch(const uly_emu_grid &g) {
    static std::once_flag announced;
    std::call_once(announced, [] {
        if (!quiet)
            fprintf(stderr, "cuda_emu: seed %llu (set ULY_EMU_SEED=%llu to replay schedules)\n",
                    config().seed, config().seed);
    });
    recorded_ops.push_back(uly_emu_op{g.name, g.fn, g.stream, g.grid});
    if (cudaError_t e = check_launch(g)) {
        set_error(e);
        return;
    }
    // Launches are numbered per host thread when queued, so concurrent host threads replay too.
    static thread_local unsigned long long launches = 0;
    const unsigned long long launch = launches++;
    queue_work(g.stream, [g, launch](Host &h) {
        Grid grid;
        grid.g = g;
        grid.launch = launch;
        grid.nblocks = g.grid.x * g.grid.y * g.grid.z;
        pool.run(grid);
        std::lock_guard<std::mutex> lock(h.m);
        h.failure = grid.report;
        if (grid.failed) h.error = grid.err, h.faulted = true;
    });
}

void uly_emu_syncthreads(const char *file, int line) {
    Fiber *self = current(tw, "__syncthreads");
    Worker &w = *tw;
    self->file = file;
    self->line = line;
    if (w.exited) {
        self->state = State::barrier;
        fail(w, cudaErrorLaunchFailure, true,
             "%s reached __syncthreads (%s:%d) after other threads of the block exited",
             who(*self).c_str(), file, line);
    }
    if (w.at_bar && !same_site(file, line, w.bar_file, w.bar_line)) {
        self->state = State::barrier;
        fail(w, cudaErrorLaunchFailure, true, "divergence: threads wait at different barriers");
    }
    if (!w.at_bar) {
        w.bar_file = file;
        w.bar_line = line;
    }
    self->state = State::barrier;
    char *sync = &w.sync.bar[w.bar_gen & 1];
    tsan_release(sync);
    if (++w.at_bar == w.live) release_barrier(w);
    wait(w, self);
    tsan_acquire(sync);
}

unsigned long long uly_emu_warp(int op, unsigned mask, unsigned long long value, int b, int c,
                                const char *file, int line) {
    Fiber *self = current(tw, op_name(op));
    WarpOp &o = new_op(self, op, mask);
    o.value = value;
    o.b = b;
    o.c = c;
    o.file = file;
    o.line = line;
    char *sync = &tw->sync.warp[self->warp];
    if (op == ULY_EMU_SYNCWARP) tsan_release(sync);
    meet(*tw, self);
    if (op == ULY_EMU_SYNCWARP) tsan_acquire(sync);
    return self->op.result;
}

unsigned char *uly_emu_dyn_smem() {
    current(tw, "ULY_DYN_SMEM");
    return tw->smem;
}

uint32_t uly_emu_lane_id() { return current(tw, "uly_lane_id")->lane; }

uint32_t uly_emu_smem_addr(const void *p) {
    Fiber *self = current(tw, "uly_smem_addr");
    Worker &w = *tw;
    auto off = (uintptr_t)p - (uintptr_t)w.smem;
    if ((uintptr_t)p < (uintptr_t)w.smem || off > w.smem_size)
        fail(w, cudaErrorIllegalAddress, false,
             "uly_smem_addr: %s converts %p, which is not in the block's %zu bytes of dynamic "
             "shared memory (static __shared__ arrays cannot feed ldmatrix or cp.async here)",
             who(*self).c_str(), p, w.smem_size);
    return (uint32_t)off;
}

void uly_emu_mma(uly_emu_type t, float *d, const uint32_t *a, const uint32_t *b,
                 const float *c) {
    Fiber *self = current(tw, "mma.sync");
    Worker &w = *tw;
    check_full_warp(w, *self, "mma.sync");
    WarpOp &o = new_op(self, OP_MMA, kFullMask);
    o.pc = __builtin_return_address(0);
    o.c = t;
    o.in[0] = a;
    o.in[1] = b;
    o.in[2] = c;
    o.out = d;
    meet(w, self);
}

namespace {

// .ftz: a subnormal becomes a zero of its sign.
float flush(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }

// p lies in the running block's shared-memory window (the dynamic arena).
bool in_shared_window(const Worker *w, const void *p) {
    return w && (uintptr_t)p - (uintptr_t)w->smem < kSmemPerBlock;
}

}  // namespace

// ex2.approx.ftz.f32: the PTX ISA allows 2 ulp of error; the emulator rounds the exact value
// once, of the flushed input, and flushes the result.
float uly_emu_ex2(float x) { return flush((float)std::exp2((double)flush(x))); }

void uly_emu_ldmatrix(int n, bool trans, uint32_t *r, uint32_t smem_addr) {
    Fiber *self = current(tw, "ldmatrix");
    Worker &w = *tw;
    check_full_warp(w, *self, "ldmatrix");
    WarpOp &o = new_op(self, OP_LDMATRIX, kFullMask);
    o.pc = __builtin_return_address(0);
    o.value = smem_addr;
    o.b = n;
    o.c = trans;
    o.out = r;
    if (self->lane < 8u * n && (size_t)smem_addr + 16 <= w.smem_size)  // else the warp fails
        tsan_read(w.smem + smem_addr, 16);
    meet(w, self);
}

// cp.async: the destination holds poison from the issue until a wait completes the copy, and
// the source is read only then, so a missing wait or a source rewritten too early shows.
void uly_emu_cp_async(uint32_t smem_addr, const void *src, int bytes, int src_bytes) {
    Fiber *self = current(tw, "cp.async");
    Worker &w = *tw;
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes < 0 || src_bytes > bytes)
        fail(w, cudaErrorLaunchFailure, false,
             "cp.async: %s copies %d bytes with src-size %d (cp-size is 4, 8 or 16, src-size at "
             "most cp-size)",
             who(*self).c_str(), bytes, src_bytes);
    if (smem_addr % bytes || (uintptr_t)src % bytes)
        fail(w, cudaErrorMisalignedAddress, false,
             "cp.async: %s copies %d bytes from %p to shared 0x%x; both must be %d-byte aligned",
             who(*self).c_str(), bytes, src, smem_addr, bytes);
    if ((size_t)smem_addr + bytes > w.smem_size)
        fail(w, cudaErrorIllegalAddress, false,
             "cp.async: %s writes shared 0x%x..0x%x, past the %zu bytes of dynamic shared memory",
             who(*self).c_str(), smem_addr, smem_addr + bytes, w.smem_size);
    memset(w.smem + smem_addr, 0xff, bytes);
    tsan_write(w.smem + smem_addr, bytes);
    self->copies.push_back(Copy{smem_addr, src, bytes, src_bytes});
}

// atom.add.f32 and red.add.f32 without .noftz (atomicAdd's) flush subnormal inputs and results
// to sign-preserving zero on global memory and keep them on shared memory (PTX ISA, atom and
// red). Shared here is the block's dynamic window: a static __shared__ float, a thread_local of
// the host, would count as global (no kernel of ours adds to one).
float uly_emu_atomic_add(float *p, float v) {
    if (in_shared_window(tw, p)) return uly__atomic_rmw(p, [v](float x) { return x + v; });
    return uly__atomic_rmw(p, [v](float x) { return flush(flush(x) + flush(v)); });
}

// red.global.add.v2.f32 (sm_90): a vector access, so p must be 8-byte aligned and global; each
// element is its own atomic add, flushed as atomicAdd's.
void uly_emu_red_add2(float *p, float a, float b) {
    Fiber *self = current(tw, "red.global.add.v2.f32");
    if ((uintptr_t)p % 8 || in_shared_window(tw, p))
        fail(*tw, (uintptr_t)p % 8 ? cudaErrorMisalignedAddress : cudaErrorIllegalAddress, false,
             "red.global.add.v2.f32: %s adds at %p, %s", who(*self).c_str(), (void *)p,
             (uintptr_t)p % 8 ? "not 8-byte aligned" : "in shared memory, not global");
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}

void uly_emu_cp_async_commit() {
    Fiber *self = current(tw, "cp.async.commit_group");
    self->group_end.push_back(self->copies.size());
}

// Completes all committed groups but the n most recent. Copies finish in no particular order.
void uly_emu_cp_async_wait(int n) {
    Fiber *self = current(tw, "cp.async.wait_group");
    Worker &w = *tw;
    size_t groups = self->group_end.size();
    if (groups <= (size_t)n) return;
    size_t end = self->group_end[groups - n - 1];
    unsigned order[64];
    while (self->copies_done < end) {
        unsigned k = (unsigned)std::min<size_t>(64, end - self->copies_done);
        for (unsigned i = 0; i < k; i++) order[i] = i;
        shuffle(w, order, k);
        for (unsigned i = 0; i < k; i++) {
            const Copy &c = self->copies[self->copies_done + order[i]];
            check_in_flight(w, *self, c, "completing it");
            memcpy(w.smem + c.dst, c.src, c.src_bytes);
            memset(w.smem + c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
            tsan_read(c.src, c.src_bytes);
            tsan_write(w.smem + c.dst, c.bytes);
        }
        self->copies_done += k;
    }
    self->group_end.erase(self->group_end.begin(), self->group_end.end() - n);
    if (self->copies_done == self->copies.size()) {  // all done: start the queue afresh
        for (size_t &e : self->group_end) e -= self->copies_done;
        self->copies.clear();
        self->copies_done = 0;
    }
}

void __trap() {
    Fiber *self = current(tw, "__trap");
    Worker &w = *tw;
    fail(w, cudaErrorLaunchFailure, false, "__trap() by %s", who(*self).c_str());
}

unsigned long long uly_emu_seed() { return config().seed; }

const char *uly_emu_last_failure() {
    static thread_local std::string seen;  // a copy the caller may read while workers report
    std::lock_guard<std::mutex> lock(host->m);
    seen = host->failure;
    return seen.c_str();
}

void uly_emu_set_quiet(bool q) { quiet = q; }

void uly_emu_record_reset() {
    recorded_ops.clear();
    recorded_allocs = 0;
}
std::vector<uly_emu_op> uly_emu_recorded_ops() { return recorded_ops; }
void uly_emu_record_op(const char *what, cudaStream_t s) {
    recorded_ops.push_back(uly_emu_op{what, nullptr, s, dim3(0, 0, 0)});
}
unsigned long long uly_emu_recorded_allocs() { return recorded_allocs; }

unsigned long long uly_emu_switches() { return total_switches; }
unsigned long long uly_emu_ldmatrix_conflicts() { return ldmatrix_conflicts; }

// =============================================================================================
// CUDA runtime subset on host memory, on the streams above. Errors are not sticky:
// cudaGetLastError clears them, so a test goes on.

struct CUevent_st {
    std::shared_ptr<Event> e = std::make_shared<Event>();  // shared with queued records and waits
};

namespace {

#define ULY__ERRORS(X)                                                                             \
    X(cudaSuccess, "no error")                                                                     \
    X(cudaErrorInvalidValue, "invalid argument")                                                   \
    X(cudaErrorNotReady, "device not ready")                                                       \
    X(cudaErrorMemoryAllocation, "out of memory")                                                  \
    X(cudaErrorInvalidConfiguration, "invalid configuration argument")                             \
    X(cudaErrorInvalidDevice, "invalid device ordinal")                                            \
    X(cudaErrorDevicesUnavailable, "CUDA-capable device(s) is/are busy or unavailable")            \
    X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                   \
    X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                         \
    X(cudaErrorMisalignedAddress, "misaligned address")                                            \
    X(cudaErrorLaunchFailure, "unspecified launch failure")

const char *error_text(cudaError_t e, bool name) {
#define X(code, text)                                                                              \
    if (e == code) return name ? #code : text;
    ULY__ERRORS(X)
#undef X
    return name ? "cudaErrorUnknown" : "unknown error";
}

// What uly_emu_fail_call asked of this call of `what`: cudaSuccess or the error to return.
cudaError_t injected(const char *what) {
    if (!fail_what || strcmp(fail_what, what) || fail_skip-- > 0) return cudaSuccess;
    fail_what = nullptr;
    return fail_error;
}

// What a call returns for the work queued before it: the thread's error, but not a query's
// "not ready", which stays the last error (cudaGetLastError) and no other call returns.
cudaError_t pending() {
    const cudaError_t e = cudaPeekAtLastError();
    return e == cudaErrorNotReady ? cudaSuccess : e;
}

// "Not ready" is a query's answer, and like any answer but success the thread's last error
// (CUDA Runtime API, cudaGetLastError: "the last error that has been produced by any of the
// runtime calls"), which a launch check that follows reads as its own.
cudaError_t not_ready() {
    set_error(cudaErrorNotReady);
    return cudaErrorNotReady;
}

// Live allocations by address and their extent, so cudaPointerGetAttributes can tell device
// memory (cudaMalloc) and pinned host memory (cudaMallocHost) from plain host memory.
struct Alloc {
    size_t size;
    cudaMemoryType type;
};
std::mutex alloc_m;
std::map<uintptr_t, Alloc> allocs;

// Exact-size allocations let ASan catch a kernel reading one element past a buffer; the fill
// stands for the garbage of fresh device memory.
cudaError_t alloc(void **p, size_t size, cudaMemoryType type) {
    if (posix_memalign(p, 256, std::max<size_t>(size, 1))) {
        *p = nullptr;
        set_error(cudaErrorMemoryAllocation);
        return cudaErrorMemoryAllocation;
    }
    memset(*p, 0xff, size);
    std::lock_guard<std::mutex> lock(alloc_m);
    allocs[(uintptr_t)*p] = Alloc{std::max<size_t>(size, 1), type};
    return cudaSuccess;
}

cudaError_t release(void *p) {
    {
        std::lock_guard<std::mutex> lock(alloc_m);
        allocs.erase((uintptr_t)p);
    }
    free(p);
    return cudaSuccess;
}


std::atomic<size_t> smem_optin{0};  // uly_emu_set_smem_optin; 0: kSmemPerBlock
size_t smem_optin_now() { return smem_optin ? smem_optin.load() : kSmemPerBlock; }

}  // namespace

void uly_emu_stall_stream(cudaStream_t s, bool stalled) {
    CUstream_st *q = stream_of(s);
    {
        std::lock_guard<std::mutex> lock(q->m);
        q->stalled = stalled;
    }
    q->cv.notify_all();
}

void uly_emu_queue(cudaStream_t s, std::function<void()> work) {
    queue_work(s, [work = std::move(work)](Host &) { work(); });
}

void uly_emu_drain(cudaStream_t s) {
    if (legacy(s)) drain_all();
    stream_of(s)->drain();
}

namespace {

bool pageable(const void *p) {
    cudaPointerAttributes a;
    return cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeUnregistered;
}

}  // namespace
void uly_emu_set_smem_optin(size_t bytes) { smem_optin = bytes; }

cudaError_t cudaMalloc(void **p, size_t size) {
    recorded_allocs++;
    return alloc(p, size, cudaMemoryTypeDevice);
}
// As CUDA's, the frees wait for the device: no queued work still uses the memory.
cudaError_t cudaFree(void *p) {
    drain_all();
    return release(p);
}
cudaError_t cudaMallocHost(void **p, size_t size) {
    recorded_allocs++;
    return alloc(p, size, cudaMemoryTypeHost);
}
cudaError_t cudaFreeHost(void *p) {
    drain_all();
    return release(p);
}

// As CUDA 11 and later: memory the runtime does not know is cudaMemoryTypeUnregistered, with
// cudaSuccess. Device memory has no host alias (though here the host could read it).
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *ptr) {
    if (!a) return cudaErrorInvalidValue;
    *a = cudaPointerAttributes{};
    a->type = cudaMemoryTypeUnregistered;
    a->device = cudaInvalidDeviceId;
    a->hostPointer = const_cast<void *>(ptr);
    std::lock_guard<std::mutex> lock(alloc_m);
    auto it = allocs.upper_bound((uintptr_t)ptr);  // the first allocation past ptr
    if (it == allocs.begin()) return cudaSuccess;
    --it;
    if ((uintptr_t)ptr - it->first >= it->second.size) return cudaSuccess;
    a->type = it->second.type;
    a->device = 0;
    a->devicePointer = const_cast<void *>(ptr);
    if (a->type == cudaMemoryTypeDevice) a->hostPointer = nullptr;
    return cudaSuccess;
}

// The synchronous copies and sets run on the legacy stream: after all queued work, before they
// return.
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind) {
    uly_emu_record_op("cudaMemcpy", 0);
    drain_all();
    if (count) memmove(dst, src, count);
    return pending();
}

// A copy from or to pageable host memory waits for the stream and copies before it returns (the
// CUDA runtime's "API synchronization behavior" allows both); others are queued.
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind,
                            cudaStream_t s) {
    if (const cudaError_t e = injected("cudaMemcpyAsync")) return e;
    uly_emu_record_op("cudaMemcpyAsync", s);
    if (!count) return pending();
    if (pageable(src) || pageable(dst)) {
        wait_stream(s, "cudaMemcpyAsync of pageable memory");
        memmove(dst, src, count);
    } else {
        queue_work(s, [=](Host &) { memmove(dst, src, count); });
    }
    return pending();
}

cudaError_t cudaMemset(void *p, int value, size_t count) {
    uly_emu_record_op("cudaMemset", 0);
    drain_all();
    memset(p, value, count);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t count, cudaStream_t s) {
    uly_emu_record_op("cudaMemsetAsync", s);
    queue_work(s, [=](Host &) { memset(p, value, count); });
    return cudaSuccess;
}

cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int value, size_t width, size_t height,
                              cudaStream_t s) {
    uly_emu_record_op("cudaMemset2DAsync", s);
    if (height > 1 && pitch < width) return cudaErrorInvalidValue;
    queue_work(s, [=](Host &) {
        for (size_t r = 0; r < height; r++) memset((char *)p + r * pitch, value, width);
    });
    return cudaSuccess;
}

cudaError_t cudaMemcpyToSymbol(const void *symbol, const void *src, size_t count, size_t offset,
                               cudaMemcpyKind) {
    uly_emu_record_op("cudaMemcpyToSymbol", 0);
    drain_all();
    memcpy((char *)symbol + offset, src, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpyFromSymbol(void *dst, const void *symbol, size_t count, size_t offset,
                                 cudaMemcpyKind) {
    uly_emu_record_op("cudaMemcpyFromSymbol", 0);
    drain_all();
    memcpy(dst, (const char *)symbol + offset, count);
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
    *s = new_stream();
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }

// Returns when the stream's work has run (CUDA returns at once and releases it later).
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (legacy(s) || s == cudaStreamPerThread) return cudaErrorInvalidResourceHandle;
    delete_stream(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    wait_stream(s, "cudaStreamSynchronize");
    return pending();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
    const cudaError_t e = pending();
    return e != cudaSuccess || stream_of(s)->idle() ? e : not_ready();
}
// Waits for the records of e asked before this call, and for nothing recorded later.
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    if (const cudaError_t e = injected("cudaStreamWaitEvent")) return e;
    uly_emu_record_op("cudaStreamWaitEvent", s);
    if (!e) return cudaErrorInvalidResourceHandle;
    queue(s, [ev = e->e, n = e->e->last()] { ev->wait(n); });
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}

// A record is reached when the stream runs it, even on a device that faulted (its waiters go on).
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (const cudaError_t e = injected("cudaEventRecord")) return e;
    uly_emu_record_op("cudaEventRecord", s);
    if (!e) return cudaErrorInvalidResourceHandle;
    queue(s, [ev = e->e, n = e->e->ask()] { ev->reach(n); });
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return cudaErrorInvalidResourceHandle;
    e->e->wait(e->e->last());
    return pending();
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start || !end) return cudaErrorInvalidResourceHandle;
    std::chrono::steady_clock::time_point a, b;
    if (!start->e->reached_at(&a) || !end->e->reached_at(&b)) return not_ready();
    *ms = std::chrono::duration<float, std::milli>(b - a).count();
    return cudaSuccess;
}

cudaError_t cudaGetLastError() { return take_error(); }
cudaError_t cudaPeekAtLastError() {
    std::lock_guard<std::mutex> lock(host->m);
    return host->error;
}
const char *cudaGetErrorString(cudaError_t e) { return error_text(e, false); }
const char *cudaGetErrorName(cudaError_t e) { return error_text(e, true); }
cudaError_t cudaDeviceSynchronize() {
    drain_all();
    return pending();
}

cudaError_t cudaDeviceReset() {
    drain_all();
    take_error();
    return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
        (size_t)value > smem_optin_now()) {
        set_error(cudaErrorInvalidValue);
        return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(attr_m);
    max_dyn_smem[fn] = value;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *d) {
    *d = 0;
    return cudaSuccess;
}

void uly_emu_fail_call(const char *what, int nth, cudaError_t e) {
    fail_what = what, fail_skip = nth - 1, fail_error = e;
}

static std::atomic<int> set_device_failures{0};  // uly_emu_fail_set_device
void uly_emu_fail_set_device(int calls) { set_device_failures = calls; }

cudaError_t cudaSetDevice(int d) {
    int left = set_device_failures.load();
    while (left > 0 && !set_device_failures.compare_exchange_weak(left, left - 1)) {
    }
    if (left > 0) return cudaErrorDevicesUnavailable;
    return d == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    *free_bytes = *total = (size_t)80 << 30;
    return cudaSuccess;
}

// An H100 SXM as the kernels see it: what tile-size and occupancy choices read.
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    *p = cudaDeviceProp{};
    snprintf(p->name, sizeof p->name, "ulysses CUDA emulator (H100-like)");
    p->totalGlobalMem = (size_t)80 << 30;
    p->sharedMemPerBlock = kSmemDefault;
    p->sharedMemPerBlockOptin = smem_optin_now();
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->reservedSharedMemPerBlock = 1024;
    p->regsPerBlock = p->regsPerMultiprocessor = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 0x7fffffff;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->totalConstMem = 64 * 1024;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 132;
    p->maxThreadsPerMultiProcessor = 2048;
    p->maxBlocksPerMultiProcessor = 32;
    p->l2CacheSize = 50 * 1024 * 1024;
    p->memoryBusWidth = 5120;
    p->concurrentKernels = 1;
    p->unifiedAddressing = 1;
    p->cooperativeLaunch = 1;
    p->clusterLaunch = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    if (cudaError_t e = cudaGetDeviceProperties(&p, device)) return e;
    switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
        *value = (int)p.sharedMemPerMultiprocessor;
        break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    default: return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}
