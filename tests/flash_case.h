/* flash_case.h - the harness of the attention kernel tests (test_flash.cu, emulated and on a
   GPU; test_cublaslt.cu): cases, inputs rounded to the dtype and seeded by the case itself, the
   fp64 and plain-precision references, device tensors (dense or padded), one forward + backward
   run of a uly_attn, the accuracy rule, and the exact outputs of rows that keep no key. Include
   after ulysses_cuda.cuh (with its implementation) and check.h. */
#ifndef ULY_FLASH_CASE_H
#define ULY_FLASH_CASE_H

#include <algorithm>
#include <string>
#include <vector>

#include "ref64.h"

typedef std::vector<float> fvec;
typedef std::vector<double> dvec;

typedef struct fcase {
    int64_t B, Sq, Sk, H, Hkv, D;
    int causal;
    uly_dtype dt;
    int strided;       /* 0: dense tensors; 1: padded heads, rows and batches; OWN_STRIDES */
    int deterministic;
    int64_t q_head0, kv_group; /* 0, 0: whole tensors */
    float magnitude;   /* q and k uniform in [-magnitude, magnitude); 0 means 1 */
    float scale;       /* softmax_scale; 0 means 1/sqrt(D) */
} fcase;

/* fcase.strided: each of the eight tensors padded differently (dev_alloc's pads 1 to 8), so that
   no two share a stride: an attention that steps one tensor with another's strides reads padding
   (NaN) or other rows, or writes padding. */
enum { OWN_STRIDES = 2 };

static const char *dt_name(uly_dtype t) { return t == ULY_BF16 ? "bf16" : "f16"; }

static std::string describe(const fcase &c) {
    char s[200], scale[32] = "";
    if (c.scale) snprintf(scale, sizeof scale, " scale=%g", (double)c.scale);
    snprintf(s, sizeof s, "%s D=%lld B=%lld Sq=%lld Sk=%lld H=%lld Hkv=%lld%s%s%s%s", dt_name(c.dt),
             (long long)c.D, (long long)c.B, (long long)c.Sq, (long long)c.Sk, (long long)c.H,
             (long long)c.Hkv, scale, c.causal ? " causal" : "",
             c.strided == OWN_STRIDES ? " own strides" : c.strided ? " strided" : "",
             c.deterministic ? " deterministic" : "");
    return s;
}

static float round_to(uly_dtype t, double x) {
    if (t == ULY_BF16) return __bfloat162float(__float2bfloat16_rn((float)x));
    if (t == ULY_F16) return __half2float(__float2half_rn((float)x));
    return (float)x;
}

static int64_t kv_group(const fcase &c) { return c.kv_group ? c.kv_group : c.H / c.Hkv; }
static int64_t kv_of(const fcase &c, int64_t h) {
    return (c.q_head0 + h) / kv_group(c) - c.q_head0 / kv_group(c);
}

static double softmax_scale(const fcase &c) { return c.scale ? c.scale : 1.0 / sqrt((double)c.D); }

/* The seed of a case's inputs, a hash (FNV-1a) of every field: a case's data does not depend on
   what ran before it, so ULY_TEST_FILTER reproduces a failure. */
static uint64_t case_seed(const fcase &c) {
    uint32_t magnitude, scale;
    memcpy(&magnitude, &c.magnitude, 4), memcpy(&scale, &c.scale, 4);
    const int64_t v[] = {c.B, c.Sq, c.Sk, c.H, c.Hkv, c.D, c.causal, c.dt, c.strided,
                         c.deterministic, c.q_head0, c.kv_group, magnitude, scale};
    uint64_t h = 14695981039346656037ull;
    for (int64_t f : v)
        for (int i = 0; i < 8; i++) h = (h ^ (uint8_t)((uint64_t)f >> (8 * i))) * 1099511628211ull;
    return h;
}

static fvec random_values(ref_rng *r, int64_t n, uly_dtype t, float scale) {
    fvec x((size_t)n);
    for (auto &v : x) v = round_to(t, scale * ref_uniform(r));
    return x;
}

typedef struct inputs {
    fvec q, k, v, dout;
} inputs;

/* ---------------------------------------------------------------------------------------------
   The references: one sequence (b) of dense [S, H, D] arrays, computed in fp64 and rounded after
   every step as a rounding says: not at all (ref64), or to the dtype (lowp). */

