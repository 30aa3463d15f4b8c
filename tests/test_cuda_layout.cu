/* test_cuda_layout.cu - the layout kernels of ulysses_cuda.cuh against uly_cpu_layout.

   Every pack and unpack of every exchange, on every rank of a sweep of plans (uneven S and H,
   GQA with Hkv < P so kv heads are replicated, B > 1, rows whose bytes are not a multiple of
   16), in each dtype, is bit-identical to the CPU reference over the whole destination buffer,
   so nothing outside the box moves either. Tensors come in five forms: dense, the q or v view
   into a fused QKV buffer, its k view (KV and DKV only), heads-outer strides (rows that cannot
   be merged), and dense shifted by one element. That includes the DKV unpack's sums of the
   gradient copies of a shared kv head in bf16 and f16: both sides add in fp32 in peer order and
   round once. Under the emulator, which records what a call asks of the device: pack and unpack
   queue their work on the caller's stream only and allocate nothing, and they launch the
   kernel of 16-byte accesses where rows and buffers are 16-byte aligned, of 8 or 4 bytes where
   those are the widest they allow, of single elements otherwise. Then the bad inputs, each a named error.
   Builds under the CUDA emulator (make test) and with nvcc for a GPU (make test-gpu). */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "ref64.h"

#ifdef ULY_EMU
#include <sys/mman.h>
#endif

/* P, B, S, H, Hkv, D */
typedef struct lcase {
    int P;
    int64_t B, S, H, Hkv, D;
} lcase;

static const lcase cases[] = {
    {1, 2, 5, 3, 1, 8},   /* one rank: every exchange is a copy */
    {2, 1, 16, 4, 4, 8},  /* even split, 16-byte rows in bf16 */
    {3, 2, 17, 5, 5, 6},  /* uneven S and H, 12-byte rows in bf16 */
    {3, 2, 11, 6, 2, 8},  /* g = 3: a GQA group split across ranks */
    {4, 2, 13, 8, 2, 4},  /* Hkv < P: every kv head on two ranks */
    {4, 3, 9, 4, 1, 3},   /* MQA: one kv head on all ranks; odd D */
    {4, 1, 10, 6, 3, 16}, /* H_r = 2, 2, 1, 1 */
};
enum { NCASES = sizeof cases / sizeof *cases };

static const uly_dtype dtypes[] = {ULY_F32, ULY_BF16, ULY_F16};
static const char *dtype_name(uly_dtype t) {
    return t == ULY_F32 ? "f32" : t == ULY_BF16 ? "bf16" : "f16";
}

/* FUSED is the q view (Q, O) or the v view (KV, DKV) of a fused buffer, FUSED_K its k view. */
typedef enum form { DENSE, FUSED, FUSED_K, HEADS_OUTER, SHIFTED } form;
static const char *const form_names[] = {"dense", "fused", "fused-k", "heads-outer", "shifted"};
static const char *const xnames[] = {"Q", "KV", "O", "DKV"};

/* ---------------------------------------------------------------------------------------------
   Buffers: one host and one device copy of the same bytes */

typedef struct buf {
    char *host, *dev;
    int64_t bytes;
} buf;

static buf buf_new(int64_t bytes) {
    buf b;
    b.bytes = bytes;
    b.host = (char *)malloc((size_t)bytes);
    CHECK(cudaMalloc((void **)&b.dev, (size_t)bytes) == cudaSuccess, "cudaMalloc %lld",
          (long long)bytes);
    return b;
}

static void buf_free(buf *b) {
    free(b->host);
    cudaFree(b->dev);
}

/* Random finite values of dtype t, the same in both copies. */
static void buf_fill(buf *b, uly_dtype t, uint64_t seed) {
    ref_rng r = ref_seed(seed);
    int64_t es = uly_dtype_size(t);
    for (int64_t i = 0; i + es <= b->bytes; i += es) {
        float x = ref_uniform(&r);
        if (t == ULY_F32) memcpy(b->host + i, &x, 4);
        else if (t == ULY_BF16) {
            __nv_bfloat16 y = __float2bfloat16_rn(x);
            memcpy(b->host + i, &y, 2);
        } else {
            __half y = __float2half_rn(x);
            memcpy(b->host + i, &y, 2);
        }
    }
    cudaMemcpy(b->dev, b->host, (size_t)b->bytes, cudaMemcpyHostToDevice);
}

