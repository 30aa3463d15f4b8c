/* test_cuda_layout.cu - the layout kernels of ulysses_cuda.cuh, and uly_cpu_layout, against the
   layout formulas of ulysses.h.

   The expected bytes are the formulas of ulysses.h (LAYOUTS, and the Layout section) worked
   out here one element at a time (formula_move): peer j's block of the exchange buffer dense,
   blocks in peer order where the plan's exchange counts put them, each element at the address
   formed here from the tensor's strides; the DKV unpack adds the copies of a kv head several
   peers hold in fp32, in peer order, and rounds once. Of the library it uses only the plan's
   ranges (uly_tokens, uly_heads, uly_kv_heads, which test_plan checks against formulas of its
   own) and counts, and the tensor views are built here by hand (not by uly_dense or
   uly_qkv_views), so a stride that both implementations misread the same way fails here
   instead of agreeing with itself.

   Every pack and unpack of every exchange, on every rank of a sweep of plans (uneven S and H,
   GQA with Hkv < P so kv heads are replicated, B > 1, rows whose bytes are not a multiple of
   16), in each dtype: the CUDA kernels and uly_cpu_layout each equal the formulas bit for bit
   over the whole destination buffer, so nothing outside the box moves either. Tensors come in
   five forms: dense, the q or v view into a fused QKV buffer, its k view (KV and DKV only; the
   fused forms are the views uly_qkv_views gives), heads-outer strides (rows that cannot be
   merged), and dense shifted by one element. That includes the DKV unpack's sums of the
   gradient copies of a shared kv head in bf16 and f16. Under the emulator, which records what a
   call asks of the device: pack and unpack queue their work on the caller's stream only and
   allocate nothing, and they launch the kernel of 16-byte accesses where rows and buffers are
   16-byte aligned, of 8 or 4 bytes where those are the widest they allow, of single elements
   otherwise; and offsets past int32 (again against the formulas). A block past 2^31 elements
   (on a GPU with the memory). Then the bad inputs, each a named error. Builds under the CUDA
   emulator (make test) and with nvcc for a GPU (make test-gpu). */
#include "emu/cuda_emu.h"
/* A private copy (ULYSSES_STATIC): the compiler then drops the attention kernels, which this
   program never calls and which are most of its build otherwise. */
#define ULYSSES_STATIC
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "ref64.h"

#include <vector>
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
    {2, 2, 5, 8, 4, 8},   /* fewer tokens than heads a rank: S_r = 3, 2 and H_r = 4 */
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
   The formulas: every exchange, one element at a time */

/* An element of dtype t as fp32, and back rounded to nearest (the CUDA conversions). */
static float load(uly_dtype t, const char *x) {
    float f;
    __nv_bfloat16 b;
    __half h;
    if (t == ULY_F32) return memcpy(&f, x, 4), f;
    if (t == ULY_BF16) return memcpy(&b, x, 2), __bfloat162float(b);
    return memcpy(&h, x, 2), __half2float(h);
}

static void store(uly_dtype t, char *x, float f) {
    if (t == ULY_F32) {
        memcpy(x, &f, 4);
    } else if (t == ULY_BF16) {
        const __nv_bfloat16 b = __float2bfloat16_rn(f);
        memcpy(x, &b, 2);
    } else {
        const __half h = __float2half_rn(f);
        memcpy(x, &h, 2);
    }
}

/* Element (b, s, h, e) of t, from its strides alone. */
static char *elem(const uly_tensor &t, int64_t b, int64_t s, int64_t h, int64_t e) {
    return (char *)t.data + (b * t.sb + s * t.ss + h * t.sh + e) * uly_dtype_size(t.dtype);
}

/* The heads exchange x moves for an SP rank: its query heads, or for KV and DKV its kv heads. */
static uly_range xheads(const uly_plan *p, uly_xchg x, int rank) {
    return x == ULY_X_KV || x == ULY_X_DKV ? uly_kv_heads(p, rank) : uly_heads(p, rank);
}

/* Exchange x between tensor t and buffer xb on p's rank r. Peer j's block of xb is dense
   [B, n_s, n_h, D], blocks in peer order. Where t is in sequence layout (pack Q/KV, unpack O/DKV)
   the block is r's tokens of j's heads: its (b, s, h, e) is t's (b, s, h0_j + h, e); in head
   layout it is j's tokens of r's heads: t's (b, s0_j + s, h, e). Pack copies blocks out of t,
   unpack into t, where an element that several blocks hold (a kv head several peers hold, in
   DKV) is their sum in fp32 in peer order, rounded once. The blocks must also be where the
   plan's exchange counts put them, or the all-to-all moves other bytes. */