typedef struct outputs {
    dvec o, lse, dq, dk, dv;
} outputs;

static double exact(uly_dtype, double x) { return x; }
static double rounded(uly_dtype t, double x) { return round_to(t, x); }

/* How a reference rounds the scores S and every other step (P, O, dP, dS, dQ, dK, dV). */
typedef struct rounding {
    double (*scores)(uly_dtype, double);
    double (*rest)(uly_dtype, double);
} rounding;
static const rounding exact_rounding = {exact, exact}, dtype_rounding = {rounded, rounded};

static void reference_seq(const fcase &c, int64_t sq, int64_t sk, const float *q, const float *k,
                          const float *v, const float *dout, const rounding &r, double *o,
                          double *lse, double *dq, double *dk, double *dv) {
    const int64_t H = c.H, Hkv = c.Hkv, D = c.D;
    const double scale = softmax_scale(c);
    dvec s((size_t)sk), p((size_t)sk), dp((size_t)sk), acc((size_t)D);
    for (int64_t h = 0; h < H; h++) {
        const int64_t hk = kv_of(c, h);
        for (int64_t i = 0; i < sq; i++) {
            const float *qi = q + (i * H + h) * D, *doi = dout + (i * H + h) * D;
            /* Keys past the causal bound have probability 0 and add nothing anywhere below. */
            const int64_t kept = c.causal ? std::min(sk, std::max<int64_t>(0, i + sk - sq + 1))
                                          : sk;
            double mx = -INFINITY;
            for (int64_t j = 0; j < kept; j++) {
                const float *kj = k + (j * Hkv + hk) * D;
                double dot = 0;
                for (int64_t d = 0; d < D; d++) dot += (double)qi[d] * kj[d];
                s[j] = r.scores(c.dt, dot * scale);
                mx = fmax(mx, s[j]);
            }
            double sum = 0;
            for (int64_t j = 0; j < kept; j++) sum += exp(s[j] - mx);
            const double l = kept ? mx + log(sum) : INFINITY;
            lse[h * sq + i] = l;
            for (int64_t j = 0; j < kept; j++) p[j] = r.rest(c.dt, exp(s[j] - l));
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t j = 0; j < kept; j++) {
                const float *vj = v + (j * Hkv + hk) * D;
                for (int64_t d = 0; d < D; d++) acc[d] += p[j] * vj[d];
            }
            double *oi = o + (i * H + h) * D, dsum = 0;
            for (int64_t d = 0; d < D; d++) {
                oi[d] = r.rest(c.dt, acc[d]);
                dsum += (double)doi[d] * oi[d];
            }
            for (int64_t j = 0; j < kept; j++) {
                const float *vj = v + (j * Hkv + hk) * D;
                double dpj = 0;
                for (int64_t d = 0; d < D; d++) dpj += (double)doi[d] * vj[d];
                dp[j] = r.rest(c.dt, p[j] * (r.rest(c.dt, dpj) - dsum)); /* dS */
            }
            double *dqi = dq + (i * H + h) * D;
            for (int64_t j = 0; j < kept; j++) {
                const float *kj = k + (j * Hkv + hk) * D;
                double *dkj = dk + (j * Hkv + hk) * D, *dvj = dv + (j * Hkv + hk) * D;
                for (int64_t d = 0; d < D; d++) {
                    dqi[d] += scale * dp[j] * kj[d];
                    dkj[d] += scale * dp[j] * qi[d];
                    dvj[d] += p[j] * doi[d];
                }
            }
        }
    }
}