/* Bytes where the device copy differs from the host copy. */
static int64_t buf_diff(const buf *b) {
    char *got = (char *)malloc((size_t)b->bytes);
    int64_t n = 0;
    CHECK(cudaMemcpy(got, b->dev, (size_t)b->bytes, cudaMemcpyDeviceToHost) == cudaSuccess,
          "cudaMemcpy back");
    for (int64_t i = 0; i < b->bytes; i++) n += got[i] != b->host[i];
    free(got);
    return n;
}

/* A [B, s, h, D] tensor of the given form in b (host or device copy); nq and nkv are the
   head counts of the fused buffer it is a view into, whose q heads (Q, O) or k or v heads (KV,
   DKV) it is. */
static uly_tensor tensor_in(char *base, form f, uly_dtype t, int64_t B, int64_t s, int64_t h,
                            int64_t D, int kv, int64_t nq, int64_t nkv) {
    uly_tensor x = uly_dense(base + (f == SHIFTED ? uly_dtype_size(t) : 0), t, B, s, h, D);
    if (f == FUSED || f == FUSED_K) {
        uly_tensor q, k, v;
        uly_qkv_views(base, t, B, s, nq, nkv, D, &q, &k, &v);
        x = !kv ? q : f == FUSED_K ? k : v;
    } else if (f == HEADS_OUTER) {
        x.ss = D, x.sh = s * D, x.sb = h * s * D;
    }
    return x;
}

/* Bytes of the buffer behind tensor_in. */
static int64_t tensor_bytes(form f, uly_dtype t, int64_t B, int64_t s, int64_t h, int64_t D,
                            int64_t nq, int64_t nkv) {
    int64_t heads = f == FUSED || f == FUSED_K ? nq + 2 * nkv : h + (f == SHIFTED);
    return B * s * heads * D * uly_dtype_size(t);
}

/* ---------------------------------------------------------------------------------------------
   One exchange on one rank, both ways */

/* The tensor side of exchange x on a rank: sequence layout for pack Q/KV and unpack O/DKV, else
   head layout; its tokens s and heads h, and the head counts nq, nkv of a fused buffer. */
typedef struct side {
    int kv;
    int64_t s, h, nq, nkv;
} side;

static side side_of(const uly_plan *p, const lcase *c, int rank, uly_xchg x, int unpack) {
    side t;
    t.kv = x == ULY_X_KV || x == ULY_X_DKV;
    const int seq = (x == ULY_X_Q || x == ULY_X_KV) != unpack;
    t.s = seq ? uly_tokens(p, rank).count : c->S;
    t.h = seq ? (t.kv ? c->Hkv : c->H) : (t.kv ? uly_kv_heads(p, rank) : uly_heads(p, rank)).count;
    t.nq = seq ? c->H : uly_heads(p, rank).count;
    t.nkv = seq ? c->Hkv : uly_kv_heads(p, rank).count;
    return t;
}

static uly_status plan_of(const lcase *c, int rank, uly_dtype t, uly_plan *p) {
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = c->P, d.rank = rank, d.sp_size = c->P;
    d.batch = c->B, d.seq_len = c->S, d.n_heads = c->H, d.n_kv_heads = c->Hkv;
    d.head_dim = c->D, d.dtype = t;
    return uly_plan_init(p, &d);
}

static void check_one(const lcase *c, int rank, uly_dtype t, uly_xchg x, int unpack, form f) {
    uly_plan p;
    uly_status st = plan_of(c, rank, t, &p);
    CHECK(!st.code, "plan: %s", st.msg);
    if (st.code) return;

    const side sd = side_of(&p, c, rank, x, unpack);
    buf tb = buf_new(tensor_bytes(f, t, c->B, sd.s, sd.h, c->D, sd.nq, sd.nkv));
    buf xb = buf_new(unpack ? uly_recv_bytes(&p, x) : uly_send_bytes(&p, x));
    buf_fill(&tb, t, 7);
    buf_fill(&xb, t, 11);
    uly_tensor th = tensor_in(tb.host, f, t, c->B, sd.s, sd.h, c->D, sd.kv, sd.nq, sd.nkv);
    uly_tensor tg = tensor_in(tb.dev, f, t, c->B, sd.s, sd.h, c->D, sd.kv, sd.nq, sd.nkv);

    uly_layout cpu = uly_cpu_layout(), gpu = uly_cuda_layout();
    uly_status want, got;
    if (unpack) {
        got = gpu.unpack(gpu.ctx, &p, x, xb.dev, tg, NULL);
        want = cpu.unpack(cpu.ctx, &p, x, xb.host, th, NULL);
    } else {
        got = gpu.pack(gpu.ctx, &p, x, tg, xb.dev, NULL);
        want = cpu.pack(cpu.ctx, &p, x, th, xb.host, NULL);
    }
    cudaError_t e = cudaDeviceSynchronize();
    int64_t diff = buf_diff(unpack ? &tb : &xb);
    CHECK(!want.code && !got.code && !e && !diff,
          "%s %s, %s %s, P=%d rank %d B=%lld S=%lld H=%lld Hkv=%lld D=%lld: cpu '%s', gpu '%s', "
          "cuda '%s', %lld bytes differ", unpack ? "unpack" : "pack", xnames[x], dtype_name(t),
          form_names[f], c->P, rank, (long long)c->B, (long long)c->S, (long long)c->H,
          (long long)c->Hkv, (long long)c->D, want.msg, got.msg, cudaGetErrorString(e),
          (long long)diff);
    buf_free(&tb);
    buf_free(&xb);
}

