/* cuda_layout.cuh - the GPU SP layer (section of ulysses_cuda.cuh): layout kernels, the
   device-local and NCCL communicators, and a reference attention for tests.

   The layer itself is ulysses.h's driver (uly_forward, uly_backward): it only calls the layout,
   the communicator and the attention, so on the GPU it runs with
       L.layout = uly_cuda_layout();                 pack/unpack kernels on (cudaStream_t)L.stream
       L.comm   = a device communicator;             device-local (one GPU) or NCCL
       L.attn   = uly_flash_attention(), or uly_cuda_reference_attention() to check it;
   and L.workspace, saved and every tensor in GPU memory. Nothing here allocates; pack, unpack,
   alltoallv and the attention only queue work on the stream. Every call returns a uly_status.

   Layout kernels: every exchange is one launch of one kernel, a strided box copy. bf16, fp16,
   fp32; 16-byte accesses where the tensor's address and strides allow, element accesses
   otherwise; int64 indexing. A kv head that several ranks received comes back as several
   gradient copies, which the DKV unpack sums in fp32 in peer order, rounding once.

   Communicators (uly_comm with device = 1: buffers are GPU memory, work on the given stream):
       uly_cuda_local_run   P virtual ranks on the current GPU, as threads (tests, benchmarks)
       uly_nccl_comm        an NCCL communicator (ULYSSES_NCCL): ncclAlltoAll (NCCL >= 2.28) when
                            every peer gets the same count, grouped ncclSend/ncclRecv otherwise
       uly_nccl_split       SP and DP communicators from a world one (ncclCommSplit)
       uly_nccl_wait        waits for a stream while watching NCCL's asynchronous errors */

/* ---------------------------------------------------------------------------------------------
   Declarations */

#ifdef __cplusplus
extern "C" {
#endif

/* Pack and unpack kernels, launched on the stream argument (a cudaStream_t). The tensor's
   address must be a multiple of its element size; 16-byte accesses need 16-byte alignment of
   the address, the strides and the rows (D * element size), and anything else takes the
   element-wise path. ctx is unused. */
ULYDEF uly_layout uly_cuda_layout(void);

/* Runs fn(comm, user) on `size` threads, one per virtual rank of an SP group on the calling
   thread's GPU, and waits for all of them. Each rank works on its own stream (the stream
   argument of each call); alltoallv copies device to device between the ranks' buffers, ordered
   by events, so the streams of different ranks run concurrently. allreduce_sum takes GPU or
   host memory and synchronizes the stream. barrier meets the host threads. */
ULYDEF uly_status uly_cuda_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                     void *user);

/* A plain attention for tests: one thread per query row (forward, dQ) or key row (dK, dV),
   fp32 accumulation, any dtype, head dims up to 256, the whole uly_attn contract. Always
   deterministic. The backward's workspace holds Dsum, fp32 [B, H, Sq]. ctx is unused. */
ULYDEF uly_attn uly_cuda_reference_attention(void);

#ifdef ULYSSES_NCCL
/* An NCCL communicator over `comm` (one SP group, one GPU per rank). NCCL moves GPU memory
   only, so allreduce_sum of host memory (uly_loss_reduce's) and barrier go through `scratch`,
   ULY_NCCL_SCRATCH doubles of device memory the caller provides (NULL: they return
   ULY_EUNSUPPORTED), and wait for the stream. Failures return ULY_ECOMM with NCCL's message. */
enum { ULY_NCCL_SCRATCH = 64 };
typedef struct uly_nccl {
    ncclComm_t comm;
    double *scratch;
} uly_nccl;
ULYDEF uly_status uly_nccl_comm(uly_nccl *n, uly_comm *out);
/* Splits world into SP groups of sp_size consecutive ranks and DP groups across them. */
ULYDEF uly_status uly_nccl_split(ncclComm_t world, int sp_size, ncclComm_t *sp, ncclComm_t *dp);
/* Waits until the work queued on stream is done, polling NCCL for an asynchronous error (a
   peer that died, a network failure). On such an error, or after timeout_s seconds (0: no
   limit), it aborts comm, so the stream can drain, and returns ULY_ECOMM: never a silent hang. */
ULYDEF uly_status uly_nccl_wait(ncclComm_t comm, void *stream, double timeout_s);
#endif

#ifdef __cplusplus
}
#endif

/* ---------------------------------------------------------------------------------------------
   Implementation */

#ifdef ULYSSES_IMPLEMENTATION

