/* cuda_layout.cuh - the GPU SP layer (section of ulysses_cuda.cuh): layout kernels, the
   device-local and NCCL communicators, and a reference attention for tests.

   The layer itself is ulysses.h's driver (uly_forward, uly_backward): it only calls the layout,
   the communicator and the attention, so on the GPU it runs with
       L.layout = uly_cuda_layout();                 pack/unpack kernels on (cudaStream_t)L.stream
       L.comm   = a device communicator;             device-local (one GPU) or NCCL
       L.attn   = uly_flash_attention(), or uly_cuda_reference_attention() to check it;
   and L.workspace, saved and every tensor in GPU memory. Nothing here allocates or synchronizes
   the stream; every call returns a uly_status.

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

#ifdef __cplusplus
}
#endif

/* ---------------------------------------------------------------------------------------------
   Implementation */

#ifdef ULYSSES_IMPLEMENTATION

/* Element conversions: values travel as T, sums happen in fp32. */
static __device__ __forceinline__ float uly__f32(float x) { return x; }
static __device__ __forceinline__ float uly__f32(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float uly__f32(__half x) { return __half2float(x); }
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

enum { ULY__COPY_THREADS = 256, ULY__COPY_BLOCKS = 2048 };

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
    for (int w = 0; w < W; w++) acc[w] = uly__f32(v.e[w]);
    for (int m = j + 1; m < k; m++) {
        v = uly__block_at<T, W>(x, m, bs * x.count[m] + h - x.start[m], e);
#pragma unroll
        for (int w = 0; w < W; w++) acc[w] += uly__f32(v.e[w]);
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
        const int64_t tok = b.by_heads ? b.width : b.count[j], hd = b.by_heads ? b.count[j] : b.width;
        most = uly__max(most, b.batch * tok * hd * b.dim / w);
    }
    const int64_t blocks = uly__min((most + ULY__COPY_THREADS - 1) / ULY__COPY_THREADS,
                                    uly__max(1, ULY__COPY_BLOCKS / b.n));
    void (*kernel)(const uly__boxes) = w > 1 ? uly__box_copy<T, 16 / sizeof(T)> : uly__box_copy<T, 1>;
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

#endif /* ULYSSES_IMPLEMENTATION */