/* Documents: cu[b] .. cu[b + 1] rows of the packed arrays (dense: cu = 0, S, 2S, ...). */
/* lse is [B, H, Sq], or [H, total_q] for varlen. */
static outputs reference_with(const fcase &c, const std::vector<int> &cu_q,
                              const std::vector<int> &cu_k, bool varlen, const inputs &in,
                              const rounding &rnd) {
    const fvec &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    outputs r;
    const int64_t nq = cu_q.back(), nk = cu_k.back(), docs = (int64_t)cu_q.size() - 1;
    r.o.assign((size_t)(nq * c.H * c.D), 0), r.dq = r.o, r.lse.assign((size_t)(nq * c.H), 0);
    r.dk.assign((size_t)(nk * c.Hkv * c.D), 0), r.dv = r.dk;
    dvec lse;
    for (int64_t b = 0; b < docs; b++) {
        const int64_t q0 = cu_q[b], k0 = cu_k[b], sq = cu_q[b + 1] - q0, sk = cu_k[b + 1] - k0;
        const int64_t qo = q0 * c.H * c.D, ko = k0 * c.Hkv * c.D;
        lse.assign((size_t)(sq * c.H), 0);
        reference_seq(c, sq, sk, &q[qo], &k[ko], &v[ko], &dout[qo], rnd, &r.o[qo], lse.data(),
                      &r.dq[qo], &r.dk[ko], &r.dv[ko]);
        for (int64_t h = 0; h < c.H; h++)
            for (int64_t i = 0; i < sq; i++)
                r.lse[(size_t)(varlen ? h * nq + q0 + i : (b * c.H + h) * sq + i)] =
                    lse[h * sq + i];
    }
    for (dvec *x : {&r.dq, &r.dk, &r.dv})
        for (auto &e : *x) e = rnd.rest(c.dt, e);
    return r;
}

/* ref64 (lowp false) or lowp (true). */
static outputs reference(const fcase &c, const std::vector<int> &cu_q, const std::vector<int> &cu_k,
                         bool varlen, const inputs &in, bool lowp) {
    return reference_with(c, cu_q, cu_k, varlen, in, lowp ? dtype_rounding : exact_rounding);
}

/* ---------------------------------------------------------------------------------------------
   Device tensors: dense (pad 0), or padded (heads D + 8 pad apart, rows and batches padded by
   8 pad more; a dim of extent 1 has stride 1 instead, which no kernel may apply). Every allocation
   has 8 elements past its last batch too. What lies outside the view (the padding) holds pad_bits,
   a NaN in bf16 and fp16: a kernel that reads it poisons its results, and one that writes it is
   caught by padding_written. */

static const uint16_t pad_bits = 0xffff;

typedef struct dev_tensor {
    uly_tensor t;
    int64_t elems; /* of the allocation */
} dev_tensor;

static dev_tensor dev_alloc(uly_dtype dt, int64_t b, int64_t s, int64_t h, int64_t d, int pad) {
    dev_tensor x;
    x.t = uly_dense(NULL, dt, b, s, h, d);
    if (pad) x.t.sh = d + 8 * pad, x.t.ss = h * x.t.sh + 8 * pad, x.t.sb = s * x.t.ss + 8 * pad;
    x.elems = b * x.t.sb + 8;
    if (pad) {
        if (b == 1) x.t.sb = 1;
        if (s == 1) x.t.ss = 1;
        if (h == 1) x.t.sh = 1;
    }
    CHECK(cudaMalloc(&x.t.data, (size_t)(x.elems * uly_dtype_size(dt))) == cudaSuccess, "malloc");
    const size_t bytes = (size_t)(x.elems * uly_dtype_size(dt));
    CHECK(cudaMemset(x.t.data, pad_bits & 0xff, bytes) == cudaSuccess, "set");
    return x;
}

static int64_t at(const uly_tensor &t, int64_t b, int64_t s, int64_t h) {
    return b * t.sb + s * t.ss + h * t.sh;
}

static uint16_t to_bits(uly_dtype t, float f) {
    if (t == ULY_BF16) return ((__nv_bfloat16_raw)__float2bfloat16_rn(f)).x;
    return ((__half_raw)__float2half_rn(f)).x;
}
static float from_bits(uly_dtype t, uint16_t bits) {
    if (t == ULY_BF16) {
        __nv_bfloat16_raw r;
        r.x = bits;
        return __bfloat162float(__nv_bfloat16(r));
    }
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
}

/* f(dense, strided) for every row of t: the index of its first element in the dense [B, S, H, D]
   array and in t's memory. */
template <typename F> static void for_rows(const uly_tensor &t, F f) {
    for (int64_t b = 0; b < t.b; b++)
        for (int64_t s = 0; s < t.s; s++)
            for (int64_t h = 0; h < t.h; h++) f(((b * t.s + s) * t.h + h) * t.d, at(t, b, s, h));
}