/* Element conversions: values travel as T, sums happen in fp32 and round once. */
static __device__ __forceinline__ float uly__widen(float x) { return x; }
static __device__ __forceinline__ float uly__widen(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float uly__widen(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T uly__round(float x);
template <> __device__ __forceinline__ float uly__round<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 uly__round<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half uly__round<__half>(float x) {
    return __float2half_rn(x);
}

/* Calls f(T()) with the element type of t. */
template <typename F> static uly_status uly__by_dtype(uly_dtype t, F f) {
    switch (t) {
    case ULY_BF16: return f(__nv_bfloat16());
    case ULY_F16: return f(__half());
    default: return f(0.0f);
    }
}

/* The error of the last launch, or of a CUDA call. */
static uly_status uly__cuda(cudaError_t e, const char *what) {
    ULY__CHECK(e == cudaSuccess, ULY_ECUDA, "%s: %s (%s)", what, cudaGetErrorString(e),
               cudaGetErrorName(e));
    return uly__ok();
}

/* ---------------------------------------------------------------------------------------------
   Layout kernels

   An exchange moves P boxes between a strided tensor t and the P dense blocks of an exchange
   buffer: box j is the part of t that goes to or comes from peer j, [B, tokens, heads, D], and
   block j holds it densely at element offset off[j]. On the sequence-layout side (pack Q and
   KV, unpack O and DKV) the boxes split the heads and share this rank's tokens; on the
   head-layout side they split the tokens and share this rank's heads. Head ranges are sorted
   and may overlap (a kv head several ranks need); an unpack writes an overlapping head once,
   from the first box that holds it, as the sum of its copies. */

/* A grid of at most 2048 blocks of 256 threads (about two waves on an H100) strides over the
   boxes: big enough to keep every SM's memory pipes full, small enough to need no tail. */
enum { ULY__COPY_THREADS = 256, ULY__COPY_BLOCKS = 2048 };

/* The kernel's parameters, by value: the per-peer tables make them about 6 KB, which CUDA
   allows since 12.1 (32 KB; 4 KB before), and they sit in constant memory, read by index. */
struct uly__boxes {
    void *t, *buf;
    int64_t sb, ss, sh;        /* t's strides, elements */
    int64_t batch, width, dim; /* B, the extent of the dim all boxes share, D */
    int n;                     /* boxes, one per peer */
    int by_heads;              /* the boxes split heads (else tokens) */
    int unpack;                /* buf -> t (else t -> buf) */
    int merge;                 /* a row is all of a box's heads at one token: t's heads are
                                  adjacent (sh == D) and no two boxes share a head */
    int64_t start[ULY_MAX_SP], count[ULY_MAX_SP], off[ULY_MAX_SP]; /* split ranges, offsets */
};

template <typename T, int W> struct alignas(sizeof(T) * W) uly__vec {
    T e[W];
};

/* Row `row` of block m, element e, as W values. */
template <typename T, int W>
__device__ __forceinline__ uly__vec<T, W> uly__block_at(const uly__boxes &x, int m, int64_t row,
                                                        int64_t e) {
    return *(const uly__vec<T, W> *)((const T *)x.buf + x.off[m] + row * x.dim + e);
}

/* dst = the sum of the copies of head h held by boxes j..k-1, at (b, s), element e of the row:
   fp32 in box order, one rounding. */
template <typename T, int W>
__device__ __forceinline__ void uly__sum_copies(const uly__boxes &x, int j, int k, int64_t b,
                                                int64_t s, int64_t h, int64_t e,
                                                uly__vec<T, W> *dst) {
    const int64_t bs = b * x.width + s; /* the boxes split heads and share the tokens */
    uly__vec<T, W> v = uly__block_at<T, W>(x, j, bs * x.count[j] + h - x.start[j], e);
    float acc[W];
#pragma unroll
    for (int w = 0; w < W; w++) acc[w] = uly__widen(v.e[w]);
    for (int m = j + 1; m < k; m++) {
        v = uly__block_at<T, W>(x, m, bs * x.count[m] + h - x.start[m], e);
#pragma unroll
        for (int w = 0; w < W; w++) acc[w] += uly__widen(v.e[w]);
    }
#pragma unroll
    for (int w = 0; w < W; w++) v.e[w] = uly__round<T>(acc[w]);
    *dst = v;
}

/* Grid (blocks, boxes): the blocks of column j stride over box j, W elements per access. */
template <typename T, int W>
__global__ void __launch_bounds__(ULY__COPY_THREADS) uly__box_copy(const uly__boxes x) {
    typedef uly__vec<T, W> V;
    const int j = (int)blockIdx.y;
    const int64_t t0 = x.by_heads ? 0 : x.start[j], nt = x.by_heads ? x.width : x.count[j];
    const int64_t h0 = x.by_heads ? x.start[j] : 0, nh = x.by_heads ? x.count[j] : x.width;
    /* Unpack: the heads this box shares with the previous one are that box's to write. */
    const int64_t h_first = x.unpack && x.by_heads && j > 0
                                ? max((int64_t)0, x.start[j - 1] + x.count[j - 1] - h0)
                                : 0;
    const int64_t row_heads = x.merge ? nh : 1, rows = x.merge ? 1 : nh - h_first;
    const int64_t nv = row_heads * x.dim / W; /* accesses per row */
    const int64_t n = x.batch * nt * rows * nv;
    const T *t = (const T *)x.t + t0 * x.ss + h0 * x.sh;
    const T *blk = (const T *)x.buf + x.off[j];
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = i % nv * W, r = i / nv;
        const int64_t h = h_first + r % rows, bs = r / rows, s = bs % nt, b = bs / nt;
        V *tp = (V *)(t + b * x.sb + s * x.ss + h * x.sh + e);
        V *bp = (V *)(blk + ((b * nt + s) * nh + h) * x.dim + e);
        if (!x.unpack) {
            *bp = *tp;
            continue;
        }
        int k = j + 1; /* the later boxes that hold this head too */
        while (x.by_heads && k < x.n && x.start[k] <= h0 + h) k++;
        if (k == j + 1) *tp = *bp;
        else uly__sum_copies<T, W>(x, j, k, b, s, h0 + h, e, tp);
    }
}

/* The boxes of exchange x on this rank, from the plan's ranges and offsets. */
static uly__boxes uly__boxes_of(const uly_plan *p, uly_xchg x, int unpack, uly_tensor t,
                                void *buf) {
    int64_t c[4][ULY_MAX_SP];
    uly__boxes b;
    uly_exchange_counts(p, x, c[0], c[1], c[2], c[3]);
    b.t = t.data, b.buf = buf;
    b.sb = t.sb, b.ss = t.ss, b.sh = t.sh;
    b.batch = t.b, b.dim = t.d;
    b.n = p->desc.sp_size;
    b.by_heads = uly__to_head(x) != unpack;
    b.unpack = unpack;
    b.width = b.by_heads ? t.s : t.h;
    int shared = 0;
    for (int j = 0; j < b.n; j++) {
        uly_range r = b.by_heads ? uly__xheads(p, x, j) : uly_tokens(p, j);
        b.start[j] = r.start, b.count[j] = r.count;
        b.off[j] = c[unpack ? 3 : 1][j] / p->elem_size;
        shared |= j > 0 && r.start < b.start[j - 1] + b.count[j - 1];
    }
    b.merge = t.sh == t.d && !shared;
    return b;
}

/* 16-byte accesses: every address a thread forms is a multiple of 16. */
static int uly__can_vectorize(const uly__boxes &b, int64_t elem) {
    uint64_t bits = (uint64_t)(uintptr_t)b.t | (uint64_t)(uintptr_t)b.buf;
    bits |= (uint64_t)((b.sb | b.ss | b.sh | b.dim) * elem);
    return bits % 16 == 0;
}

template <typename T> static uly_status uly__launch_boxes(const uly__boxes &b, cudaStream_t s) {
    const int64_t w = uly__can_vectorize(b, sizeof(T)) ? 16 / sizeof(T) : 1;
    int64_t most = 0; /* accesses in the largest box */
    for (int j = 0; j < b.n; j++) {
        most = uly__max(most, b.batch * b.width * b.count[j] * b.dim / w);
    }
    const int64_t blocks = uly__min((most + ULY__COPY_THREADS - 1) / ULY__COPY_THREADS,
                                    uly__max(1, ULY__COPY_BLOCKS / b.n));
    void (*kernel)(const uly__boxes) =
        w > 1 ? uly__box_copy<T, 16 / sizeof(T)> : uly__box_copy<T, 1>;
    ULY_LAUNCH(kernel, dim3((unsigned)blocks, (unsigned)b.n), dim3(ULY__COPY_THREADS), 0, s, b);
    return uly__cuda(cudaGetLastError(), "layout kernel launch");
}

static uly_status uly__cuda_xfer(const uly_plan *p, uly_xchg x, int unpack, uly_tensor t,
                                 void *buf, void *stream) {
    static const char *const names[] = {"Q", "KV", "O", "DKV"};
    char what[32];
    ULY__CHECK(uly__plan_ok(p), ULY_EINVAL, "uly_cuda_layout: plan is NULL or not initialized");
    ULY__CHECK(x >= ULY_X_Q && x <= ULY_X_DKV, ULY_EINVAL, "uly_cuda_layout: x (%d) is not a "
               "uly_xchg", (int)x);
    snprintf(what, sizeof what, "%s %s: %s", unpack ? "unpack" : "pack", names[x],
             unpack ? "dst" : "src");
    uly_tensor want = uly__to_head(x) != unpack ? uly__seq_layout(p, x, NULL)
                                                : uly__head_layout(p, x, NULL);
    ULY__TRY(uly__check_like(what, t, want));
    ULY__CHECK((uintptr_t)t.data % p->elem_size == 0, ULY_EINVAL,
               "%s: data (%p) is not aligned to its element size (%lld bytes)", what, t.data,
               ULY__LL(p->elem_size));
    ULY__CHECK(buf && (uintptr_t)buf % p->elem_size == 0, ULY_EINVAL,
               "%s %s: %s (%p) is NULL or not aligned to the element size (%lld bytes)",
               unpack ? "unpack" : "pack", names[x], unpack ? "recv" : "send", buf,
               ULY__LL(p->elem_size));
    const uly__boxes b = uly__boxes_of(p, x, unpack, t, buf);
    return uly__by_dtype(t.dtype, [&](auto tag) {
        return uly__launch_boxes<decltype(tag)>(b, (cudaStream_t)stream);
    });
}

static uly_status uly__cuda_pack(void *ctx, const uly_plan *p, uly_xchg x, uly_tensor src,
                                 void *send, void *stream) {
    (void)ctx;
    return uly__cuda_xfer(p, x, 0, src, send, stream);
}

static uly_status uly__cuda_unpack(void *ctx, const uly_plan *p, uly_xchg x, const void *recv,
                                   uly_tensor dst, void *stream) {
    (void)ctx;
    return uly__cuda_xfer(p, x, 1, dst, (void *)recv, stream);
}

ULYDEF uly_layout uly_cuda_layout(void) {
    uly_layout l;
    l.pack = uly__cuda_pack;
    l.unpack = uly__cuda_unpack;
    l.ctx = NULL;
    return l;
}

/* ---------------------------------------------------------------------------------------------
   Device-local communicator

   Virtual rank r is thread r of uly_local_run. The host communicator of those threads carries
   the bookkeeping (where each block is, and the events that say when it is ready) and the GPU
   moves the bytes. alltoallv: record "ready" on my stream; trade block addresses with every
   peer over the host comm; make my stream wait for each sender's ready event and copy its block
   into my receive buffer; record "done"; meet; and make my stream wait for every peer's done
   event, so work queued after the call cannot overwrite my send buffer while a peer reads it. */

typedef struct uly__dl_rank {
    const uly_comm *host;
    cudaEvent_t ready, done; /* mine */
    cudaEvent_t peer_ready[ULY_MAX_SP], peer_done[ULY_MAX_SP];
} uly__dl_rank;

typedef struct uly__dl_block { /* what a sender tells receiver j */
    const char *src;
    int64_t bytes;
} uly__dl_block;

/* Every rank sends the same `size` bytes from out[j] to each peer j; in[i] is what i sent. */
static uly_status uly__dl_trade(const uly_comm *host, const void *out, void *in, int64_t size) {
    int64_t count[ULY_MAX_SP], off[ULY_MAX_SP];
    for (int j = 0; j < host->size; j++) count[j] = size, off[j] = j * size;
    return host->alltoallv(host->ctx, out, count, off, in, count, off, NULL);
}

static uly_status uly__dl_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                    const int64_t *send_offs, void *recv,
                                    const int64_t *recv_counts, const int64_t *recv_offs,
                                    void *stream) {
    uly__dl_rank *me = (uly__dl_rank *)ctx;
    const int P = me->host->size;
    cudaStream_t s = (cudaStream_t)stream;
    uly__dl_block out[ULY_MAX_SP], in[ULY_MAX_SP];
    uly_status st =
        uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts, recv_offs);
    for (int j = 0; j < P; j++) {
        out[j].src = st.code ? NULL : (const char *)send + send_offs[j];
        out[j].bytes = st.code ? -1 : send_counts[j];
    }
    cudaError_t e = cudaEventRecord(me->ready, s);
    ULY__TRY(uly__dl_trade(me->host, out, in, sizeof *out));
    for (int i = 0; i < P && !st.code; i++) {
        if (in[i].bytes != recv_counts[i])
            st = uly__err(ULY_ECOMM, "alltoallv: rank %d sends %lld bytes to rank %d, which "
                          "expects %lld", i, ULY__LL(in[i].bytes), me->host->rank,
                          ULY__LL(recv_counts[i]));
        else if (in[i].bytes && !e && !(e = cudaStreamWaitEvent(s, me->peer_ready[i], 0)))
            e = cudaMemcpyAsync((char *)recv + recv_offs[i], in[i].src, (size_t)in[i].bytes,
                                cudaMemcpyDeviceToDevice, s);
    }
    if (!e) e = cudaEventRecord(me->done, s);
    uly_status met = me->host->barrier(me->host->ctx);
    for (int i = 0; i < P && !e; i++) e = cudaStreamWaitEvent(s, me->peer_done[i], 0);
    ULY__TRY(st);
    ULY__TRY(met);
    return uly__cuda(e, "device-local alltoallv");
}