static void formula_move(const uly_plan *p, uly_xchg x, int unpack, uly_tensor t, char *xb) {
    const int P = p->desc.sp_size, r = p->sp_rank;
    const int seq = (x == ULY_X_Q || x == ULY_X_KV) != unpack;
    const int64_t B = p->desc.batch, D = p->desc.head_dim, es = uly_dtype_size(t.dtype);
    int64_t counts[2][ULY_MAX_SP], offs[2][ULY_MAX_SP]; /* send, recv */
    const uly_status st = uly_exchange_counts(p, x, counts[0], offs[0], counts[1], offs[1]);
    CHECK(!st.code, "exchange counts: %s", st.msg);
    std::vector<float> sum(unpack ? (size_t)(t.b * t.s * t.h * t.d) : 0);
    std::vector<char> seen(sum.size());
    char *at = xb;
    for (int j = 0; j < P; j++) {
        const uly_range tok = uly_tokens(p, seq ? r : j), hx = xheads(p, x, seq ? j : r);
        const int64_t s0 = seq ? 0 : tok.start, h0 = seq ? hx.start : 0;
        CHECK(at - xb == offs[unpack][j] && B * tok.count * hx.count * D * es == counts[unpack][j],
              "%s %s, block %d: at byte %lld, %lld bytes; the plan says %lld, %lld",
              unpack ? "unpack" : "pack", xnames[x], j, (long long)(at - xb),
              (long long)(B * tok.count * hx.count * D * es), (long long)offs[unpack][j],
              (long long)counts[unpack][j]);
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = s0; s < s0 + tok.count; s++)
                for (int64_t h = h0; h < h0 + hx.count; h++)
                    for (int64_t e = 0; e < D; e++, at += es) {
                        char *te = elem(t, b, s, h, e);
                        const size_t i = (size_t)(((b * t.s + s) * t.h + h) * t.d + e);
                        if (!unpack) {
                            memcpy(at, te, (size_t)es);
                        } else if (!seen[i]) {
                            memcpy(te, at, (size_t)es);
                            sum[i] = load(t.dtype, at), seen[i] = 1;
                        } else {
                            sum[i] += load(t.dtype, at);
                            store(t.dtype, te, sum[i]);
                        }
                    }
    }
}

static uly_status formula_pack(void *, const uly_plan *p, uly_xchg x, uly_tensor src, void *send,
                               void *) {
    formula_move(p, x, 0, src, (char *)send);
    return uly_status{};
}

static uly_status formula_unpack(void *, const uly_plan *p, uly_xchg x, const void *recv,
                                 uly_tensor dst, void *) {
    formula_move(p, x, 1, dst, (char *)recv); /* only read */
    return uly_status{};
}

/* The three implementations compared, each with its own copy of every buffer: the formulas (the
   expected bytes), uly_cpu_layout (host memory) and the kernels (device memory). */
enum impl { WANT, CPU, GPU, NIMPL };

static uly_layout layout_of(int i) {
    if (i == CPU) return uly_cpu_layout();
    if (i == GPU) return uly_cuda_layout();
    uly_layout l;
    l.pack = formula_pack, l.unpack = formula_unpack, l.ctx = NULL, l.device = 0;
    return l;
}

/* Pack t into xb, or unpack xb into t, with layout l on stream s. */
static uly_status layout_move(uly_layout l, const uly_plan *p, uly_xchg x, int unpack,
                              uly_tensor t, char *xb, cudaStream_t s) {
    return unpack ? l.unpack(l.ctx, p, x, xb, t, s) : l.pack(l.ctx, p, x, t, xb, s);
}

/* ---------------------------------------------------------------------------------------------
   Buffers: a copy of the same bytes for each implementation */

typedef struct buf {
    char *at[NIMPL];
    int64_t bytes;
} buf;

static buf buf_new(int64_t bytes) {
    buf b;
    b.bytes = bytes;
    b.at[WANT] = (char *)malloc((size_t)bytes);
    b.at[CPU] = (char *)malloc((size_t)bytes);
    CHECK(cudaMalloc((void **)&b.at[GPU], (size_t)bytes) == cudaSuccess, "cudaMalloc %lld",
          (long long)bytes);
    return b;
}

static void buf_free(buf *b) {
    free(b->at[WANT]);
    free(b->at[CPU]);
    cudaFree(b->at[GPU]);
}