/* The dense values into t's view of the elements at mem, and back. */
static void put_rows(uint16_t *mem, const uly_tensor &t, const fvec &dense) {
    for_rows(t, [&](int64_t i, int64_t o) {
        for (int64_t d = 0; d < t.d; d++) mem[o + d] = to_bits(t.dtype, dense[(size_t)(i + d)]);
    });
}
static fvec get_rows(const uint16_t *mem, const uly_tensor &t) {
    fvec dense((size_t)(t.b * t.s * t.h * t.d));
    for_rows(t, [&](int64_t i, int64_t o) {
        for (int64_t d = 0; d < t.d; d++) dense[(size_t)(i + d)] = from_bits(t.dtype, mem[o + d]);
    });
    return dense;
}

static void upload(const dev_tensor &x, const fvec &dense) {
    std::vector<uint16_t> host((size_t)x.elems, pad_bits);
    put_rows(host.data(), x.t, dense);
    cudaMemcpy(x.t.data, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
}

static fvec download(const dev_tensor &x) {
    std::vector<uint16_t> host((size_t)x.elems);
    cudaMemcpy(host.data(), x.t.data, host.size() * 2, cudaMemcpyDeviceToHost);
    return get_rows(host.data(), x.t);
}

/* How many elements outside x's view differ from pad_bits. */
static int64_t padding_written(const dev_tensor &x) {
    const uly_tensor &t = x.t;
    std::vector<uint16_t> host((size_t)x.elems);
    cudaMemcpy(host.data(), t.data, host.size() * 2, cudaMemcpyDeviceToHost);
    std::vector<char> in_view((size_t)x.elems, 0);
    for_rows(t, [&](int64_t, int64_t o) { memset(&in_view[(size_t)o], 1, (size_t)t.d); });
    int64_t n = 0;
    for (size_t i = 0; i < host.size(); i++) n += !in_view[i] && host[i] != pad_bits;
    return n;
}

/* ---------------------------------------------------------------------------------------------
   One run of the kernels */

typedef struct run_out {
    fvec o, lse, dq, dk, dv;
    bool ok;
} run_out;

/* cu_seqlens_q and cu_seqlens_k in one device allocation (*cu, for cudaFree), and the varlen
   description of them, max_seqlen the longest documents. */
static uly_varlen varlen_on_device(const std::vector<int> &cu_q, const std::vector<int> &cu_k,
                                   int32_t **cu) {
    const size_t n = cu_q.size();
    cudaMalloc((void **)cu, 2 * n * 4);
    cudaMemcpy(*cu, cu_q.data(), n * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(*cu + n, cu_k.data(), n * 4, cudaMemcpyHostToDevice);
    uly_varlen vl = {*cu, *cu + n, (int64_t)n - 1, 0, 0};
    for (size_t b = 0; b + 1 < n; b++) {
        vl.max_seqlen_q = std::max<int64_t>(vl.max_seqlen_q, cu_q[b + 1] - cu_q[b]);
        vl.max_seqlen_k = std::max<int64_t>(vl.max_seqlen_k, cu_k[b + 1] - cu_k[b]);
    }
    return vl;
}

/* Forward and backward of attention `fa` on the eight tensors in a (the rest of a comes from c),
   dense, or (varlen, flash only) packed [1, total, H, D] documents: true when both ran, the lse
   in *lse. On a stream of their own, which the emulator runs asynchronously (the legacy stream's
   work it runs before the call returns): a host read of device memory before the stream is done
   is an error there. */
static bool run_kernels(const fcase &c, const std::vector<int> &cu_q, const std::vector<int> &cu_k,
                        bool varlen, const uly_attn &fa, uly_attn_args a, fvec *lse) {
    a.causal = c.causal, a.deterministic = c.deterministic, a.softmax_scale = c.scale;
    a.q_head0 = c.q_head0, a.kv_group = c.kv_group;
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream) == cudaSuccess, "cudaStreamCreate");
    a.stream = stream;
    const int64_t nlse = a.q.b * c.H * a.q.s;
    cudaMalloc((void **)&a.lse, (size_t)(nlse > 0 ? nlse : 1) * 4);
    const int64_t ws = fa.workspace(fa.ctx, &a);
    cudaMalloc(&a.workspace, (size_t)(ws > 0 ? ws : 1));
    a.workspace_bytes = ws;

    uly_varlen vl;
    int32_t *cu = NULL;
    if (varlen) vl = varlen_on_device(cu_q, cu_k, &cu);
    uly_status st = varlen ? uly_flash_varlen_fwd(&a, &vl) : fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_OK, "forward: %s", st.msg);
    if (st.code == ULY_OK) {
        st = varlen ? uly_flash_varlen_bwd(&a, &vl) : fa.bwd(fa.ctx, &a);
        CHECK(st.code == ULY_OK, "backward: %s", st.msg);
    }
    CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "kernels ran");
    lse->resize((size_t)nlse);
    cudaMemcpy(lse->data(), a.lse, (size_t)nlse * 4, cudaMemcpyDeviceToHost);
    cudaFree(a.lse), cudaFree(a.workspace), cudaFree(cu);
    cudaStreamDestroy(stream);
    return st.code == ULY_OK;
}