/* Through the host, a few values at a time: sums are the host comm's, in rank order. */
static uly_status uly__dl_allreduce(void *ctx, double *buf, int64_t n, void *stream) {
    uly__dl_rank *me = (uly__dl_rank *)ctx;
    cudaStream_t s = (cudaStream_t)stream;
    double tmp[64];
    ULY__CHECK(n >= 0 && (buf || !n), ULY_EINVAL, "allreduce_sum: n (%lld) must be >= 0 and buf "
               "not NULL", ULY__LL(n));
    for (int64_t at = 0; at < n; at += 64) {
        const size_t bytes = (size_t)uly__min(64, n - at) * sizeof(double);
        cudaError_t e = cudaMemcpyAsync(tmp, buf + at, bytes, cudaMemcpyDefault, s);
        if (!e) e = cudaStreamSynchronize(s);
        ULY__TRY(uly__cuda(e, "device-local allreduce_sum"));
        ULY__TRY(me->host->allreduce_sum(me->host->ctx, tmp, uly__min(64, n - at), NULL));
        e = cudaMemcpyAsync(buf + at, tmp, bytes, cudaMemcpyDefault, s);
        if (!e) e = cudaStreamSynchronize(s);
        ULY__TRY(uly__cuda(e, "device-local allreduce_sum"));
    }
    return uly__ok();
}