/* Random finite values of dtype t, the same in every copy. */
static void buf_fill(buf *b, uly_dtype t, uint64_t seed) {
    ref_rng r = ref_seed(seed);
    int64_t es = uly_dtype_size(t);
    for (int64_t i = 0; i + es <= b->bytes; i += es) store(t, b->at[WANT] + i, ref_uniform(&r));
    memcpy(b->at[CPU], b->at[WANT], (size_t)b->bytes);
    cudaMemcpy(b->at[GPU], b->at[WANT], (size_t)b->bytes, cudaMemcpyHostToDevice);
}

/* Bytes where implementation i's copy differs from the expected one. */
static int64_t buf_diff(const buf *b, int i) {
    std::vector<char> dev(i == GPU ? (size_t)b->bytes : 0);
    if (i == GPU)
        CHECK(cudaMemcpy(dev.data(), b->at[GPU], dev.size(), cudaMemcpyDeviceToHost) ==
                  cudaSuccess, "cudaMemcpy back");
    const char *got = i == GPU ? dev.data() : b->at[i];
    int64_t n = 0;
    for (int64_t k = 0; k < b->bytes; k++) n += got[k] != b->at[WANT][k];
    return n;
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

/* The [B, sd.s, sd.h, D] tensor of form f in base (any copy). Its strides are set here, not by
   the library's view helpers, so that the formulas address it on their own. A fused form is a
   view into [B, sd.s, nq + 2 * nkv, D]: its q heads (Q, O), or its v or k heads (KV, DKV). */
static uly_tensor tensor_in(char *base, form f, uly_dtype t, const lcase *c, const side &sd) {
    const int fused = f == FUSED || f == FUSED_K;
    const int64_t row = fused ? sd.nq + 2 * sd.nkv : sd.h; /* heads in a token's row */
    const int64_t h0 = !fused || !sd.kv ? 0 : f == FUSED_K ? sd.nq : sd.nq + sd.nkv;
    uly_tensor x;
    x.data = base + (h0 * c->D + (f == SHIFTED)) * uly_dtype_size(t);
    x.b = c->B, x.s = sd.s, x.h = sd.h, x.d = c->D;
    x.sh = c->D, x.ss = row * c->D, x.sb = sd.s * x.ss;
    if (f == HEADS_OUTER) x.ss = c->D, x.sh = sd.s * c->D, x.sb = sd.h * x.sh;
    x.dtype = t;
    return x;
}

/* Bytes of the buffer behind tensor_in. */
static int64_t tensor_bytes(form f, uly_dtype t, const lcase *c, const side &sd) {
    int64_t heads = f == FUSED || f == FUSED_K ? sd.nq + 2 * sd.nkv : sd.h + (f == SHIFTED);
    return c->B * sd.s * heads * c->D * uly_dtype_size(t);
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
    const uly_status ps = plan_of(c, rank, t, &p);
    CHECK(!ps.code, "plan: %s", ps.msg);
    if (ps.code) return;

    const side sd = side_of(&p, c, rank, x, unpack);
    buf tb = buf_new(tensor_bytes(f, t, c, sd));
    buf xb = buf_new(unpack ? uly_recv_bytes(&p, x) : uly_send_bytes(&p, x));
    buf_fill(&tb, t, 7);
    buf_fill(&xb, t, 11);
    uly_status st[NIMPL];
    for (int i = 0; i < NIMPL; i++) {
        const uly_tensor ti = tensor_in(tb.at[i], f, t, c, sd);
        st[i] = layout_move(layout_of(i), &p, x, unpack, ti, xb.at[i], 0);
    }
    const cudaError_t e = cudaDeviceSynchronize();
    const buf *out = unpack ? &tb : &xb;
    const int64_t cpu = buf_diff(out, CPU), gpu = buf_diff(out, GPU);
    CHECK(!st[CPU].code && !st[GPU].code && !e && !cpu && !gpu,
          "%s %s, %s %s, P=%d rank %d B=%lld S=%lld H=%lld Hkv=%lld D=%lld: cpu '%s', gpu '%s', "
          "cuda '%s'; %lld bytes of cpu, %lld of gpu differ from the formulas",
          unpack ? "unpack" : "pack", xnames[x], dtype_name(t), form_names[f], c->P, rank,
          (long long)c->B, (long long)c->S, (long long)c->H, (long long)c->Hkv, (long long)c->D,
          st[CPU].msg, st[GPU].msg, cudaGetErrorString(e), (long long)cpu, (long long)gpu);
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

TEST(pack_dense_follows_the_formulas) { check_sweep(0, DENSE); }
TEST(pack_fused_qkv_views_follow_the_formulas) { check_sweep(0, FUSED); }
TEST(pack_fused_k_view_follows_the_formulas) { check_sweep(0, FUSED_K); }
TEST(pack_heads_outer_follows_the_formulas) { check_sweep(0, HEADS_OUTER); }
TEST(pack_shifted_views_follow_the_formulas) { check_sweep(0, SHIFTED); }
TEST(unpack_dense_follows_the_formulas) { check_sweep(1, DENSE); }
TEST(unpack_into_fused_views_follows_the_formulas) { check_sweep(1, FUSED); }
TEST(unpack_into_fused_k_view_follows_the_formulas) { check_sweep(1, FUSED_K); }
TEST(unpack_heads_outer_follows_the_formulas) { check_sweep(1, HEADS_OUTER); }
TEST(unpack_into_shifted_views_follows_the_formulas) { check_sweep(1, SHIFTED); }

static int same_view(const uly_tensor &a, const uly_tensor &b) {
    return a.data == b.data && a.b == b.b && a.s == b.s && a.h == b.h && a.d == b.d &&
           a.sb == b.sb && a.ss == b.ss && a.sh == b.sh && a.dtype == b.dtype;
}

/* The fused forms tested are what a trainer gets: uly_qkv_views of the same buffer. */
TEST(fused_forms_are_uly_qkv_views) {
    const lcase c = {1, 2, 5, 6, 2, 16};
    const side q = {0, c.S, c.H, c.H, c.Hkv}, kv = {1, c.S, c.Hkv, c.H, c.Hkv};
    std::vector<char> base((size_t)tensor_bytes(FUSED, ULY_BF16, &c, q));
    uly_tensor got[3];
    uly_qkv_views(base.data(), ULY_BF16, c.B, c.S, c.H, c.Hkv, c.D, &got[0], &got[1], &got[2]);
    const uly_tensor want[3] = {tensor_in(base.data(), FUSED, ULY_BF16, &c, q),
                                tensor_in(base.data(), FUSED_K, ULY_BF16, &c, kv),
                                tensor_in(base.data(), FUSED, ULY_BF16, &c, kv)};
    for (int i = 0; i < 3; i++)
        CHECK(same_view(got[i], want[i]), "the %c view: at +%lld, strides %lld %lld %lld; want "
              "+%lld, %lld %lld %lld", "qkv"[i], (long long)((char *)got[i].data - base.data()),
              (long long)got[i].sb, (long long)got[i].ss, (long long)got[i].sh,
              (long long)((char *)want[i].data - base.data()), (long long)want[i].sb,
              (long long)want[i].ss, (long long)want[i].sh);
}

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
    buf tb = buf_new(tensor_bytes(f, t, c, sd));
    buf xb = buf_new(unpack ? uly_recv_bytes(&p, x) : uly_send_bytes(&p, x));
    const uly_tensor tg = tensor_in(tb.at[GPU], f, t, c, sd);
    uly_emu_record_reset();
    st = layout_move(uly_cuda_layout(), &p, x, unpack, tg, xb.at[GPU], s);
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
           fn == (const void *)uly__box_copy<T, W, ULY__PACK_FAN> ||
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

/* The grid has a column per box with something to do. P = 4, MQA: every rank's KV pack writes
   the four copies of kv head 0 and its DKV unpack sums them, all from box 0, so one column
   (before, three of four columns of blocks exited at once). P = 4 with two kv heads, each on
   two ranks: boxes 0 and 2, two columns. The other packs and unpacks: a column per peer. */
TEST(shared_heads_launch_only_the_boxes_that_copy) {
    const lcase mqa = {4, 3, 9, 4, 1, 3}, pairs = {4, 2, 13, 8, 2, 4};
    for (const lcase *c : {&mqa, &pairs})
        for (int r = 0; r < c->P; r++)
            for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
                for (int unpack = 0; unpack < 2; unpack++) {
                    unsigned long long allocs;
                    const std::vector<uly_emu_op> ops =
                        record_one(c, r, ULY_BF16, (uly_xchg)x, unpack, DENSE, 0, &allocs);
                    const bool shared = x == (unpack ? ULY_X_DKV : ULY_X_KV);
                    const unsigned want = shared ? (unsigned)c->Hkv : 4u;
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
   mapping and unpack writes it, and uly_cpu_layout and the kernels each follow the formulas bit for
   bit. */
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
    const uly_status ps = plan_of(&c, 1, ULY_BF16, &p);
    CHECK(!ps.code, "plan: %s", ps.msg);
    if (ps.code) return;
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
        for (int unpack = 0; unpack < 2; unpack++)
            for (int64_t sh : {c.D, (int64_t)1 << 12}) {
                const side sd = side_of(&p, &c, 1, (uly_xchg)x, unpack);
                uly_tensor t = tensor_in(NULL, DENSE, ULY_BF16, &c, sd);
                t.sh = sh, t.ss = (int64_t)1 << 25, t.sb = sd.s * t.ss;
                const size_t bytes = (size_t)(c.B * t.sb) * 2;
                const int maps = unpack ? NIMPL : 1; /* pack only reads the tensor: one for all */
                char *m[NIMPL];
                for (int i = 0; i < NIMPL; i++) m[i] = i < maps ? far_map(bytes) : m[0];
                if (!m[WANT] || !m[CPU] || !m[GPU]) return;
                buf xb = buf_new(unpack ? uly_recv_bytes(&p, (uly_xchg)x)
                                        : uly_send_bytes(&p, (uly_xchg)x));
                buf_fill(&xb, ULY_BF16, 11);
                ref_rng rng = ref_seed(5);
                if (!unpack)
                    far_rows(t, [&](int64_t o, int64_t row) {
                        for (int64_t e = 0; e < row; e += 2)
                            store(ULY_BF16, m[0] + o + e, ref_uniform(&rng));
                    });
                uly_status st[NIMPL];
                for (int i = 0; i < NIMPL; i++) {
                    t.data = m[i];
                    st[i] = layout_move(layout_of(i), &p, (uly_xchg)x, unpack, t, xb.at[i], 0);
                }
                const cudaError_t e = cudaDeviceSynchronize();
                int64_t diff[NIMPL] = {0, 0, 0};
                for (int i = CPU; i < NIMPL; i++) {
                    if (!unpack) diff[i] = buf_diff(&xb, i);
                    else
                        far_rows(t, [&](int64_t o, int64_t row) {
                            diff[i] += memcmp(m[i] + o, m[WANT] + o, (size_t)row) != 0;
                        });
                }
                CHECK(!st[CPU].code && !st[GPU].code && !e && !diff[CPU] && !diff[GPU],
                      "%s %s, sh %lld: cpu '%s', gpu '%s', cuda '%s'; %lld %s of cpu, %lld of "
                      "gpu differ from the formulas", unpack ? "unpack" : "pack", xnames[x],
                      (long long)sh, st[CPU].msg, st[GPU].msg, cudaGetErrorString(e),
                      (long long)diff[CPU], unpack ? "rows" : "bytes", (long long)diff[GPU]);
                buf_free(&xb);
                for (int i = 0; i < maps; i++) munmap(m[i], bytes);
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
    b.q = uly_dense(b.t.at[GPU], ULY_BF16, 1, 4, 4, 8);
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
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, b.x.at[GPU], NULL), ULY_EINVAL,
                  "pack Q: src: data is NULL");
    check_rejects(l.unpack(l.ctx, &b.p, ULY_X_O, b.x.at[GPU], b.q, NULL), ULY_EINVAL,
                  "unpack O: dst: data is NULL");
    bad_free(&b);
}

/* A kv head with one copy keeps its bits in the DKV unpack, NaN payload included, as the CPU
   layout does; copies that are summed give the canonical NaN. P 2, H 6, Hkv 3, rank 0: kv
   heads 0 and 2 have one copy each, kv head 1 one from each rank. */
TEST(dkv_unpack_keeps_a_lone_copys_nan_payload_as_the_cpu_layout) {
    const lcase c = {2, 1, 4, 6, 3, 8};
    uly_plan p;
    CHECK(!plan_of(&c, 0, ULY_BF16, &p).code, "plan");
    uly_tensor v = tensor_in(NULL, DENSE, ULY_BF16, &c, side_of(&p, &c, 0, ULY_X_DKV, 1));
    buf tb = buf_new(c.B * v.sb * 2), xb = buf_new(uly_recv_bytes(&p, ULY_X_DKV));
    const std::vector<uint16_t> nan((size_t)xb.bytes / 2, 0x7f81);
    memcpy(xb.at[CPU], nan.data(), (size_t)xb.bytes);
    cudaMemcpy(xb.at[GPU], nan.data(), (size_t)xb.bytes, cudaMemcpyHostToDevice);
    for (int i = CPU; i <= GPU; i++) {
        v.data = tb.at[i];
        const uly_status st = layout_move(layout_of(i), &p, ULY_X_DKV, 1, v, xb.at[i], 0);
        CHECK(!st.code, "%s: %s", i == CPU ? "cpu" : "gpu", st.msg);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "the unpack failed");
    memcpy(tb.at[WANT], tb.at[CPU], (size_t)tb.bytes);
    int64_t lone = 0, summed = 0;
    for (int64_t i = 0; i < tb.bytes / 2; i++) {
        uint16_t h;
        memcpy(&h, tb.at[CPU] + 2 * i, 2);
        lone += h == 0x7f81, summed += h == 0x7fff;
    }
    const int64_t differ = buf_diff(&tb, GPU);
    CHECK(lone && summed && !differ, "cpu: %lld lone copies kept, %lld sums canonical; %lld bytes "
          "of the gpu layout's differ", (long long)lone, (long long)summed, (long long)differ);
    buf_free(&tb);
    buf_free(&xb);
}

#ifdef ULY_EMU
/* A launch that fails is ULY_ECUDA, not success: here the thread's last error, from an invalid
   attribute, is what the emulator's launch check reads. */
TEST(a_failed_launch_is_ecuda) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    cudaFuncSetAttribute((const void *)uly__ref_fwd<float>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, -1);
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, b.x.at[GPU], NULL), ULY_ECUDA,
                  "layout kernel launch");
    (void)cudaGetLastError();
    bad_free(&b);
}
#endif

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
    odd.data = b.t.at[GPU] + 1;
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, odd, b.x.at[GPU], NULL), ULY_EINVAL,
                  "not aligned to its element size");
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, b.q, b.x.at[GPU] + 1, NULL), ULY_EINVAL,
                  "not aligned to the element size");
    bad_free(&b);
}