/* Whether exchange x has a tensor of form f: the k view is KV's and DKV's only. */
static int has_form(uly_xchg x, form f) {
    return f != FUSED_K || x == ULY_X_KV || x == ULY_X_DKV;
}

static void check_sweep(int unpack, form f) {
    for (int i = 0; i < NCASES; i++)
        for (int r = 0; r < cases[i].P; r++)
            for (int t = 0; t < 3; t++)
                for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
                    if (has_form((uly_xchg)x, f))
                        check_one(&cases[i], r, dtypes[t], (uly_xchg)x, unpack, f);
}

TEST(pack_dense_matches_cpu) { check_sweep(0, DENSE); }
TEST(pack_fused_qkv_views_match_cpu) { check_sweep(0, FUSED); }
TEST(pack_fused_k_view_matches_cpu) { check_sweep(0, FUSED_K); }
TEST(pack_heads_outer_matches_cpu) { check_sweep(0, HEADS_OUTER); }
TEST(pack_shifted_views_match_cpu) { check_sweep(0, SHIFTED); }
TEST(unpack_dense_matches_cpu) { check_sweep(1, DENSE); }
TEST(unpack_into_fused_views_matches_cpu) { check_sweep(1, FUSED); }
TEST(unpack_into_fused_k_view_matches_cpu) { check_sweep(1, FUSED_K); }
TEST(unpack_heads_outer_matches_cpu) { check_sweep(1, HEADS_OUTER); }
TEST(unpack_into_shifted_views_matches_cpu) { check_sweep(1, SHIFTED); }

#ifdef ULY_EMU
/* ---------------------------------------------------------------------------------------------
   What a call asks of the device (the emulator's record, tests/emu/cuda_emu.h) */

/* The record of one GPU pack or unpack of exchange x on rank `rank`, on stream s (the sweep
   checks its bytes); *allocs: the allocations it made. */
static std::vector<uly_emu_op> record_one(const lcase *c, int rank, uly_dtype t, uly_xchg x,
                                          int unpack, form f, cudaStream_t s,
                                          unsigned long long *allocs) {
    uly_plan p;
    uly_status st = plan_of(c, rank, t, &p);
    CHECK(!st.code, "plan: %s", st.msg);
    const side sd = side_of(&p, c, rank, x, unpack);
    buf tb = buf_new(tensor_bytes(f, t, c->B, sd.s, sd.h, c->D, sd.nq, sd.nkv));
    buf xb = buf_new(unpack ? uly_recv_bytes(&p, x) : uly_send_bytes(&p, x));
    const uly_tensor tg = tensor_in(tb.dev, f, t, c->B, sd.s, sd.h, c->D, sd.kv, sd.nq, sd.nkv);
    const uly_layout gpu = uly_cuda_layout();
    uly_emu_record_reset();
    st = unpack ? gpu.unpack(gpu.ctx, &p, x, xb.dev, tg, s)
                : gpu.pack(gpu.ctx, &p, x, tg, xb.dev, s);
    const std::vector<uly_emu_op> ops = uly_emu_recorded_ops();
    *allocs = uly_emu_recorded_allocs();
    CHECK(!st.code && !cudaStreamSynchronize(s), "%s %s: '%s'", unpack ? "unpack" : "pack",
          xnames[x], st.msg);
    buf_free(&tb);
    buf_free(&xb);
    return ops;
}

