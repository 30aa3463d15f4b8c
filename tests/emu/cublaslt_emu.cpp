// cublaslt_emu.cpp: the part of cuBLASLt that ulysses_cuda.cuh's unfused attention calls, for
// the CUDA emulator (tests only; not part of the product). Link it instead of -lcublasLt; the
// code under test includes the real <cublasLt.h>, so it compiles exactly as it does for a GPU.
//
// What it models, from the cublasLt.h documentation: D = alpha op(A) op(B) + beta C on
// column-major layouts (rows, cols, leading dimension), TRANSA/TRANSB, strided batches
// (BATCH_COUNT, STRIDED_BATCH_OFFSET in elements), A and B in fp16, bf16 or fp32 with C and D in
// the same type or fp32, CUBLAS_COMPUTE_32F with an fp32 scale. And C not read when beta is 0,
// which cuBLAS documents for its gemm ("C does not have to be a valid input") and cublasLt.h
// does not say: the library relies on it (0 * a NaN left in C would be NaN), and
// test_cublaslt's gemm_as_the_attention_calls_it checks it on the real library (make test-gpu).
// Products are summed in double and rounded once to D's type, so its errors are smaller than the
// real library's, never larger. Every other attribute, type, order or algorithm, and any layout
// the documentation calls invalid (ld < rows, op(A) op(B) shapes that do not chain, batch counts
// that differ, C == D with another descriptor), is refused with the status cuBLASLt documents,
// so the code under test cannot rely on something this double does not check. Descriptors are
// made only in the caller's storage (the *Init forms): with no *Create here, code under test
// that allocated its descriptors in cuBLASLt's heap would not link.
//
// Alignment, as the documentation puts it: the search (cublasLtMatmulAlgoGetHeuristic) only
// returns kernels that work at the preference's MIN_ALIGNMENT_{A,B,C,D}_BYTES, 256 by default,
// and so does cublasLtMatmul's implicit search when algo is NULL. The kernel this double
// "returns" needs exactly those alignments of each matrix's address, and (stricter than the
// header's "minimum buffer alignment") of its leading dimension and batch stride in bytes, and
// cublasLtMatmul refuses operands that lack them, as a real kernel could fault on them; the
// workspace must be 256-byte aligned.
//
// Workspace, as the documentation puts it: the search returns kernels that need at most the
// preference's MAX_WORKSPACE_BYTES, and cublasLtMatmul refuses a workspaceSizeInBytes below the
// kernel's need. The kernel this double returns needs all of it, as a split-K kernel may, and
// overwrites it when it runs, so a workspace that overlaps live data shows in the results.
//
// What it does not model: tiling, device limits, or which layouts a given GPU's kernels accept:
// those are test-gpu's, against the real library.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cublaslt_emu.h"
#include "cuda_emu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

struct cublasLtContext {
    int live;
};

namespace {

struct desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int32_t op[2];  // TRANSA, TRANSB
};
struct layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld, stride;
    int32_t batch;
};
// A search preference, and the kernel a search returns: the alignments it needs (A, B, C, D).
struct pref {
    uint64_t workspace;
    uint32_t schemes;
    uint32_t align[4];
};
struct kernel {
    uint64_t tag;
    uint32_t align[4];
    uint64_t workspace;  // bytes it needs and overwrites
};
const uint64_t kernel_tag = 0x756c79656d75ull;
static_assert(sizeof(desc) <= sizeof(cublasLtMatmulDescOpaque_t), "desc fits its opaque");
static_assert(sizeof(layout) <= sizeof(cublasLtMatrixLayoutOpaque_t), "layout fits its opaque");
static_assert(sizeof(pref) <= sizeof(cublasLtMatmulPreferenceOpaque_t), "pref fits its opaque");
static_assert(sizeof(kernel) <= sizeof(cublasLtMatmulAlgo_t), "kernel fits an algo");

desc *body(cublasLtMatmulDesc_t d) { return reinterpret_cast<desc *>(d->data); }
layout *body(cublasLtMatrixLayout_t l) { return reinterpret_cast<layout *>(l->data); }
pref *body(cublasLtMatmulPreference_t p) { return reinterpret_cast<pref *>(p->data); }