TEST(rejects_a_tensor_the_plan_does_not_describe) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    uly_tensor wrong = uly_dense(b.t.at[GPU], ULY_BF16, 1, 3, 4, 8); /* rank 1 owns 4 tokens */
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, wrong, b.x.at[GPU], NULL), ULY_EINVAL,
                  "shape [1, 3, 4, 8], want [1, 4, 4, 8]");
    wrong = uly_dense(b.t.at[GPU], ULY_F16, 1, 4, 4, 8);
    check_rejects(l.pack(l.ctx, &b.p, ULY_X_Q, wrong, b.x.at[GPU], NULL), ULY_EINVAL,
                  "dtype f16, want bf16");
    bad_free(&b);
}

TEST(rejects_an_uninitialized_plan_or_exchange) {
    bad b = bad_new();
    uly_layout l = uly_cuda_layout();
    uly_plan zero;
    memset(&zero, 0, sizeof zero);
    check_rejects(l.pack(l.ctx, &zero, ULY_X_Q, b.q, b.x.at[GPU], NULL), ULY_EINVAL, "plan");
    check_rejects(l.pack(l.ctx, &b.p, (uly_xchg)7, b.q, b.x.at[GPU], NULL), ULY_EINVAL,
                  "x (7) is not a uly_xchg");
    bad_free(&b);
}