/* f(record, allocations, what) for pack and unpack of every exchange (that has form fm) of
   every rank of case c, in dtype t, on stream s. */
template <typename F>
static void each_call(const lcase *c, uly_dtype t, form fm, cudaStream_t s, F f) {
    char what[96];
    for (int r = 0; r < c->P; r++)
        for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
            for (int unpack = 0; unpack < 2 && has_form((uly_xchg)x, fm); unpack++) {
                unsigned long long allocs;
                const std::vector<uly_emu_op> ops =
                    record_one(c, r, t, (uly_xchg)x, unpack, fm, s, &allocs);
                snprintf(what, sizeof what, "%s %s, %s %s, P=%d D=%lld rank %d",
                         unpack ? "unpack" : "pack", xnames[x], dtype_name(t), form_names[fm],
                         c->P, (long long)c->D, r);
                f(ops, allocs, what);
            }
}

/* P, B, S, H, Hkv, D: one kv head on both ranks, so the DKV unpack sums. With D = 16, rows of
   32 or 64 bytes and every offset a multiple of 16 bytes (in buffers cudaMalloc aligns); with
   D = 3, rows of 6 or 12 bytes. */
static const lcase aligned = {2, 1, 8, 4, 1, 16}, odd = {2, 1, 8, 4, 1, 3};

TEST(pack_and_unpack_queue_only_on_the_callers_stream) {
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");
    for (const lcase *c : {&aligned, &odd}) /* 16-byte and element accesses */
        each_call(c, ULY_BF16, DENSE, s,
                  [&](const std::vector<uly_emu_op> &ops, unsigned long long, const char *what) {
                      CHECK(!ops.empty(), "%s: nothing queued", what);
                      for (const uly_emu_op &op : ops)
                          CHECK(op.stream == s, "%s: %s on stream %p, not the caller's %p", what,
                                op.what, (void *)op.stream, (void *)s);
                  });
    cudaStreamDestroy(s);
}

TEST(pack_and_unpack_allocate_nothing) {
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");
    for (const lcase *c : {&aligned, &odd})
        each_call(c, ULY_BF16, DENSE, s,
                  [&](const std::vector<uly_emu_op> &, unsigned long long allocs,
                      const char *what) {
                      CHECK(allocs == 0, "%s: %llu allocations", what, allocs);
                  });
    cudaStreamDestroy(s);
}

/* Whether fn is uly__box_copy<T, W, mode> for some mode. */
template <typename T, int W> static bool is_box_copy_w(const void *fn) {
    return fn == (const void *)uly__box_copy<T, W, ULY__PACK> ||
           fn == (const void *)uly__box_copy<T, W, ULY__UNPACK> ||
           fn == (const void *)uly__box_copy<T, W, ULY__UNPACK_SUM>;
}

/* The same, W being `bytes` an access (one element where bytes is the element size). */
template <typename T> static bool is_box_copy(const void *fn, int bytes) {
    return bytes == 16  ? is_box_copy_w<T, 16 / sizeof(T)>(fn)
           : bytes == 8 ? is_box_copy_w<T, 8 / sizeof(T)>(fn)
           : bytes == 4 ? is_box_copy_w<T, 4 / sizeof(T)>(fn)
                        : is_box_copy_w<T, 1>(fn);
}

static bool is_box_copy(uly_dtype t, const void *fn, int bytes) {
    return t == ULY_F32    ? is_box_copy<float>(fn, bytes)
           : t == ULY_BF16 ? is_box_copy<__nv_bfloat16>(fn, bytes)
                           : is_box_copy<__half>(fn, bytes);
}

/* Every call of case c in form fm launches the box kernel of bytes[t] an access only, in
   dtypes[t] (f32, bf16, f16). */
static void check_access(const lcase *c, form fm, const int bytes[3]) {
    for (int t = 0; t < 3; t++)
        each_call(c, dtypes[t], fm, 0,
                  [&](const std::vector<uly_emu_op> &ops, unsigned long long, const char *what) {
                      CHECK(!ops.empty(), "%s: nothing launched", what);
                      for (const uly_emu_op &op : ops)
                          CHECK(is_box_copy(dtypes[t], op.kernel, bytes[t]), "%s: launched %s, "
                                "want the box kernel of %d-byte accesses", what, op.what, bytes[t]);
                  });
}