bool is_float(cudaDataType_t t) { return t == CUDA_R_16F || t == CUDA_R_16BF || t == CUDA_R_32F; }
int64_t type_size(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// Whether a matrix's address, leading dimension and batch stride are multiples of `bytes`.
bool aligned(const layout &l, const void *p, uint32_t bytes) {
    const int64_t es = type_size(l.type);
    return reinterpret_cast<uintptr_t>(p) % bytes == 0 && l.ld * es % bytes == 0 &&
           (l.batch == 1 || l.stride * es % bytes == 0);
}

// The operation cublasLtMatmul and the search accept: types, shapes that chain, batches.
cublasStatus_t valid(const desc &op, const layout &a, const layout &b, const layout &c,
                     const layout &o) {
    if (op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (a.type != b.type || !is_float(a.type) || c.type != o.type ||
        (o.type != a.type && o.type != CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    const bool ta = op.op[0] == CUBLAS_OP_T, tb = op.op[1] == CUBLAS_OP_T;
    const uint64_t m = o.rows, n = o.cols, k = ta ? a.rows : a.cols;
    const bool chains = (ta ? a.cols : a.rows) == m && (tb ? b.rows : b.cols) == n &&
                        (tb ? b.cols : b.rows) == k && c.rows == m && c.cols == n;
    bool sane = chains && a.batch == o.batch && b.batch == o.batch && c.batch == o.batch;
    for (const layout *l : {&a, &b, &c, &o}) sane = sane && l->ld >= (int64_t)l->rows;
    return sane ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

double load(cudaDataType_t t, const void *p, int64_t i) {
    if (t == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    if (t == CUDA_R_16F) return __half2float(static_cast<const __half *>(p)[i]);
    return static_cast<const float *>(p)[i];
}

void store(cudaDataType_t t, void *p, int64_t i, double x) {
    const float f = static_cast<float>(x);
    if (t == CUDA_R_16BF) static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(f);
    else if (t == CUDA_R_16F) static_cast<__half *>(p)[i] = __float2half_rn(f);
    else static_cast<float *>(p)[i] = f;
}

// Element (i, j) of op(X) for X as stored: column-major, op transposes.
double at(const layout &l, const void *p, int64_t b, bool trans, int64_t i, int64_t j) {
    if (trans) std::swap(i, j);
    return load(l.type, p, b * l.stride + i + j * l.ld);
}

// A descriptor made in the caller's storage of `size` bytes (ALLOC_FAILED if short, as
// cuBLASLt's *Init say). The double has no *Create: the product keeps its descriptors on its
// own stack, allocating nothing, and a *Create would not link here.
template <typename H, typename B> cublasStatus_t init(H *h, size_t size, const B &value) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    if (size < sizeof *h) return CUBLAS_STATUS_ALLOC_FAILED;
    new (body(h)) B(value);
    return CUBLAS_STATUS_SUCCESS;
}

// An attribute's new value, kept only if it has the attribute's size and is valid.
template <typename T, typename F> cublasStatus_t set(T &field, const void *buf, size_t size,
                                                     F valid) {
    T v;
    if (!buf || size != sizeof v) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&v, buf, sizeof v);
    if (!valid(v)) return CUBLAS_STATUS_INVALID_VALUE;
    field = v;
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new cublasLtContext{1};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasLtGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "an unknown cuBLASLt status";
    }
}

cublasStatus_t cublasLtMatmulDescInit_internal(cublasLtMatmulDesc_t d, size_t size,
                                               cublasComputeType_t compute, cudaDataType_t scale) {
    return init(d, size, desc{compute, scale, {CUBLAS_OP_N, CUBLAS_OP_N}});
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    if (attr != CUBLASLT_MATMUL_DESC_TRANSA && attr != CUBLASLT_MATMUL_DESC_TRANSB)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return set(body(d)->op[attr == CUBLASLT_MATMUL_DESC_TRANSB], buf, size,
               [](int32_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; });
}

cublasStatus_t cublasLtMatrixLayoutInit_internal(cublasLtMatrixLayout_t l, size_t size,
                                                 cudaDataType type, uint64_t rows, uint64_t cols,
                                                 int64_t ld) {
    return init(l, size, layout{type, rows, cols, ld, 0, 1});
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
    if (!l) return CUBLAS_STATUS_INVALID_VALUE;
    layout &m = *body(l);
    if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)
        return set(m.batch, buf, size, [](int32_t n) { return n >= 1; });
    if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)
        return set(m.stride, buf, size, [](int64_t n) { return n >= 0; });
    return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulPreferenceInit_internal(cublasLtMatmulPreference_t p, size_t size) {
    return init(p, size, pref{0, CUBLASLT_REDUCTION_SCHEME_MASK, {256, 256, 256, 256}});
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t size) {
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    pref &f = *body(p);
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
        return set(f.workspace, buf, size, [](uint64_t) { return true; });
    if (attr == CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK)
        return set(f.schemes, buf, size,
                   [](uint32_t m) { return (m & ~uint32_t(CUBLASLT_REDUCTION_SCHEME_MASK)) == 0; });
    if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
        attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES)
        return set(f.align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, size,
                   [](uint32_t n) { return n != 0 && (n & (n - 1)) == 0; });
    return CUBLAS_STATUS_NOT_SUPPORTED;
}

namespace {
std::atomic<uint32_t> least_alignment{256};  // uly_emu_cublaslt_least_alignment
std::atomic<int> no_kernel{-1};              // uly_emu_cublaslt_no_kernel's status, or -1
}  // namespace

uint32_t uly_emu_cublaslt_least_alignment() { return least_alignment.exchange(256); }
void uly_emu_cublaslt_no_kernel(cublasStatus_t s) { no_kernel = (int)s; }

// One kernel, needing the preference's alignments and its whole workspace; its sums are exact,
// so any reduction-scheme mask admits it.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t Al, cublasLtMatrixLayout_t Bl,
                                              cublasLtMatrixLayout_t Cl, cublasLtMatrixLayout_t Dl,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int *count) {
    if (!h || !h->live) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!d || !Al || !Bl || !Cl || !Dl || !p || requested <= 0 || !results || !count)
        return CUBLAS_STATUS_INVALID_VALUE;
    const cublasStatus_t ok = valid(*body(d), *body(Al), *body(Bl), *body(Cl), *body(Dl));
    if (ok != CUBLAS_STATUS_SUCCESS) return ok;
    if (const int s = no_kernel.exchange(-1); s >= 0) {
        *count = 0;
        return (cublasStatus_t)s;
    }
    results[0] = cublasLtMatmulHeuristicResult_t();
    kernel k{kernel_tag, {0, 0, 0, 0}, body(p)->workspace};
    std::memcpy(k.align, body(p)->align, sizeof k.align);
    for (uint32_t a : k.align)
        for (uint32_t least = least_alignment; a < least;)
            if (least_alignment.compare_exchange_weak(least, a)) break;
    std::memcpy(&results[0].algo, &k, sizeof k);
    results[0].workspaceSize = k.workspace;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Al, const void *B,
                              cublasLtMatrixLayout_t Bl, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes,
                              cudaStream_t stream) {
    if (!h || !h->live) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!d || !alpha || !beta || !A || !B || !D || !Al || !Bl || !Cl || !Dl)
        return CUBLAS_STATUS_INVALID_VALUE;
    const desc &op = *body(d);
    const layout &a = *body(Al), &b = *body(Bl), &c = *body(Cl), &o = *body(Dl);
    const cublasStatus_t ok = valid(op, a, b, c, o);
    if (ok != CUBLAS_STATUS_SUCCESS) return ok;
    if ((!C && *static_cast<const float *>(beta) != 0.f) || (C == D && Cl != Dl) ||
        reinterpret_cast<uintptr_t>(ws) % 256 != 0)
        return CUBLAS_STATUS_INVALID_VALUE;
    kernel kern{kernel_tag, {256, 256, 256, 256}, 0};  // algo NULL: the default preference's
    if (algo) std::memcpy(&kern, algo, sizeof kern);
    if (kern.tag != kernel_tag || ws_bytes < kern.workspace || (kern.workspace && !ws))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!aligned(a, A, kern.align[0]) || !aligned(b, B, kern.align[1]) ||
        (C && !aligned(c, C, kern.align[2])) || !aligned(o, D, kern.align[3]))
        return CUBLAS_STATUS_EXECUTION_FAILED;  // a real kernel's misaligned access
    const bool ta = op.op[0] == CUBLAS_OP_T, tb = op.op[1] == CUBLAS_OP_T;
    const uint64_t m = o.rows, n = o.cols, k = ta ? a.rows : a.cols;
    const double al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
    uly_emu_queue(stream, [=] {  // alpha and beta are read now, the matrices when it runs
        if (kern.workspace) std::memset(ws, 0xff, kern.workspace);  // a split K's partial sums
        for (int64_t z = 0; z < o.batch; z++)
            for (int64_t j = 0; j < (int64_t)n; j++)
                for (int64_t i = 0; i < (int64_t)m; i++) {
                    double sum = 0;
                    for (int64_t p = 0; p < (int64_t)k; p++)
                        sum += at(a, A, z, ta, i, p) * at(b, B, z, tb, p, j);
                    const double prior = be != 0 ? be * at(c, C, z, false, i, j) : 0;
                    store(o.type, D, z * o.stride + i + j * o.ld, al * sum + prior);
                }
    });
    return CUBLAS_STATUS_SUCCESS;
}