#ifdef ULY_EMU
/* The access width reads every stride and both pointers, not only D: a view whose batch or token
   stride is padded by one element, or an exchange buffer one element in (both valid: only element
   alignment is asked), with D = 16 and a 16-byte aligned tensor base, takes single-element
   accesses, and still follows the formulas bit for bit. */
static void check_padded(const lcase *c, int rank, uly_dtype t, uly_xchg x, int unpack,
                         int64_t pad_sb, int64_t pad_ss, int64_t buf_shift, int64_t pad_sh = 0,
                         int want_bytes = 0 /* the element size */) {
    uly_plan p;
    const uly_status ps = plan_of(c, rank, t, &p);
    CHECK(!ps.code, "plan: %s", ps.msg);
    if (ps.code) return;
    const int64_t es = uly_dtype_size(t);
    const side sd = side_of(&p, c, rank, x, unpack);
    uly_tensor v = tensor_in(NULL, DENSE, t, c, sd);
    v.sh += pad_sh, v.ss = v.h * v.sh + pad_ss, v.sb = sd.s * v.ss + pad_sb;
    buf tb = buf_new(c->B * v.sb * es);
    buf xb = buf_new((unpack ? uly_recv_bytes(&p, x) : uly_send_bytes(&p, x)) + buf_shift * es);
    buf_fill(&tb, t, 7);
    buf_fill(&xb, t, 11);
    uly_status st[NIMPL];
    std::vector<uly_emu_op> ops;
    for (int i = 0; i < NIMPL; i++) {
        v.data = tb.at[i];
        if (i == GPU) uly_emu_record_reset();
        st[i] = layout_move(layout_of(i), &p, x, unpack, v, xb.at[i] + buf_shift * es, 0);
        if (i == GPU) ops = uly_emu_recorded_ops();
    }
    const cudaError_t e = cudaDeviceSynchronize();
    const buf *out = unpack ? &tb : &xb;
    const int64_t cpu = buf_diff(out, CPU), gpu = buf_diff(out, GPU);
    CHECK(!st[CPU].code && !st[GPU].code && !e && !cpu && !gpu,
          "%s %s, %s, rank %d, pad sb %lld ss %lld buf %lld: cpu '%s', gpu '%s', cuda '%s'; %lld "
          "bytes of cpu, %lld of gpu differ from the formulas", unpack ? "unpack" : "pack",
          xnames[x], dtype_name(t), rank, (long long)pad_sb, (long long)pad_ss,
          (long long)buf_shift, st[CPU].msg, st[GPU].msg, cudaGetErrorString(e), (long long)cpu,
          (long long)gpu);
    CHECK(!ops.empty(), "%s %s: nothing launched", unpack ? "unpack" : "pack", xnames[x]);
    const int bytes = want_bytes ? want_bytes : (int)es;
    for (const uly_emu_op &op : ops)
        CHECK(is_box_copy(t, op.kernel, bytes), "%s %s, %s, pad sb %lld ss %lld sh %lld buf %lld: "
              "launched %s, want the box kernel of %d-byte accesses", unpack ? "unpack" : "pack",
              xnames[x], dtype_name(t), (long long)pad_sb, (long long)pad_ss, (long long)pad_sh,
              (long long)buf_shift, op.what, bytes);
    buf_free(&tb);
    buf_free(&xb);
}