static uly_status uly__dl_barrier(void *ctx) {
    const uly_comm *host = ((uly__dl_rank *)ctx)->host;
    return host->barrier(host->ctx);
}

typedef struct uly__dl_world {
    void (*fn)(const uly_comm *comm, void *user);
    void *user;
    int device;
    uly_status st[ULY_MAX_SP]; /* of each rank's setup */
} uly__dl_world;

/* This thread's GPU and events, and every peer's events. */
static uly_status uly__dl_setup(uly__dl_rank *me, int device) {
    cudaEvent_t mine[2 * ULY_MAX_SP], peers[2 * ULY_MAX_SP];
    const int P = me->host->size;
    cudaError_t e = cudaSetDevice(device);
    if (!e) e = cudaEventCreateWithFlags(&me->ready, cudaEventDisableTiming);
    if (!e) e = cudaEventCreateWithFlags(&me->done, cudaEventDisableTiming);
    ULY__TRY(uly__cuda(e, "device-local comm setup"));
    for (int j = 0; j < P; j++) mine[2 * j] = me->ready, mine[2 * j + 1] = me->done;
    ULY__TRY(uly__dl_trade(me->host, mine, peers, 2 * sizeof *mine));
    for (int i = 0; i < P; i++)
        me->peer_ready[i] = peers[2 * i], me->peer_done[i] = peers[2 * i + 1];
    return uly__ok();
}