/* The eight tensors of a case on the device (q k v o dout dq dk dv, [B, Sq or Sk, H or Hkv, D],
   padded as c.strided says), q, k, v and dout uploaded from in, and args that point at them. */
static uly_attn_args alloc_tensors(const fcase &c, int64_t B, int64_t Sq, int64_t Sk,
                                   const inputs &in, dev_tensor x[8]) {
    for (int i = 0; i < 8; i++) {
        const bool kv = i == 1 || i == 2 || i == 6 || i == 7;
        x[i] = dev_alloc(c.dt, B, kv ? Sk : Sq, kv ? c.Hkv : c.H, c.D,
                         c.strided == OWN_STRIDES ? i + 1 : c.strided);
    }
    upload(x[0], in.q), upload(x[1], in.k), upload(x[2], in.v), upload(x[4], in.dout);
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = x[0].t, a.k = x[1].t, a.v = x[2].t, a.o = x[3].t, a.dout = x[4].t;
    a.dq = x[5].t, a.dk = x[6].t, a.dv = x[7].t;
    return a;
}

/* run_kernels on tensors of their own (alloc_tensors); nothing outside a view may change. */
static run_out run_attn(const fcase &c, const std::vector<int> &cu_q, const std::vector<int> &cu_k,
                        bool varlen, const inputs &in, const uly_attn &fa) {
    run_out r;
    const int64_t B = varlen ? 1 : c.B, Sq = varlen ? cu_q.back() : c.Sq;
    const int64_t Sk = varlen ? cu_k.back() : c.Sk;
    dev_tensor x[8];
    r.ok = run_kernels(c, cu_q, cu_k, varlen, fa, alloc_tensors(c, B, Sq, Sk, in, x), &r.lse);
    const char *names[8] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++) {
        const int64_t n = padding_written(x[i]);
        CHECK(n == 0, "%s: %lld elements outside the view of %s were written", describe(c).c_str(),
              (long long)n, names[i]);
    }
    r.o = download(x[3]), r.dq = download(x[5]), r.dk = download(x[6]), r.dv = download(x[7]);
    for (dev_tensor &t : x) cudaFree(t.t.data);
    return r;
}

/* The CPU fp32 reference of ulysses.h on the same (dense) inputs. */
static outputs run_cpu(const fcase &c, const inputs &in) {
    const fvec &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
    fvec o(q.size()), dq(q.size()), dk(k.size()), dv(k.size()), lse((size_t)(c.B * c.H * c.Sq));
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense((void *)q.data(), ULY_F32, c.B, c.Sq, c.H, c.D);
    a.k = uly_dense((void *)k.data(), ULY_F32, c.B, c.Sk, c.Hkv, c.D);
    a.v = uly_dense((void *)v.data(), ULY_F32, c.B, c.Sk, c.Hkv, c.D);
    a.o = uly_dense(o.data(), ULY_F32, c.B, c.Sq, c.H, c.D);
    a.dout = uly_dense((void *)dout.data(), ULY_F32, c.B, c.Sq, c.H, c.D);
    a.dq = uly_dense(dq.data(), ULY_F32, c.B, c.Sq, c.H, c.D);
    a.dk = uly_dense(dk.data(), ULY_F32, c.B, c.Sk, c.Hkv, c.D);
    a.dv = uly_dense(dv.data(), ULY_F32, c.B, c.Sk, c.Hkv, c.D);
    a.lse = lse.data(), a.causal = c.causal, a.softmax_scale = c.scale;
    a.q_head0 = c.q_head0, a.kv_group = c.kv_group;
    const uly_attn cpu = uly_cpu_attention();
    std::vector<char> ws((size_t)cpu.workspace(cpu.ctx, &a) + 1);
    a.workspace = ws.data(), a.workspace_bytes = (int64_t)ws.size();
    uly_status st = cpu.fwd(cpu.ctx, &a);
    if (!st.code) st = cpu.bwd(cpu.ctx, &a);
    CHECK(st.code == ULY_OK, "cpu attention: %s", st.msg);
    outputs r;
    r.o.assign(o.begin(), o.end()), r.lse.assign(lse.begin(), lse.end());
    r.dq.assign(dq.begin(), dq.end());
    r.dk.assign(dk.begin(), dk.end()), r.dv.assign(dv.begin(), dv.end());
    return r;
}