TEST(padded_strides_and_shifted_buffers_take_element_accesses) {
    const lcase c = {2, 2, 8, 4, 1, 16}; /* 16-byte aligned rows; the DKV unpack sums */
    for (int r = 0; r < c.P; r++)
        for (int t = 0; t < 3; t++)
            for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
                for (int unpack = 0; unpack < 2; unpack++) {
                    check_padded(&c, r, dtypes[t], (uly_xchg)x, unpack, 1, 0, 0);
                    check_padded(&c, r, dtypes[t], (uly_xchg)x, unpack, 0, 1, 0);
                    check_padded(&c, r, dtypes[t], (uly_xchg)x, unpack, 0, 0, 1);
                }
}

/* Heads padded apart (sh > D): no access wider than the head stride allows, nor than a row.
   D 16 with sh 17: element accesses. f32 D 2 with sh 4 (rows of 8 bytes, 16 apart): 8 bytes. */
TEST(padded_head_strides_take_the_accesses_they_allow) {
    const lcase c16 = {2, 2, 8, 4, 1, 16}, c2 = {2, 2, 8, 4, 1, 2};
    for (int r = 0; r < 2; r++)
        for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
            for (int unpack = 0; unpack < 2; unpack++) {
                for (int t = 0; t < 3; t++)
                    check_padded(&c16, r, dtypes[t], (uly_xchg)x, unpack, 0, 0, 0, 1);
                check_padded(&c2, r, ULY_F32, (uly_xchg)x, unpack, 0, 0, 0, 2, 8);
            }
}