TEST(aligned_rows_take_16_byte_accesses) {
    const int b16[3] = {16, 16, 16};
    for (form fm : {DENSE, FUSED, FUSED_K, HEADS_OUTER}) check_access(&aligned, fm, b16);
}

/* Rows of D = 4 (16 bytes in f32, 8 in bf16 and f16) and D = 6 (24 and 12 bytes); a view one
   element in; D = 3 (12 bytes in f32, 6 in 16-bit). */
TEST(narrower_rows_and_misaligned_views_take_the_widest_access_they_allow) {
    const lcase d4 = {2, 1, 8, 4, 1, 4}, d6 = {2, 1, 8, 4, 1, 6};
    const int b4[3] = {16, 8, 8}, b6[3] = {8, 4, 4}, b_elem[3] = {4, 2, 2};
    check_access(&d4, DENSE, b4);
    check_access(&d6, DENSE, b6);
    check_access(&aligned, SHIFTED, b_elem);
    check_access(&odd, DENSE, b_elem);
}

/* The grid has a column per box with something to write. P = 4, MQA: every rank's DKV unpack
   sums the four copies of kv head 0, all in box 0, so one column (before, three of four columns
   of blocks exited at once). P = 4 with two kv heads, each on two ranks: boxes 0 and 2 write,
   two columns. Packs and plain unpacks: a column per peer. */
TEST(summing_unpack_launches_only_the_boxes_that_write) {
    const lcase mqa = {4, 3, 9, 4, 1, 3}, pairs = {4, 2, 13, 8, 2, 4};
    for (const lcase *c : {&mqa, &pairs})
        for (int r = 0; r < c->P; r++)
            for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
                for (int unpack = 0; unpack < 2; unpack++) {
                    unsigned long long allocs;
                    const std::vector<uly_emu_op> ops =
                        record_one(c, r, ULY_BF16, (uly_xchg)x, unpack, DENSE, 0, &allocs);
                    const unsigned want = x == ULY_X_DKV && unpack ? (unsigned)c->Hkv : 4u;
                    CHECK(ops.size() == 1 && ops[0].grid.y == want, "%s %s, Hkv=%lld rank %d: %zu "
                          "launches, grid.y %u, want one with %u", unpack ? "unpack" : "pack",
                          xnames[x], (long long)c->Hkv, r, ops.size(),
                          ops.empty() ? 0u : ops[0].grid.y, want);
                }
}
#endif

#ifdef ULY_EMU
/* 64-bit offsets, as in test_flash's offsets_past_int32: under the emulator device memory is host
   memory, so the tensor side of every exchange can lie in a sparse mapping with token rows 2^25
   elements apart: rank 1's 70 tokens (all 140 on the head side) span past 2^31 elements and
   batch 1 starts there. Heads adjacent (one merged row per token) or 2^12 apart. Pack reads the
   mapping and unpack writes it, bit for bit as uly_cpu_layout does. */
static char *far_map(size_t bytes) {
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    CHECK(m != MAP_FAILED, "mmap of %zu bytes", bytes);
    return m == MAP_FAILED ? NULL : (char *)m;
}

/* f(byte offset, bytes) for every row of t's view. */
template <typename F> static void far_rows(const uly_tensor &t, F f) {
    const int64_t es = uly_dtype_size(t.dtype);
    for (int64_t b = 0; b < t.b; b++)
        for (int64_t s = 0; s < t.s; s++)
            for (int64_t h = 0; h < t.h; h++) f((b * t.sb + s * t.ss + h * t.sh) * es, t.d * es);
}