static void uly__dl_main(const uly_comm *host, void *user) {
    uly__dl_world *w = (uly__dl_world *)user;
    uly__dl_rank me;
    memset(&me, 0, sizeof me);
    me.host = host;
    w->st[host->rank] = uly__dl_setup(&me, w->device);
    if (!w->st[host->rank].code) {
        uly_comm c;
        memset(&c, 0, sizeof c);
        c.size = host->size, c.rank = host->rank;
        c.alltoallv = uly__dl_alltoallv;
        c.allreduce_sum = uly__dl_allreduce;
        c.barrier = uly__dl_barrier;
        c.ctx = &me;
        c.device = 1;
        w->fn(&c, w->user);
    }
    /* Peers may still wait on my events: destroying them is safe, CUDA keeps the work. */
    if (me.ready) cudaEventDestroy(me.ready);
    if (me.done) cudaEventDestroy(me.done);
}

ULYDEF uly_status uly_cuda_local_run(int size, void (*fn)(const uly_comm *comm, void *user),
                                     void *user) {
    uly__dl_world w;
    memset(&w, 0, sizeof w);
    w.fn = fn, w.user = user;
    ULY__CHECK(fn, ULY_EINVAL, "fn is NULL");
    ULY__TRY(uly__cuda(cudaGetDevice(&w.device), "uly_cuda_local_run: cudaGetDevice"));
    uly_status st = uly_local_run(size, uly__dl_main, &w);
    for (int r = 0; r < size && !st.code; r++) st = w.st[r];
    return st;
}

/* ---------------------------------------------------------------------------------------------
   Reference attention: the contract's formulas, one thread per row, fp32 */

enum { ULY__REF_MAX_D = 256, ULY__REF_THREADS = 64 };

struct uly__ref_params {
    uly_tensor q, k, v, o, dout, dq, dk, dv;
    float *lse, *dsum; /* [B, H, Sq] */
    float scale;
    int causal;
    int64_t q_head0, group;
};

template <typename T>
__device__ __forceinline__ T *uly__ref_row(const uly_tensor &t, int64_t b, int64_t s, int64_t h) {
    return (T *)t.data + b * t.sb + s * t.ss + h * t.sh;
}

template <typename T> __device__ float uly__ref_dot(const T *a, const T *b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += uly__widen(a[i]) * uly__widen(b[i]);
    return s;
}

/* Query row i keeps keys [0, kept): the causal mask is bottom-right aligned. */
__device__ __forceinline__ int64_t uly__ref_kept(const uly__ref_params &p, int64_t i) {
    return p.causal ? min(p.k.s, max((int64_t)0, i + p.k.s - p.q.s + 1)) : p.k.s;
}

__device__ __forceinline__ int64_t uly__ref_kv_head(const uly__ref_params &p, int64_t h) {
    return (p.q_head0 + h) / p.group - p.q_head0 / p.group;
}

/* Grid (query rows, H, B). lse and o of a row that keeps no key: +inf and 0. */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_fwd(const uly__ref_params p) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (i >= p.q.s) return;
    const int64_t hk = uly__ref_kv_head(p, h), n = uly__ref_kept(p, i), D = p.q.d;
    const T *q = uly__ref_row<T>(p.q, b, i, h);
    float m = -INFINITY, l = 0.f, acc[ULY__REF_MAX_D];
    for (int64_t j = 0; j < n; j++)
        m = fmaxf(m, p.scale * uly__ref_dot(q, uly__ref_row<T>(p.k, b, j, hk), D));
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const float e = expf(p.scale * uly__ref_dot(q, uly__ref_row<T>(p.k, b, j, hk), D) - m);
        const T *v = uly__ref_row<T>(p.v, b, j, hk);
        l += e;
        for (int64_t d = 0; d < D; d++) acc[d] += e * uly__widen(v[d]);
    }
    T *o = uly__ref_row<T>(p.o, b, i, h);
    for (int64_t d = 0; d < D; d++) o[d] = uly__round<T>(n ? acc[d] / l : 0.f);
    p.lse[(b * p.q.h + h) * p.q.s + i] = n ? m + logf(l) : INFINITY;
}