/* A dim of extent 1 is only ever at index 0, so its stride narrows no access. P = 2, B = 1,
   S = 2, H = Hkv = 2: the sequence side is [1, 1, 2, 16] (one token a rank, decode-style), the
   head side [1, 2, 1, 16] (one head a rank). An odd sb, ss or sh (heads 17 apart with tokens 16
   apart: pad_ss -1) leaves 16-byte accesses where its dim has extent 1, element ones elsewhere. */
TEST(strides_of_dims_of_extent_1_leave_the_accesses_wide) {
    const lcase c = {2, 1, 2, 2, 2, 16};
    for (int r = 0; r < c.P; r++)
        for (int t = 0; t < 3; t++)
            for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
                for (int unpack = 0; unpack < 2; unpack++) {
                    const int seq = (x == ULY_X_Q || x == ULY_X_KV) != unpack;
                    const int es = (int)uly_dtype_size(dtypes[t]);
                    const uly_xchg xc = (uly_xchg)x;
                    check_padded(&c, r, dtypes[t], xc, unpack, 1, 0, 0, 0, 16);
                    check_padded(&c, r, dtypes[t], xc, unpack, 0, 1, 0, 0, seq ? 16 : es);
                    check_padded(&c, r, dtypes[t], xc, unpack, 0, -1, 0, 1, seq ? es : 16);
                }
}