TEST(offsets_past_int32) {
    const lcase c = {2, 2, 140, 4, 2, 8};
    uly_plan p;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 2, d.rank = 1, d.sp_size = 2, d.batch = c.B, d.seq_len = c.S;
    d.n_heads = c.H, d.n_kv_heads = c.Hkv, d.head_dim = c.D, d.dtype = ULY_BF16;
    uly_status st = uly_plan_init(&p, &d);
    CHECK(!st.code, "plan: %s", st.msg);
    if (st.code) return;
    const uly_layout cpu = uly_cpu_layout(), gpu = uly_cuda_layout();
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
        for (int unpack = 0; unpack < 2; unpack++)
            for (int64_t sh : {c.D, (int64_t)1 << 12}) {
                const side sd = side_of(&p, &c, 1, (uly_xchg)x, unpack);
                uly_tensor tg = uly_dense(NULL, ULY_BF16, c.B, sd.s, sd.h, c.D), th;
                tg.sh = sh, tg.ss = (int64_t)1 << 25, tg.sb = sd.s * tg.ss;
                const size_t bytes = (size_t)(c.B * tg.sb) * 2;
                char *gm = far_map(bytes), *cm = unpack ? far_map(bytes) : gm;
                if (!gm || !cm) return;
                tg.data = gm, th = tg, th.data = cm;
                buf xb = buf_new(unpack ? uly_recv_bytes(&p, (uly_xchg)x)
                                        : uly_send_bytes(&p, (uly_xchg)x));
                buf_fill(&xb, ULY_BF16, 11);
                ref_rng rng = ref_seed(5);
                if (!unpack)
                    far_rows(tg, [&](int64_t o, int64_t row) {
                        for (int64_t e = 0; e < row; e += 2) {
                            const __nv_bfloat16 v = __float2bfloat16_rn(ref_uniform(&rng));
                            memcpy(gm + o + e, &v, 2);
                        }
                    });
                const uly_status want = unpack ? cpu.unpack(cpu.ctx, &p, (uly_xchg)x, xb.host, th, NULL)
                                               : cpu.pack(cpu.ctx, &p, (uly_xchg)x, th, xb.host, NULL);
                const uly_status got = unpack ? gpu.unpack(gpu.ctx, &p, (uly_xchg)x, xb.dev, tg, NULL)
                                              : gpu.pack(gpu.ctx, &p, (uly_xchg)x, tg, xb.dev, NULL);
                int64_t diff = 0;
                if (unpack)
                    far_rows(tg, [&](int64_t o, int64_t row) {
                        diff += memcmp(gm + o, cm + o, (size_t)row) != 0;
                    });
                else
                    diff = buf_diff(&xb);
                CHECK(!want.code && !got.code && !diff, "%s %s, sh %lld: cpu '%s', gpu '%s', %lld %s differ",
                      unpack ? "unpack" : "pack", xnames[x], (long long)sh, want.msg, got.msg,
                      (long long)diff, unpack ? "rows" : "bytes");
                buf_free(&xb);
                munmap(gm, bytes);
                if (unpack) munmap(cm, bytes);
            }
}
#endif

/* The box kernel's stepping: a position advanced k times by the grid's stride (uly__pos_add)
   has the digits of the flat index start + k * stride (uly__pos_of). Each walk is one thread;
   the radices include 1 (a merged row) and strides past the whole box. */
typedef struct walk {
    int64_t nv, rows, nt, start, stride;
} walk;

__global__ void walk_positions(const walk *w, int n, int steps, int *bad) {
    const int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (t >= n) return;
    const walk c = w[t];
    const uly__pos d = uly__pos_of(c.stride, c.nv, c.rows, c.nt);
    uly__pos p = uly__pos_of(c.start, c.nv, c.rows, c.nt);
    int wrong = 0;
    for (int k = 1; k <= steps; k++) {
        uly__pos_add(p, d, c.nv, c.rows, c.nt);
        const uly__pos q = uly__pos_of(c.start + k * c.stride, c.nv, c.rows, c.nt);
        wrong += p.e != q.e || p.r != q.r || p.s != q.s || p.b != q.b;
    }
    bad[t] = wrong;
}