/* Largest |got - want|; a NaN, or an infinity not matched exactly, is +inf. */
template <typename G, typename W> static double max_err(const G &got, const W &want) {
    double m = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const double g = got[i], w = want[i];
        const double e = (std::isinf(g) || std::isinf(w)) ? (g == w ? 0 : INFINITY) : fabs(g - w);
        if (!(e <= m)) m = std::isnan(e) ? INFINITY : e;
    }
    return m;
}

/* q, k, v, dout of nq query and nk key rows, drawn in that order from case_seed(c). */
static inputs make_inputs(const fcase &c, int64_t nq, int64_t nk) {
    const float m = c.magnitude ? c.magnitude : 1.f;
    ref_rng r = ref_seed(case_seed(c));
    inputs in;
    in.q = random_values(&r, nq * c.H * c.D, c.dt, m);
    in.k = random_values(&r, nk * c.Hkv * c.D, c.dt, m);
    in.v = random_values(&r, nk * c.Hkv * c.D, c.dt, 1);
    in.dout = random_values(&r, nq * c.H * c.D, c.dt, 1);
    return in;
}

static std::vector<int> dense_cu(int64_t B, int64_t S) {
    std::vector<int> cu;
    for (int64_t b = 0; b <= B; b++) cu.push_back((int)(b * S));
    return cu;
}

typedef fvec run_out::*got_field;
typedef dvec outputs::*want_field;
static const struct field {
    const char *name;
    got_field got;
    want_field want;
} fields[] = {{"o", &run_out::o, &outputs::o},
              {"dq", &run_out::dq, &outputs::dq},
              {"dk", &run_out::dk, &outputs::dk},
              {"dv", &run_out::dv, &outputs::dv}};

/* lse: within 1e-3 of ref64 plus a few fp32 ulps of its magnitude; +inf exactly where ref64 has
   it. */
static void check_lse(const fcase &c, const run_out &got, const outputs &r64) {
    int bad = 0;
    for (size_t i = 0; i < r64.lse.size(); i++) {
        const double g = got.lse[i], w = r64.lse[i];
        bad += std::isinf(w) ? g != w : !(fabs(g - w) <= 1e-3 + 1e-6 * fabs(w));
    }
    CHECK(bad == 0, "%s: %d lse values off (max error %.3g)", describe(c).c_str(), bad,
          max_err(got.lse, r64.lse));
}

/* The accuracy rule for every output, against ref64 (and cpu, when given), and lse. A plain
   reference that overflowed (base = inf) would pass anything: it is a failure of the case. */
static void check_outputs(const fcase &c, const run_out &got, const outputs &r64,
                          const outputs &low, const outputs *cpu) {
    for (const field &f : fields) {
        const double err = max_err(got.*f.got, r64.*f.want);
        const double base = max_err(low.*f.want, r64.*f.want);
        CHECK(std::isfinite(base), "%s: the plain %s reference's %s is not finite: no bound",
              describe(c).c_str(), dt_name(c.dt), f.name);
        CHECK(err <= 2 * base + 1e-3, "%s: %s max error %.3g > 2 * %.3g + 1e-3 (plain %s)",
              describe(c).c_str(), f.name, err, base, dt_name(c.dt));
        if (!cpu) continue;
        const double cpu_err = max_err(got.*f.got, cpu->*f.want);
        CHECK(cpu_err <= 2 * base + 1e-3, "%s: %s differs from uly_cpu_attention by %.3g",
              describe(c).c_str(), f.name, cpu_err);
    }
    if (getenv("ULY_FLASH_VERBOSE"))
        printf("     %s: o %.3g dq %.3g dk %.3g dv %.3g (plain o %.3g dq %.3g)\n",
               describe(c).c_str(), max_err(got.o, r64.o), max_err(got.dq, r64.dq),
               max_err(got.dk, r64.dk), max_err(got.dv, r64.dv), max_err(low.o, r64.o),
               max_err(low.dq, r64.dq));
    check_lse(c, got, r64);
}