/* The grid of boxes_larger_than_the_grid is at most ULY__COPY_BLOCKS blocks in all (columns
   share them), so the threads there do stride over their boxes. */
TEST(the_grid_shares_its_blocks_among_the_columns) {
    const lcase c = {8, 2, 2048, 16, 16, 97};
    for (int x = ULY_X_Q; x <= ULY_X_DKV; x++)
        for (int unpack = 0; unpack < 2; unpack++) {
            unsigned long long allocs;
            const std::vector<uly_emu_op> ops =
                record_one(&c, 3, ULY_F32, (uly_xchg)x, unpack, HEADS_OUTER, 0, &allocs);
            CHECK(ops.size() == 1 && (unsigned long long)ops[0].grid.x * ops[0].grid.y <=
                                         ULY__COPY_BLOCKS,
                  "%s %s: %zu launches, grid %u x %u, want one of at most %d blocks",
                  unpack ? "unpack" : "pack", xnames[x], ops.size(),
                  ops.empty() ? 0u : ops[0].grid.x, ops.empty() ? 0u : ops[0].grid.y,
                  (int)ULY__COPY_BLOCKS);
        }
}
#endif

/* x[e] = e % 251, integers exact in bf16. */
__global__ void fill_mod_251(__nv_bfloat16 *x, int64_t n) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += step)
        x[e] = __float2bfloat16((float)(e % 251));
}

/* A block of more than 2^31 elements: the Q pack of rank 0 of P = 2 with two heads of 128 sends
   each peer its S_0 tokens of one head, (2^24 + 2) * 128 elements on a GPU with 17 GB free
   (flat indices past 2^31 inside one box, where a 32-bit index would wrap); the emulator packs 10
   tokens, the formulas without the width. Element (s, d) of peer j's block is the tensor's
   (s, j, d), sampled at both ends of the tokens and around s * 128 = 2^31. */
TEST(a_block_past_2_31_elements_packs_by_the_formulas) {
#ifdef ULY_EMU
    const int64_t S0 = 10;
#else
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    const int64_t S0 = free_bytes > ((size_t)17 << 30) ? ((int64_t)1 << 24) + 2 : 10;
    if (S0 == 10) printf("   (%zu bytes free: a small block)\n", free_bytes);
#endif
    const lcase c = {2, 1, 2 * S0, 2, 2, 128};
    uly_plan p;
    const uly_status ps = plan_of(&c, 0, ULY_BF16, &p);
    CHECK(!ps.code, "plan: %s", ps.msg);
    if (ps.code) return;
    const int64_t n = S0 * 2 * 128, blk = S0 * 128;
    __nv_bfloat16 *src, *send;
    cudaMalloc((void **)&src, (size_t)n * 2), cudaMalloc((void **)&send, (size_t)n * 2);
    CHECK(src && send, "cudaMalloc of 2 x %lld elements", (long long)n);
    ULY_LAUNCH(fill_mod_251, 4096, 256, 0, 0, src, n);
    cudaMemset(send, 0xff, (size_t)n * 2);
    const uly_tensor t = {src, 1, S0, 2, 128, S0 * 256, 256, 128, ULY_BF16};
    const uly_layout l = uly_cuda_layout();
    const uly_status st = l.pack(l.ctx, &p, ULY_X_Q, t, send, NULL);
    CHECK(!st.code && cudaDeviceSynchronize() == cudaSuccess, "pack: %s", st.msg);
    const int64_t two24 = (int64_t)1 << 24;
    for (int64_t s : {(int64_t)0, S0 / 2, two24 - 1, two24, two24 + 1, S0 - 1})
        for (int j = 0; j < 2; j++)
            for (int64_t d : {0, 127}) {
                if (s >= S0) continue;
                __nv_bfloat16 got;
                cudaMemcpy(&got, send + j * blk + s * 128 + d, 2, cudaMemcpyDeviceToHost);
                const int want = (int)(((s * 2 + j) * 128 + d) % 251);
                CHECK(__bfloat162float(got) == (float)want,
                      "peer %d, token %lld, dim %lld: %g, want %d", j, (long long)s,
                      (long long)d, __bfloat162float(got), want);
            }
    cudaFree(src), cudaFree(send);
}

int main(void) { return uly_run_tests(); }
