// cublaslt_emu.cpp: the part of cuBLASLt that ulysses_cuda.cuh's unfused attention calls, for
// the CUDA emulator (tests only; not part of the product). Link it instead of -lcublasLt; the
// code under test includes the real <cublasLt.h>, so it compiles exactly as it does for a GPU.
//
// What it models, from the cublasLt.h documentation: D = alpha op(A) op(B) + beta C on
// column-major layouts (rows, cols, leading dimension), TRANSA/TRANSB, strided batches
// (BATCH_COUNT, STRIDED_BATCH_OFFSET in elements), A and B in fp16, bf16 or fp32 with C and D in
// the same type or fp32, CUBLAS_COMPUTE_32F with an fp32 scale, C not read when beta is 0.
// Products are summed in double and rounded once to D's type, so its errors are smaller than the
// real library's, never larger. Every other attribute, type, order or algorithm, and any layout
// the documentation calls invalid (ld < rows, op(A) op(B) shapes that do not chain, batch counts
// that differ), is refused with the status cuBLASLt documents, so the code under test cannot rely
// on something this double does not check.
//
// What it does not model: tiling, workspace needs, device limits, or which layouts a given
// GPU's kernels accept: those are test-gpu's, against the real library.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
static_assert(sizeof(desc) <= sizeof(cublasLtMatmulDescOpaque_t), "desc fits its opaque");
static_assert(sizeof(layout) <= sizeof(cublasLtMatrixLayoutOpaque_t), "layout fits its opaque");

desc *body(cublasLtMatmulDesc_t d) { return reinterpret_cast<desc *>(d->data); }
layout *body(cublasLtMatrixLayout_t l) { return reinterpret_cast<layout *>(l->data); }

bool is_float(cudaDataType_t t) { return t == CUDA_R_16F || t == CUDA_R_16BF || t == CUDA_R_32F; }

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
    default: return "an unknown cuBLASLt status";
    }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    *d = new cublasLtMatmulDescOpaque_t();
    new (body(*d)) desc{compute, scale, {CUBLAS_OP_N, CUBLAS_OP_N}};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
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

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
    if (!l) return CUBLAS_STATUS_INVALID_VALUE;
    *l = new cublasLtMatrixLayoutOpaque_t();
    new (body(*l)) layout{type, rows, cols, ld, 0, 1};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
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

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Al, const void *B,
                              cublasLtMatrixLayout_t Bl, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *algo, void *, size_t, cudaStream_t) {
    if (!h || !h->live) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!d || !alpha || !beta || !A || !B || !D || !Al || !Bl || !Cl || !Dl)
        return CUBLAS_STATUS_INVALID_VALUE;
    const desc &op = *body(d);
    const layout &a = *body(Al), &b = *body(Bl), &c = *body(Cl), &o = *body(Dl);
    if (algo || op.compute != CUBLAS_COMPUTE_32F || op.scale != CUDA_R_32F)
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
    if (!sane || (!C && *static_cast<const float *>(beta) != 0.f))
        return CUBLAS_STATUS_INVALID_VALUE;
    const double al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
    for (int64_t z = 0; z < o.batch; z++)
        for (int64_t j = 0; j < (int64_t)n; j++)
            for (int64_t i = 0; i < (int64_t)m; i++) {
                double sum = 0;
                for (int64_t p = 0; p < (int64_t)k; p++)
                    sum += at(a, A, z, ta, i, p) * at(b, B, z, tb, p, j);
                const double prior = be != 0 ? be * at(c, C, z, false, i, j) : 0;
                store(o.type, D, z * o.stride + i + j * o.ld, al * sum + prior);
            }
    return CUBLAS_STATUS_SUCCESS;
}