/* One dense case on the given inputs against ref64, lowp and cpu; returns the kernel's outputs. */
static inline run_out check_inputs(const fcase &c, const inputs &in) {
    const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
    const run_out got = run_attn(c, cq, ck, false, in, uly_flash_attention());
    if (!got.ok) return got;
    const outputs r64 = reference(c, cq, ck, false, in, false);
    const outputs low = reference(c, cq, ck, false, in, true);
    const outputs cpu = run_cpu(c, in);
    check_outputs(c, got, r64, low, &cpu);
    return got;
}

/* One dense case on its random inputs. */
static inline run_out check_case(const fcase &c) {
    return check_inputs(c, make_inputs(c, c.B * c.Sq, c.B * c.Sk));
}

/* Query rows that keep no key must give o and dq exactly 0 and lse = +inf; returns how many of
   those values differ. rows index the Sq rows of each of the B batches (packed documents are a
   batch of one). */
static inline int masked_rows_wrong(const fcase &c, const run_out &r,
                                    const std::vector<int64_t> &rows) {
    int bad = 0;
    for (int64_t b = 0; b < c.B; b++)
        for (int64_t h = 0; h < c.H; h++)
            for (int64_t i : rows) {
                const float l = r.lse[(size_t)((b * c.H + h) * c.Sq + i)];
                bad += !(std::isinf(l) && l > 0);
                const size_t row = (size_t)(((b * c.Sq + i) * c.H + h) * c.D);
                for (size_t d = 0; d < (size_t)c.D; d++)
                    bad += r.o[row + d] != 0 || r.dq[row + d] != 0;
            }
    return bad;
}

static inline std::vector<int64_t> row_range(int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; i++) rows.push_back(i);
    return rows;
}

/* ---------------------------------------------------------------------------------------------
   The shape matrix: lengths 1, 17, 64, 65, 127, 128, 129, 130, 200 (1000 in a few tests);
   Sq == Sk, Sq < Sk and Sq > Sk, each causal and not; a decode step (Sq = 1 against 200 keys)
   and a single key (Sk = 1); GQA groups 1, 2 and 8; B > 1, causal and not; softmax_scale 0.3
   and 1.7 (causal and not) besides the default 1/sqrt(D). */
typedef struct shape {
    int64_t B, Sq, Sk, H, Hkv;
    int causal;
} shape;

static const struct matrix_shape {
    shape s;
    float scale; /* softmax_scale, 0: 1/sqrt(D) */
} shapes[] = {
    {{1, 1, 1, 1, 1, 1}, 0},       {{2, 17, 17, 2, 1, 1}, 0},     {{1, 64, 64, 2, 2, 1}, 0.3f},
    {{1, 127, 129, 8, 1, 1}, 0},   {{2, 128, 128, 2, 1, 0}, 0},   {{1, 129, 64, 2, 2, 1}, 1.7f},
    {{1, 17, 129, 1, 1, 0}, 0},    {{1, 129, 129, 2, 1, 1}, 0},   {{1, 130, 65, 4, 2, 0}, 1.7f},
    {{1, 1, 200, 2, 1, 1}, 0},     {{1, 65, 1, 2, 2, 0}, 0},
};

static inline fcase make_case(const shape &s, int64_t D, uly_dtype dt, float scale = 0) {
    fcase c;
    memset(&c, 0, sizeof c);
    c.B = s.B, c.Sq = s.Sq, c.Sk = s.Sk, c.H = s.H, c.Hkv = s.Hkv, c.D = D, c.causal = s.causal;
    c.dt = dt, c.scale = scale;
    return c;
}

/* Padded views whose dims of extent 1 have stride 1, not a multiple of 8: a decode step (q, o,
   dout, dq [2, 1, 2, 64] with ss = 1, against 200 keys; k, v, dk, dv [2, 200, 1, 64] with
   sh = 1) and a single key (k, v, dk, dv [2, 1, 1, 128] with ss = sh = 1). A stride that is never
   applied may be anything. */
static inline std::vector<fcase> extent_1_cases(void) {
    std::vector<fcase> v = {make_case({2, 1, 200, 2, 1, 1}, 64, ULY_BF16),
                            make_case({2, 65, 1, 2, 1, 0}, 128, ULY_F16)};
    for (fcase &c : v) c.strided = 1;
    return v;
}

#endif