/* Grid (query rows, H, B): Dsum = rowsum(dout * o), and dq = scale * sum_j dS_ij k_j with
   P_ij = exp(s_ij - lse_i), dS_ij = P_ij (dout_i . v_j - Dsum_i). */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_bwd_q(const uly__ref_params p) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    if (i >= p.q.s) return;
    const int64_t hk = uly__ref_kv_head(p, h), n = uly__ref_kept(p, i), D = p.q.d;
    const int64_t row = (b * p.q.h + h) * p.q.s + i;
    const T *q = uly__ref_row<T>(p.q, b, i, h), *dout = uly__ref_row<T>(p.dout, b, i, h);
    const float dsum = uly__ref_dot(dout, uly__ref_row<T>(p.o, b, i, h), D), lse = p.lse[row];
    float acc[ULY__REF_MAX_D];
    p.dsum[row] = dsum;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const T *k = uly__ref_row<T>(p.k, b, j, hk), *v = uly__ref_row<T>(p.v, b, j, hk);
        const float pr = expf(p.scale * uly__ref_dot(q, k, D) - lse);
        const float ds = pr * (uly__ref_dot(dout, v, D) - dsum);
        for (int64_t d = 0; d < D; d++) acc[d] += ds * uly__widen(k[d]);
    }
    T *dq = uly__ref_row<T>(p.dq, b, i, h);
    for (int64_t d = 0; d < D; d++) dq[d] = uly__round<T>(p.scale * acc[d]);
}

/* Grid (key rows, Hkv, B), after uly__ref_bwd_q wrote Dsum: dv = sum P_ij dout_i and
   dk = scale * sum dS_ij q_i over the query rows that keep key j, of every query head of the
   kv head's group. */
template <typename T>
__global__ void __launch_bounds__(ULY__REF_THREADS) uly__ref_bwd_kv(const uly__ref_params p) {
    const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t hk = blockIdx.y, b = blockIdx.z;
    if (j >= p.k.s) return;
    const int64_t D = p.q.d, g0 = p.q_head0 / p.group;
    const int64_t h_begin = max((int64_t)0, (hk + g0) * p.group - p.q_head0);
    const int64_t h_end = min(p.q.h, (hk + g0 + 1) * p.group - p.q_head0);
    const int64_t i_begin = p.causal ? max((int64_t)0, j - p.k.s + p.q.s) : 0;
    const T *k = uly__ref_row<T>(p.k, b, j, hk), *v = uly__ref_row<T>(p.v, b, j, hk);
    float dk[ULY__REF_MAX_D], dv[ULY__REF_MAX_D];
    for (int64_t d = 0; d < D; d++) dk[d] = dv[d] = 0.f;
    for (int64_t h = h_begin; h < h_end; h++)
        for (int64_t i = i_begin; i < p.q.s; i++) {
            const int64_t row = (b * p.q.h + h) * p.q.s + i;
            const T *q = uly__ref_row<T>(p.q, b, i, h), *dout = uly__ref_row<T>(p.dout, b, i, h);
            const float pr = expf(p.scale * uly__ref_dot(q, k, D) - p.lse[row]);
            const float ds = pr * (uly__ref_dot(dout, v, D) - p.dsum[row]);
            for (int64_t d = 0; d < D; d++) {
                dv[d] += pr * uly__widen(dout[d]);
                dk[d] += ds * uly__widen(q[d]);
            }
        }
    T *dk_out = uly__ref_row<T>(p.dk, b, j, hk), *dv_out = uly__ref_row<T>(p.dv, b, j, hk);
    for (int64_t d = 0; d < D; d++) {
        dk_out[d] = uly__round<T>(p.scale * dk[d]);
        dv_out[d] = uly__round<T>(dv[d]);
    }
}

static int64_t uly__ref_workspace(void *ctx, const uly_attn_args *a) {
    (void)ctx;
    return a->q.b * a->q.h * a->q.s * (int64_t)sizeof(float);
}

/* The contract's checks, then the parameters every kernel reads. */
static uly_status uly__ref_params_of(const uly_attn_args *a, int backward, uly__ref_params *p) {
    ULY__TRY(uly_attn_check(a, backward));
    ULY__CHECK(a->q.d <= ULY__REF_MAX_D, ULY_EUNSUPPORTED, "reference attention: q.d (%lld) > "
               "%d", ULY__LL(a->q.d), ULY__REF_MAX_D);
    ULY__CHECK(a->q.b <= 65535 && a->q.h <= 65535, ULY_EUNSUPPORTED, "reference attention: q.b "
               "(%lld) and q.h (%lld) must be <= 65535 (grid dims)", ULY__LL(a->q.b),
               ULY__LL(a->q.h));
    ULY__CHECK(!backward || a->workspace, ULY_EINVAL, "reference attention: workspace is NULL");
    p->q = a->q, p->k = a->k, p->v = a->v, p->o = a->o;
    p->dout = a->dout, p->dq = a->dq, p->dk = a->dk, p->dv = a->dv;
    p->lse = a->lse;
    p->dsum = (float *)a->workspace;
    p->scale = a->softmax_scale ? a->softmax_scale : 1.0f / sqrtf((float)a->q.d);
    p->causal = a->causal;
    p->q_head0 = a->q_head0;
    p->group = a->kv_group ? a->kv_group : a->q.h / a->k.h;
    return uly__ok();
}

static dim3 uly__ref_grid(int64_t rows, int64_t heads, int64_t batch) {
    return dim3((unsigned)((rows + ULY__REF_THREADS - 1) / ULY__REF_THREADS), (unsigned)heads,
                (unsigned)batch);
}