TEST(grid_stride_positions_carry) {
    enum { N = 512, STEPS = 64 };
    walk h[N];
    for (int i = 0; i < N; i++) {
        walk *c = &h[i];
        c->nv = 1 + (i * 13) % 200;
        c->rows = 1 + i % 5;
        c->nt = 1 + (i * 37) % 300;
        const int64_t box = c->nv * c->rows * c->nt;
        c->start = (i * 7919) % box;
        c->stride = 1 + (i * 104729) % (3 * box);
    }
    walk *dw;
    int *dbad, got[N];
    cudaMalloc((void **)&dw, sizeof h);
    cudaMalloc((void **)&dbad, sizeof got);
    cudaMemcpy(dw, h, sizeof h, cudaMemcpyHostToDevice);
    ULY_LAUNCH(walk_positions, N / 128, 128, 0, 0, dw, (int)N, (int)STEPS, dbad);
    CHECK(cudaMemcpy(got, dbad, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess, "launch");
    for (int i = 0; i < N; i++)
        CHECK(got[i] == 0, "nv %lld rows %lld nt %lld start %lld stride %lld: %d of %d steps wrong",
              (long long)h[i].nv, (long long)h[i].rows, (long long)h[i].nt, (long long)h[i].start,
              (long long)h[i].stride, got[i], (int)STEPS);
    cudaFree(dw), cudaFree(dbad);
}

/* Boxes larger than the grid (2048 / P blocks of 256 threads per peer): each thread strides
   over several accesses. With D = 97 (the element path) and two heads per peer, the grid's
   stride of 65536 accesses has a nonzero digit in every place of a box (61 elements, 1 head
   row, 81 tokens, 1 batch), so a thread's position carries through all of them. */
TEST(boxes_larger_than_the_grid) {
    const lcase c = {8, 2, 2048, 16, 16, 97};
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
        for (int unpack = 0; unpack < 2; unpack++)
            check_one(&c, 3, ULY_F32, (uly_xchg)x, unpack, HEADS_OUTER);
}

/* ---------------------------------------------------------------------------------------------
   Bad input: an error that names what is wrong, and nothing launched */

typedef struct bad {
    uly_plan p;
    buf t, x;
    uly_tensor q; /* [B, S_r, H, D] on the device: the source of pack Q */
} bad;

static bad bad_new(void) {
    bad b;
    uly_plan_desc d;
    memset(&d, 0, sizeof d);
    d.world_size = 2, d.rank = 1, d.sp_size = 2, d.batch = 1, d.seq_len = 8, d.n_heads = 4;
    d.head_dim = 8, d.dtype = ULY_BF16;
    uly_status st = uly_plan_init(&b.p, &d);
    CHECK(!st.code, "plan: %s", st.msg);
    b.t = buf_new(4 * 4 * 8 * 2 + 2);
    b.x = buf_new(uly_send_bytes(&b.p, ULY_X_Q) + 2);
    b.q = uly_dense(b.t.dev, ULY_BF16, 1, 4, 4, 8);
    return b;
}

static void bad_free(bad *b) {
    buf_free(&b->t);
    buf_free(&b->x);
}

static void check_rejects(uly_status st, uly_code code, const char *words) {
    CHECK(st.code == code && strstr(st.msg, words), "code %d, message '%s', want code %d and '%s'",
          (int)st.code, st.msg, (int)code, words);
}

TEST(rejects_null_tensor) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    b.q.data = NULL;
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, b.x.dev, NULL), ULY_EINVAL,
                  "pack Q: src: data is NULL");
    check_rejects(l.unpack(l.ctx, &b.p, ULY_X_O, b.x.dev, b.q, NULL), ULY_EINVAL,
                  "unpack O: dst: data is NULL");
    bad_free(&b);
}

TEST(rejects_null_exchange_buffer) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, NULL, NULL), ULY_EINVAL, "pack Q: send");
    check_rejects(l.unpack(l.ctx, &b.p, ULY_X_O, NULL, b.q, NULL), ULY_EINVAL, "unpack O: recv");
    bad_free(&b);
}

TEST(rejects_pointers_off_the_element_size) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    uly_tensor odd = b.q;
    odd.data = b.t.dev + 1;
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, odd, b.x.dev, NULL), ULY_EINVAL,
                  "not aligned to its element size");
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, b.x.dev + 1, NULL), ULY_EINVAL,
                  "not aligned to the element size");
    bad_free(&b);
}

TEST(rejects_a_tensor_the_plan_does_not_describe) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    uly_tensor wrong = uly_dense(b.t.dev, ULY_BF16, 1, 3, 4, 8); /* rank 1 owns 4 tokens */
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, wrong, b.x.dev, NULL), ULY_EINVAL,
                  "shape [1, 3, 4, 8], want [1, 4, 4, 8]");
    wrong = uly_dense(b.t.dev, ULY_F16, 1, 4, 4, 8);
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, wrong, b.x.dev, NULL), ULY_EINVAL,
                  "dtype f16, want bf16");
    bad_free(&b);
}

TEST(rejects_an_uninitialized_plan_or_exchange) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    uly_plan zero;
    memset(&zero, 0, sizeof zero);
    check_rejects(l.pack(l.ctx, &zero, ULY_X_Q, b.q, b.x.dev, NULL), ULY_EINVAL, "plan");
    check_rejects(l.pack(l.ctx, &b.p, (uly_xchg)7, b.q, b.x.dev, NULL), ULY_EINVAL,
                  "x (7) is not a uly_xchg");
    bad_free(&b);
}

int main(void) { return uly_run_tests(); }