static uly_status uly__ref_fwd_call(void *ctx, const uly_attn_args *a) {
    uly__ref_params p;
    (void)ctx;
    ULY__TRY(uly__ref_params_of(a, 0, &p));
    return uly__by_dtype(a->q.dtype, [&](auto tag) {
        typedef decltype(tag) T;
        ULY_LAUNCH(uly__ref_fwd<T>, uly__ref_grid(p.q.s, p.q.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, (cudaStream_t)a->stream, p);
        return uly__cuda(cudaGetLastError(), "reference attention forward");
    });
}

static uly_status uly__ref_bwd_call(void *ctx, const uly_attn_args *a) {
    uly__ref_params p;
    (void)ctx;
    ULY__TRY(uly__ref_params_of(a, 1, &p));
    return uly__by_dtype(a->q.dtype, [&](auto tag) {
        typedef decltype(tag) T;
        cudaStream_t s = (cudaStream_t)a->stream;
        ULY_LAUNCH(uly__ref_bwd_q<T>, uly__ref_grid(p.q.s, p.q.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, s, p);
        ULY_LAUNCH(uly__ref_bwd_kv<T>, uly__ref_grid(p.k.s, p.k.h, p.q.b), dim3(ULY__REF_THREADS),
                   0, s, p);
        return uly__cuda(cudaGetLastError(), "reference attention backward");
    });
}

ULYDEF uly_attn uly_cuda_reference_attention(void) {
    uly_attn a;
    a.fwd = uly__ref_fwd_call;
    a.bwd = uly__ref_bwd_call;
    a.workspace = uly__ref_workspace;
    a.ctx = NULL;
    return a;
}

/* ---------------------------------------------------------------------------------------------
   NCCL communicator */

#ifdef ULYSSES_NCCL
#include <time.h>

static uly_status uly__nccl(ncclResult_t r, ncclComm_t comm, const char *what) {
    const char *last = comm ? ncclGetLastError(comm) : "";
    ULY__CHECK(r == ncclSuccess, ULY_ECOMM, "%s: %s%s%s", what, ncclGetErrorString(r),
               last && last[0] ? ": " : "", last ? last : "");
    return uly__ok();
}

/* A failed or in-flight-broken communicator says so here, not in a hang at the next call. */
static uly_status uly__nccl_async(ncclComm_t comm, const char *what) {
    ncclResult_t async = ncclSuccess;
    ULY__TRY(uly__nccl(ncclCommGetAsyncError(comm, &async), comm, what));
    return async == ncclInProgress ? uly__ok() : uly__nccl(async, comm, what);
}

/* Every peer gets the same count from the same place in the send and receive buffers: the
   shape ncclAlltoAll moves. */
static int uly__uniform(int P, const int64_t *sc, const int64_t *so, const int64_t *rc,
                        const int64_t *ro) {
    for (int j = 0; j < P; j++)
        if (sc[j] != sc[0] || rc[j] != sc[0] || so[j] != j * sc[0] || ro[j] != j * sc[0])
            return 0;
    return 1;
}

static uly_status uly__nccl_alltoallv(void *ctx, const void *send, const int64_t *send_counts,
                                      const int64_t *send_offs, void *recv,
                                      const int64_t *recv_counts, const int64_t *recv_offs,
                                      void *stream) {
    uly_nccl *n = (uly_nccl *)ctx;
    cudaStream_t s = (cudaStream_t)stream;
    int P = 0;
    ULY__TRY(uly__nccl(ncclCommCount(n->comm, &P), n->comm, "alltoallv: ncclCommCount"));
    ULY__TRY(uly__check_counts(P, send, send_counts, send_offs, recv, recv_counts, recv_offs));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (uly__uniform(P, send_counts, send_offs, recv_counts, recv_offs)) {
        ULY__TRY(uly__nccl(ncclAlltoAll(send, recv, (size_t)send_counts[0], ncclUint8, n->comm, s),
                           n->comm, "alltoallv: ncclAlltoAll"));
        return uly__nccl_async(n->comm, "alltoallv");
    }
#endif
    ULY__TRY(uly__nccl(ncclGroupStart(), n->comm, "alltoallv: ncclGroupStart"));
    ncclResult_t r = ncclSuccess;
    for (int j = 0; j < P && r == ncclSuccess; j++) {
        if (send_counts[j])
            r = ncclSend((const char *)send + send_offs[j], (size_t)send_counts[j], ncclUint8, j,
                         n->comm, s);
        if (recv_counts[j] && r == ncclSuccess)
            r = ncclRecv((char *)recv + recv_offs[j], (size_t)recv_counts[j], ncclUint8, j,
                         n->comm, s);
    }
    const ncclResult_t end = ncclGroupEnd(); /* always closes the group */
    ULY__TRY(uly__nccl(r, n->comm, "alltoallv: ncclSend/ncclRecv"));
    ULY__TRY(uly__nccl(end, n->comm, "alltoallv: ncclGroupEnd"));
    return uly__nccl_async(n->comm, "alltoallv");
}

static int uly__on_device(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* not an error worth keeping: p is plain host memory */
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

static uly_status uly__nccl_sum(uly_nccl *n, double *dev, int64_t count, cudaStream_t s) {
    ULY__TRY(uly__nccl(ncclAllReduce(dev, dev, (size_t)count, ncclFloat64, ncclSum, n->comm, s),
                       n->comm, "allreduce_sum: ncclAllReduce"));
    return uly__nccl_async(n->comm, "allreduce_sum");
}

/* Host memory: through scratch, a chunk at a time, waiting for each. */
static uly_status uly__nccl_allreduce(void *ctx, double *buf, int64_t count, void *stream) {
    uly_nccl *n = (uly_nccl *)ctx;
    cudaStream_t s = (cudaStream_t)stream;
    ULY__CHECK(count >= 0 && (buf || !count), ULY_EINVAL, "allreduce_sum: n (%lld) must be >= 0 "
               "and buf not NULL", ULY__LL(count));
    if (!count || uly__on_device(buf)) return uly__nccl_sum(n, buf, count, s);
    ULY__CHECK(n->scratch, ULY_EUNSUPPORTED, "allreduce_sum of host memory: uly_nccl.scratch is "
               "NULL (it needs %d doubles of device memory)", (int)ULY_NCCL_SCRATCH);
    for (int64_t at = 0; at < count; at += ULY_NCCL_SCRATCH) {
        const int64_t m = uly__min(ULY_NCCL_SCRATCH, count - at);
        ULY__TRY(uly__cuda(cudaMemcpyAsync(n->scratch, buf + at, (size_t)m * sizeof(double),
                                           cudaMemcpyHostToDevice, s), "allreduce_sum"));
        ULY__TRY(uly__nccl_sum(n, n->scratch, m, s));
        ULY__TRY(uly__cuda(cudaMemcpyAsync(buf + at, n->scratch, (size_t)m * sizeof(double),
                                           cudaMemcpyDeviceToHost, s), "allreduce_sum"));
        ULY__TRY(uly_nccl_wait(n->comm, stream, 0));
    }
    return uly__ok();
}

/* A one-value allreduce on the default stream, waited for. */
static uly_status uly__nccl_barrier(void *ctx) {
    uly_nccl *n = (uly_nccl *)ctx;
    ULY__CHECK(n->scratch, ULY_EUNSUPPORTED, "barrier: uly_nccl.scratch is NULL (it needs %d "
               "doubles of device memory)", (int)ULY_NCCL_SCRATCH);
    ULY__TRY(uly__nccl_sum(n, n->scratch, 1, 0));
    return uly_nccl_wait(n->comm, 0, 0);
}

ULYDEF uly_status uly_nccl_comm(uly_nccl *n, uly_comm *out) {
    ULY__CHECK(n && n->comm && out, ULY_EINVAL, "uly_nccl_comm: %s is NULL",
               !n ? "n" : !out ? "out" : "n->comm");
    memset(out, 0, sizeof *out);
    ULY__TRY(uly__nccl(ncclCommCount(n->comm, &out->size), n->comm, "ncclCommCount"));
    ULY__TRY(uly__nccl(ncclCommUserRank(n->comm, &out->rank), n->comm, "ncclCommUserRank"));
    out->alltoallv = uly__nccl_alltoallv;
    out->allreduce_sum = uly__nccl_allreduce;
    out->barrier = uly__nccl_barrier;
    out->ctx = n;
    out->device = 1;
    return uly__ok();
}

ULYDEF uly_status uly_nccl_split(ncclComm_t world, int sp_size, ncclComm_t *sp, ncclComm_t *dp) {
    int size = 0, rank = 0;
    ULY__CHECK(world && sp && dp, ULY_EINVAL, "uly_nccl_split: %s is NULL",
               !world ? "world" : !sp ? "sp" : "dp");
    ULY__TRY(uly__nccl(ncclCommCount(world, &size), world, "uly_nccl_split: ncclCommCount"));
    ULY__TRY(uly__nccl(ncclCommUserRank(world, &rank), world, "uly_nccl_split: ncclCommUserRank"));
    ULY__CHECK(sp_size >= 1 && size % sp_size == 0, ULY_EINVAL, "uly_nccl_split: sp_size (%d) must "
               "divide the world's size (%d)", sp_size, size);
    ULY__TRY(uly__nccl(ncclCommSplit(world, rank / sp_size, rank % sp_size, sp, NULL), world,
                       "uly_nccl_split: ncclCommSplit (SP)"));
    return uly__nccl(ncclCommSplit(world, rank % sp_size, rank / sp_size, dp, NULL), world,
                     "uly_nccl_split: ncclCommSplit (DP)");
}

ULYDEF uly_status uly_nccl_wait(ncclComm_t comm, void *stream, double timeout_s) {
    struct timespec t0, now, nap = {0, 100000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        const cudaError_t q = cudaStreamQuery((cudaStream_t)stream);
        if (q == cudaSuccess) return uly__ok();
        if (q != cudaErrorNotReady) return uly__cuda(q, "uly_nccl_wait: cudaStreamQuery");
        uly_status st = uly__nccl_async(comm, "uly_nccl_wait");
        clock_gettime(CLOCK_MONOTONIC, &now);
        const double waited =
            (double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec);
        if (!st.code && timeout_s > 0 && waited > timeout_s)
            st = uly__err(ULY_ECOMM, "uly_nccl_wait: the stream is not done after %.1f s (a peer "
                          "may be gone); the communicator was aborted", waited);
        if (st.code) {
            ncclCommAbort(comm);
            return st;
        }
        nanosleep(&nap, NULL);
    }
}

#endif /* ULYSSES_NCCL */

#endif /* ULYSSES_IMPLEMENTATION */
