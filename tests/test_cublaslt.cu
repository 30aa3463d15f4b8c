/* test_cublaslt.cu - the cuBLASLt unfused attention: the second, independent GPU reference for
   the flash kernels, and the fallback for the head dims they do not take.

   - The GEMM as the attention uses it (row-major operands through cuBLASLt's column-major
     layouts, transposes, a batch stride of 0, ld > rows, fp32 output from 16-bit inputs,
     beta = 1 accumulation) equals the product written out from the cuBLASLt documentation.
   - On the shape matrix of test_flash.cu (softmax_scale 0.3 and 1.7 in three of its shapes, a
     decode step, a single key), bf16 and fp16, D = 64 and 128, the cuBLASLt path meets
     the accuracy rule against fp64 (flash_case.h), and flash agrees with it within the same
     bound (twice the error of a plain attention in that precision, plus 1e-3). Strided tensors,
     a GQA group split across SP ranks, rows that keep no key, and dims of extent 1 with strides
     smaller than a row (a decode step's view) too.
   - Head dims the flash kernels do not take (8, 96, 256) meet the accuracy rule; others are a
     named error, as are backward o and dout rows not in 16-byte chunks. A kv head no query head
     reads gets zero gradients. Where the flash backward needs more shared memory than the GPU
     has, it says so and this path runs (emulated: a smaller GPU).
   - Each of the eight tensors with strides of its own (GQA, a rank past the first group, an
     unread kv head); the backward leaves lse alone. The workspace's parts lie apart and inside
     workspace(), cuBLASLt's own ULY__LT_WS bytes included (the emulated GEMM overwrites them
     when it runs), sized by the query heads a kv head has here, not by kv_group. fp32,
     D > 256, 2^31 batches, GEMM dims past int and backward tensors of the wrong shape are
     named errors, as is a search that finds no kernel (emulated). The elementwise kernels
     index past 2^31 elements (on a GPU with the memory).
   Under the emulator (make test) cuBLASLt is tests/emu/cublaslt_emu.cpp, a double that computes
   the documented GEMM and refuses what it does not model; on a GPU (make test-gpu) it is the real
   library, and the first test is what shows the double models it. */
#include "emu/cuda_emu.h"
#include <cublasLt.h>
#define ULYSSES_CUBLASLT
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "flash_case.h"
#ifdef ULY_EMU
#include "emu/cublaslt_emu.h"
#endif

static cublasLtHandle_t lt_handle(void) {
    static cublasLtHandle_t h;
    if (!h) CHECK(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
    return h;
}

/* A 3 x 4 row-major bf16 X (row stride 6) and a 5 x 4 row-major Y, batch 2, Y shared (stride 0):
   Z[b] = X[b] Y^T in fp32, as the attention computes S = Q K^T; then Z[b] += X[b] Y^T again with
   beta = 1. cuBLASLt itself sees the column-major transposes (uly__lt_gemm). */
TEST(gemm_as_the_attention_calls_it) {
    enum { M = 3, N = 5, K = 4, LDX = 6, B = 2 };
    float x[B * M * LDX], y[N * K], want[B * M * N];
    __nv_bfloat16 xb[B * M * LDX], yb[N * K];
    ref_rng r = ref_seed(1);
    for (int i = 0; i < B * M * LDX; i++) x[i] = round_to(ULY_BF16, ref_uniform(&r)), xb[i] = x[i];
    for (int i = 0; i < N * K; i++) y[i] = round_to(ULY_BF16, ref_uniform(&r)), yb[i] = y[i];
    for (int b = 0; b < B; b++)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                const float *xi = &x[b * M * LDX + i * LDX];
                double s = 0;
                for (int p = 0; p < K; p++) s += (double)xi[p] * y[j * K + p];
                want[(b * M + i) * N + j] = (float)(2 * s);
            }
    void *dx, *dy, *dz, *ws;
    cudaMalloc(&dx, sizeof xb), cudaMalloc(&dy, sizeof yb), cudaMalloc(&dz, sizeof want);
    cudaMalloc(&ws, ULY__LT_WS);
    cudaMemcpy(dx, xb, sizeof xb, cudaMemcpyHostToDevice);
    cudaMemcpy(dy, yb, sizeof yb, cudaMemcpyHostToDevice);
    cudaMemset(dz, 0xff, sizeof want); /* NaN: beta = 0 must not read it */
    const uly__lt_mat X = {dx, CUDA_R_16BF, M, K, LDX, M * LDX}, Y = {dy, CUDA_R_16BF, N, K, K, 0};
    const uly__lt_mat Z = {dz, CUDA_R_32F, M, N, N, M * N};
    uly_status st = uly__lt_gemm(lt_handle(), X, 0, Y, 1, Z, 1.f, 0.f, B, ws, 0);
    if (!st.code) st = uly__lt_gemm(lt_handle(), X, 0, Y, 1, Z, 1.f, 1.f, B, ws, 0);
    CHECK(!st.code, "%s", st.msg);
    float got[B * M * N];
    cudaMemcpy(got, dz, sizeof got, cudaMemcpyDeviceToHost);
    double err = 0;
    for (int i = 0; i < B * M * N; i++)
        err = fmax(err, isnan(got[i]) ? INFINITY : fabs(got[i] - want[i]));
    CHECK(err <= 1e-5, "X Y^T differs from the documented product by %g", err);
    cudaFree(dx), cudaFree(dy), cudaFree(dz), cudaFree(ws);
}

/* cuBLASLt against fp64, and flash against cuBLASLt; returns cuBLASLt's outputs. */
static run_out agree(const fcase &c) {
    const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
    const run_out lt = run_attn(c, cq, ck, false, in, uly_cublaslt_attention(lt_handle()));
    const run_out fa = run_attn(c, cq, ck, false, in, uly_flash_attention());
    if (!lt.ok || !fa.ok) return lt;
    const outputs r64 = reference(c, cq, ck, false, in, false);
    const outputs low = reference(c, cq, ck, false, in, true);
    check_outputs(c, lt, r64, low, NULL);
    for (const field &f : fields) {
        const double err = max_err(fa.*f.got, lt.*f.got), base = max_err(low.*f.want, r64.*f.want);
        CHECK(err <= 2 * base + 1e-3, "%s: flash %s differs from cuBLASLt by %.3g",
              describe(c).c_str(), f.name, err);
    }
    return lt;
}

TEST(cublaslt_agrees_with_flash) {
    for (uly_dtype dt : {ULY_BF16, ULY_F16})
        for (int64_t D : {64, 128})
            for (const matrix_shape &m : shapes) agree(make_case(m.s, D, dt, m.scale));
}

/* agree, and for a causal case with Sq > Sk its rows 0 .. Sq - Sk - 1 keep no key, so their o and
   dq are exactly 0 and their lse +inf (the accuracy rule alone would let o and dq be small). */
static void agree_masked(const fcase &c) {
    const run_out lt = agree(c);
    if (!lt.ok) return;
    const int bad = masked_rows_wrong(c, lt, row_range(0, c.causal ? c.Sq - c.Sk : 0));
    CHECK(bad == 0, "%s: %d values of rows that keep no key are not 0 (lse +inf)",
          describe(c).c_str(), bad);
}

/* Padded strides and rows that keep no key in each of two batches; local heads 1..3 of groups of
   2 (a group split across SP ranks); most rows keeping no key. */
TEST(cublaslt_strided_split_group_masked_rows) {
    fcase c = make_case({2, 129, 65, 4, 2, 1}, 64, ULY_F16);
    c.strided = 1;
    agree_masked(c);
    c = make_case({1, 65, 65, 3, 2, 1}, 128, ULY_BF16);
    c.q_head0 = 1, c.kv_group = 2;
    agree(c);
    agree_masked(make_case({1, 150, 20, 2, 1, 1}, 64, ULY_BF16));
}

/* flash_case.h's extent_1_cases: a decode step's q rows 1 element apart, a single key's k rows
   and heads. cuBLASLt wants a leading dimension of at least a row's length even for one row;
   uly__lt_gemm gives it one. */
TEST(cublaslt_any_stride_on_dims_of_extent_1) {
    for (const fcase &c : extent_1_cases()) agree(c);
}

/* Two query heads of a group of 2 and two kv heads: kv head 1 is read by no query head, so its
   dK and dV are exactly 0 (sums over no query), as in the flash kernels; all Sk of its key rows,
   also where Sk > Sq (97 keys, 65 queries). */
TEST(cublaslt_kv_head_that_no_query_head_reads_gets_zero_gradients) {
    for (int64_t Sk : {65, 97}) {
        fcase c = make_case({1, 65, Sk, 2, 2, 1}, 64, ULY_BF16);
        c.kv_group = 2;
        const run_out lt = agree(c);
        if (!lt.ok) continue;
        int nonzero = 0;
        for (int64_t j = 0; j < c.Sk; j++) {
            const size_t row = (size_t)((j * c.Hkv + 1) * c.D);
            for (size_t d = 0; d < (size_t)c.D; d++)
                nonzero += lt.dk[row + d] != 0 || lt.dv[row + d] != 0;
        }
        CHECK(nonzero == 0, "Sk %lld: %d dK, dV values of kv head 1 are not 0", (long long)Sk,
              nonzero);
    }
}

#ifdef ULY_EMU
/* Score rows of any length start 16-byte aligned (uly__lt_ld), so that cuBLASLt may take its
   tensor-core kernels: with dense q, k, v, o and gradients, whose rows are 16-byte chunks, no
   search asks for less, at Sk = 77 as at 64, and for one query (a decode step: one-row
   matrices, whose ld cuBLASLt never applies). */
TEST(cublaslt_score_rows_keep_tensor_core_alignment) {
    for (int64_t sq : {33, 1})
        for (int64_t sk : {77, 64}) {
            const fcase c = make_case({1, sq, sk, 4, 2, 1}, 64, ULY_BF16);
            const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
            const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
            uly_emu_cublaslt_least_alignment();
            const run_out lt =
                run_attn(c, cq, ck, false, in, uly_cublaslt_attention(lt_handle()));
            const uint32_t least = uly_emu_cublaslt_least_alignment();
            CHECK(lt.ok && least >= 16, "Sq = %lld, Sk = %lld: the least alignment searched "
                  "for is %u bytes", (long long)sq, (long long)sk, least);
        }
}
#endif

#ifdef ULY_EMU
/* A search that finds no kernel, answered either way cuBLASLt may (success with none, or not
   supported), is ULY_EUNSUPPORTED naming the search, and no product runs. */
TEST(cublaslt_without_a_kernel_is_unsupported) {
    enum { M = 4, K = 8 };
    const struct {
        cublasStatus_t s;
        const char *msg;
    } none[] = {{CUBLAS_STATUS_SUCCESS, "cuBLASLt has no kernel for a product"},
                {CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulAlgoGetHeuristic: the functionality"}};
    void *dx, *dz, *ws;
    cudaMalloc(&dx, M * K * 2), cudaMalloc(&dz, M * M * 4), cudaMalloc(&ws, ULY__LT_WS);
    cudaMemset(dx, 0, M * K * 2);
    const uly__lt_mat X = {dx, CUDA_R_16BF, M, K, K, 0}, Z = {dz, CUDA_R_32F, M, M, M, 0};
    for (const auto &n : none) {
        cudaMemset(dz, 0xff, M * M * 4);
        uly_emu_cublaslt_no_kernel(n.s);
        const uly_status st = uly__lt_gemm(lt_handle(), X, 0, X, 1, Z, 1.f, 0.f, 1, ws, 0);
        unsigned char z[M * M * 4];
        cudaMemcpy(z, dz, sizeof z, cudaMemcpyDeviceToHost);
        int written = 0;
        for (unsigned char b : z) written += b != 0xff;
        CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, n.msg) && !written,
              "search answering %d: code %d '%s', %d bytes of D written", (int)n.s, (int)st.code,
              st.msg, written);
    }
    cudaFree(dx), cudaFree(dz), cudaFree(ws);
}
#endif

TEST(cublaslt_other_head_dims) {
    for (int64_t D : {8, 96, 256}) {
        const fcase c = make_case({2, 129, 77, 4, 2, 1}, D, ULY_BF16);
        const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
        const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
        const run_out lt = run_attn(c, cq, ck, false, in, uly_cublaslt_attention(lt_handle()));
        if (lt.ok)
            check_outputs(c, lt, reference(c, cq, ck, false, in, false),
                          reference(c, cq, ck, false, in, true), NULL);
    }
}

TEST(cublaslt_rejects_what_it_does_not_take) {
    const uly_attn lt = uly_cublaslt_attention(lt_handle());
    CHECK(lt.workspace(lt.ctx, NULL) == -1, "workspace of no args: %lld",
          (long long)lt.workspace(lt.ctx, NULL));
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    alignas(256) char buf[64];
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, 1, 1, 1, 12);
    a.k = a.v = a.dk = a.dv = a.q;
    a.lse = (float *)buf, a.workspace = buf, a.workspace_bytes = INT64_MAX; /* never used */
    uly_status st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "D <= 256, D % 8 == 0"), "D = 12: '%s'",
          st.msg);
    a.workspace = NULL;
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, 1, 1, 1, 8);
    a.k = a.v = a.dk = a.dv = a.q;
    st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "workspace is NULL"), "'%s'", st.msg);
    a.workspace = buf + 16; /* fp32 scores and cuBLASLt's own part need cudaMalloc's alignment */
    st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "not 256-byte aligned"), "'%s'", st.msg);
    a.workspace = buf, a.workspace_bytes = lt.workspace(lt.ctx, &a) - 1;
    st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EINVAL && strstr(st.msg, "workspace_bytes"), "a byte short: '%s'",
          st.msg);
    a.workspace_bytes = INT64_MAX; /* 2^31 heads of one row each: a view, never read */
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, 1, 1, (int64_t)1 << 31, 8);
    a.q.sh = a.o.sh = a.dout.sh = a.dq.sh = 8;
    a.k = a.v = a.dk = a.dv = uly_dense(buf, ULY_BF16, 1, 1, 1, 8);
    st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "q.h (2147483648): at most 2^31 - 1"),
          "'%s'", st.msg);
    /* The backward's Dsum pass reads o and dout in 16-byte chunks: two rows (a stride of a dim
       of extent 1 is never applied, and may be anything). */
    a.workspace = buf;
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, 1, 2, 1, 8);
    a.k = a.v = a.dk = a.dv = a.q;
    a.o.data = buf + 2;
    st = lt.bwd(lt.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "o: rows move in 16-byte chunks"),
          "o one element in: '%s'", st.msg);
    a.o.data = buf, a.dout.ss = 12;
    st = lt.bwd(lt.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "dout: rows move in 16-byte chunks"),
          "dout rows 12 elements apart: '%s'", st.msg);
    /* 2^31 - 1 queries and keys: each GEMM's dims fit an int, but the fp32 scores of one head,
       about 2^64 bytes, do not fit the int64 workspace size (views, never read). */
    a.q = a.o = a.dout = a.dq = uly_dense(buf, ULY_BF16, 1, INT_MAX, 1, 8);
    a.k = a.v = a.dk = a.dv = a.q;
    st = lt.fwd(lt.ctx, &a);
    CHECK(st.code == ULY_EOVERFLOW && strstr(st.msg, "workspace's bytes overflow"), "'%s'",
          st.msg);
    CHECK(uly__lt_workspace(lt.ctx, &a) < 0, "workspace() of those: %lld",
          (long long)uly__lt_workspace(lt.ctx, &a));
}

/* Each of the eight tensors with its own strides (flash_case.h's OWN_STRIDES): every
   GEMM operand, the softmax's and the stores' rows, and the zeroed gradients of an unread kv
   head must step their own tensor. Three cases: GQA, B = 2, causal with rows that keep no key;
   an SP rank past the first group (global query heads 3..6 in groups of 2 read global kv heads
   1, 2, 2, 3: local kv heads 0 and 2 have one query head each, the first and last of the
   slice); kv head 1 read by no query head (its dK and dV zeroed in place). */
TEST(cublaslt_every_tensor_has_its_own_strides) {
    fcase c[3] = {make_case({2, 40, 33, 4, 2, 1}, 64, ULY_BF16),
                  make_case({1, 33, 33, 4, 3, 1}, 64, ULY_F16),
                  make_case({1, 17, 17, 2, 2, 0}, 64, ULY_BF16)};
    c[1].q_head0 = 3, c[1].kv_group = 2;
    c[2].kv_group = 2;
    for (fcase &k : c) {
        k.strided = OWN_STRIDES;
        agree_masked(k);
    }
}

/* The workspace's parts as uly__lt_carve hands them out lie inside workspace() bytes, 256-byte
   aligned and apart, each as large as what is written to it: S (fp32), P and dS (16-bit) for
   the most query heads that one kv head has here, rows uly__lt_ld apart; Dsum of every query
   row; dK and dV in fp32; and the ULY__LT_WS bytes every cublasLtMatmul is told it may use.
   The emulated GEMM overwrites all of its part when it runs, as split-K partial sums may, so
   an overlap with live scores also shows in the results; this names the part, and catches one
   that runs past the end of the workspace. */
TEST(cublaslt_workspace_parts_are_apart_and_inside) {
    struct {
        int64_t B, Sq, Sk, H, Hkv, q_head0, kv_group;
    } shapes[] = {{2, 33, 77, 4, 2, 0, 0}, {1, 65, 20, 3, 2, 1, 2}, {1, 1, 200, 8, 1, 0, 0}};
    alignas(16) static char view[16];
    for (const auto &s : shapes) {
        const int64_t D = 64;
        uly_attn_args a;
        memset(&a, 0, sizeof a);
        a.q = a.o = a.dout = a.dq = uly_dense(view, ULY_BF16, s.B, s.Sq, s.H, D); /* never read */
        a.k = a.v = a.dk = a.dv = uly_dense(view, ULY_BF16, s.B, s.Sk, s.Hkv, D);
        a.q_head0 = s.q_head0, a.kv_group = s.kv_group;
        const uly_attn lt = uly_cublaslt_attention(lt_handle());
        const int64_t need = lt.workspace(lt.ctx, &a);
        CHECK(need > 0 && cudaMalloc(&a.workspace, (size_t)need) == cudaSuccess, "%lld bytes",
              (long long)need);
        if (!a.workspace) continue;
        /* the most query heads of one kv head, by the contract's map from query to kv heads */
        const int64_t g = s.kv_group ? s.kv_group : s.H / s.Hkv;
        int64_t most = 0;
        for (int64_t j = 0; j < s.Hkv; j++) {
            int64_t n = 0;
            for (int64_t h = 0; h < s.H; h++) n += (s.q_head0 + h) / g - s.q_head0 / g == j;
            most = std::max(most, n);
        }
        const int64_t scores = most * s.Sq * uly__lt_ld(&a), kd = s.Sk * D * 4;
        const uly__lt_ws w = uly__lt_carve(&a);
        const char *at[7] = {(char *)w.s, (char *)w.p, (char *)w.ds, (char *)w.dsum,
                             (char *)w.dk, (char *)w.dv, (char *)w.lt};
        const int64_t bytes[7] = {scores * 4, scores * 2, scores * 2, s.B * s.H * s.Sq * 4,
                                  kd, kd, ULY__LT_WS};
        const char *names[7] = {"S", "P", "dS", "Dsum", "dK", "dV", "cuBLASLt's"};
        const char *base = (const char *)a.workspace;
        for (int i = 0; i < 7; i++) {
            CHECK(at[i] >= base && at[i] + bytes[i] <= base + need &&
                      (uintptr_t)at[i] % 256 == 0,
                  "Sk=%lld: %s part [%td, %td) of %lld bytes", (long long)s.Sk, names[i],
                  at[i] - base, at[i] + bytes[i] - base, (long long)need);
            for (int j = 0; j < i; j++)
                CHECK(at[i] >= at[j] + bytes[j] || at[j] >= at[i] + bytes[i],
                      "Sk=%lld: the %s and %s parts overlap", (long long)s.Sk, names[j],
                      names[i]);
        }
        cudaFree(a.workspace);
    }
}

/* One local query head of a group of 8 (an SP rank's share of it) needs the scratch of one
   query head: the score blocks are sized by the query heads a kv head has here, not by
   kv_group. */
TEST(cublaslt_workspace_follows_the_local_heads_not_kv_group) {
    alignas(16) static char view[16];
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = a.o = a.dout = a.dq = a.k = a.v = a.dk = a.dv = uly_dense(view, ULY_BF16, 1, 100, 1, 64);
    const uly_attn lt = uly_cublaslt_attention(lt_handle());
    const int64_t one = lt.workspace(lt.ctx, &a);
    a.kv_group = 8, a.q_head0 = 3;
    const int64_t of8 = lt.workspace(lt.ctx, &a);
    CHECK(of8 == one, "workspace: %lld bytes for one head of a group of 8, %lld for a group of 1",
          (long long)of8, (long long)one);
}

/* More of what the cuBLASLt attention refuses in its check (what the layer asks before it
   exchanges anything, and fwd and bwd run first); the views are never read. fp32 (its GEMMs
   take bf16 and fp16), D = 264 (past 256), 2^31 batches (the Dsum pass's grid counts them in
   int; 65536, past CUDA's grid dims, it takes in slices), GEMM dims past int: two query heads of
   2^30 rows on one kv head are 2^31 rows of one batched product, and 2^31 keys; and in the
   backward a dk whose shape is not k's (the contract's rule). */
TEST(cublaslt_rejects_dtypes_head_dims_batches_and_dims_past_int) {
    const uly_attn lt = uly_cublaslt_attention(lt_handle());
    alignas(256) static char buf[64];
    struct {
        uly_dtype t;
        int64_t B, Sq, Sk, H, Hkv, D;
        int backward;
        uly_code code;
        const char *says;
    } cases[] = {
        {ULY_F32, 1, 1, 1, 1, 1, 8, 0, ULY_EUNSUPPORTED, "takes bf16 or fp16"},
        {ULY_BF16, 1, 1, 1, 1, 1, 264, 0, ULY_EUNSUPPORTED, "D <= 256"},
        {ULY_BF16, (int64_t)1 << 31, 1, 1, 1, 1, 8, 0, ULY_EUNSUPPORTED, "q.b (2147483648)"},
        {ULY_BF16, 65536, 1, 1, 1, 1, 8, 0, ULY_OK, ""},
        {ULY_BF16, 1, (int64_t)1 << 30, 1, 2, 1, 8, 0, ULY_EUNSUPPORTED, "a GEMM's dims are int"},
        {ULY_F16, 1, 1, (int64_t)1 << 31, 1, 1, 8, 0, ULY_EUNSUPPORTED, "a GEMM's dims are int"},
        {ULY_BF16, 1, 1, 1, 1, 1, 8, 1, ULY_EINVAL, "dk: shape"},
    };
    for (const auto &k : cases) {
        uly_attn_args a;
        memset(&a, 0, sizeof a);
        a.q = a.o = a.dout = a.dq = uly_dense(buf, k.t, k.B, k.Sq, k.H, k.D);
        a.k = a.v = a.dk = a.dv = uly_dense(buf, k.t, k.B, k.Sk, k.Hkv, k.D);
        if (k.backward) a.dk = uly_dense(buf, k.t, k.B, k.Sk + 1, k.Hkv, k.D);
        a.lse = (float *)buf, a.workspace = buf, a.workspace_bytes = INT64_MAX;
        const uly_status st = lt.check(lt.ctx, &a, k.backward);
        CHECK(st.code == k.code && strstr(st.msg, k.says), "want '%s': code %d '%s'", k.says,
              (int)st.code, st.msg);
    }
}

/* The backward reads lse and writes only dq, dk and dv (the contract): it recomputes P with its
   own row sums, so the lse it is handed stays as it was, even one that is not its forward's
   (here every value 0.5 after the forward). */
TEST(cublaslt_backward_leaves_lse_alone) {
    const fcase c = make_case({2, 33, 40, 2, 1, 1}, 64, ULY_BF16);
    const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
    dev_tensor x[8];
    uly_attn_args a = alloc_tensors(c, c.B, c.Sq, c.Sk, in, x);
    a.causal = c.causal;
    const uly_attn lt = uly_cublaslt_attention(lt_handle());
    const size_t nlse = (size_t)(c.B * c.H * c.Sq);
    std::vector<float> lse(nlse, 0.5f);
    cudaMalloc((void **)&a.lse, nlse * 4);
    a.workspace_bytes = lt.workspace(lt.ctx, &a);
    cudaMalloc(&a.workspace, (size_t)a.workspace_bytes);
    uly_status st = lt.fwd(lt.ctx, &a);
    cudaMemcpy(a.lse, lse.data(), nlse * 4, cudaMemcpyHostToDevice);
    if (!st.code) st = lt.bwd(lt.ctx, &a);
    CHECK(!st.code && cudaDeviceSynchronize() == cudaSuccess, "'%s'", st.msg);
    cudaMemcpy(lse.data(), a.lse, nlse * 4, cudaMemcpyDeviceToHost);
    int changed = 0;
    for (float l : lse) changed += l != 0.5f;
    CHECK(changed == 0, "the backward wrote %d of %zu lse values", changed, nlse);
    for (dev_tensor &t : x) cudaFree(t.t.data);
    cudaFree(a.lse), cudaFree(a.workspace);
}

#ifdef ULY_EMU
/* On a GPU with 99 KB of shared memory per block (sm_86, sm_89) the D = 128 flash backward
   cannot launch: a named error that says what it needs and what the GPU has, and points to this
   path, which then runs. The backward queues nothing before it refuses, and its check (what the
   layer asks before it exchanges anything) refuses alike. What it needs comes from the tile
   sizes, so the test does not restate it: it takes the number from the message and holds it to
   what the emulator enforces, more than 99 KB, and enough for the backward to run (a shared
   memory access past a launch's bytes faults). The emulator plays the smaller GPU; a real one
   has the shared memory it has. */
TEST(flash_backward_beyond_the_gpus_shared_memory_is_a_named_error_and_cublaslt_runs) {
    enum { D = 128, SMALL = 99 * 1024 };
    void *t[8];
    for (void *&p : t) cudaMalloc(&p, D * 2), cudaMemset(p, 0, D * 2);
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = uly_dense(t[0], ULY_BF16, 1, 1, 1, D), a.k = uly_dense(t[1], ULY_BF16, 1, 1, 1, D);
    a.v = uly_dense(t[2], ULY_BF16, 1, 1, 1, D), a.o = uly_dense(t[3], ULY_BF16, 1, 1, 1, D);
    a.dout = uly_dense(t[4], ULY_BF16, 1, 1, 1, D), a.dq = uly_dense(t[5], ULY_BF16, 1, 1, 1, D);
    a.dk = uly_dense(t[6], ULY_BF16, 1, 1, 1, D), a.dv = uly_dense(t[7], ULY_BF16, 1, 1, 1, D);
    cudaMalloc((void **)&a.lse, 4);
    const uly_attn fa = uly_flash_attention(), lt = uly_cublaslt_attention(lt_handle());
    a.workspace_bytes = std::max(fa.workspace(fa.ctx, &a), lt.workspace(lt.ctx, &a));
    cudaMalloc(&a.workspace, (size_t)a.workspace_bytes);
    uly_emu_set_smem_optin(SMALL);
    const uly_status fwd = fa.fwd(fa.ctx, &a);
    uly_emu_record_reset();
    const uly_status bwd = fa.bwd(fa.ctx, &a);
    const size_t queued = uly_emu_recorded_ops().size();
    const uly_status check_fwd = fa.check(fa.ctx, &a, 0), check_bwd = fa.check(fa.ctx, &a, 1);
    const uly_status lt_bwd = lt.bwd(lt.ctx, &a);
    CHECK(!fwd.code && !check_fwd.code, "the forward fits in 99 KB: '%s' '%s'", fwd.msg,
          check_fwd.msg);
    CHECK(queued == 0, "the refused backward queued %zu operations", queued);
    CHECK(check_bwd.code == bwd.code && !strcmp(check_bwd.msg, bwd.msg), "check: '%s'",
          check_bwd.msg);
    const char *needs = strstr(bwd.msg, "uly__flash_bwd_kv needs ");
    unsigned long need = 0;
    if (needs) sscanf(needs, "uly__flash_bwd_kv needs %lu", &need);
    char has[32];
    snprintf(has, sizeof has, "has %d", (int)SMALL);
    CHECK(bwd.code == ULY_EUNSUPPORTED && need > SMALL && strstr(bwd.msg, has) &&
              strstr(bwd.msg, "uly_cublaslt_attention"),
          "'%s'", bwd.msg);
    CHECK(!lt_bwd.code, "cuBLASLt backward: '%s'", lt_bwd.msg);
    if (need > SMALL) {
        uly_emu_set_smem_optin(need);
        const uly_status fits = fa.bwd(fa.ctx, &a);
        CHECK(!fits.code && cudaDeviceSynchronize() == cudaSuccess,
              "the flash backward in the %lu bytes it says it needs: '%s'", need, fits.msg);
    }
    uly_emu_set_smem_optin(0);
    for (void *p : t) cudaFree(p);
    cudaFree(a.lse), cudaFree(a.workspace);
}
#endif

/* x[e] = e % mod + add, as T: integers below 256, exact in bf16. */
template <typename T> __global__ void fill_ints(T *x, int64_t n, int mod, int add) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += step)
        x[e] = (T)(float)(e % mod + add);
}

/* The elementwise kernels index in 64 bits: with inputs e % 251 (p = 1, Dsum = 0, scale 1),
   uly__lt_store and uly__lt_softmax_grad put e % 251 at element e, sampled at the ends, around
   2^31 and in between. A GPU with 17 GB free runs n just past 2^31 (a 32-bit index would wrap
   there); the emulator runs the same check on 7 blocks' worth, the formulas without the width. */
TEST(cublaslt_elementwise_kernels_index_past_int32) {
    const int64_t SK = 1024, two31 = (int64_t)1 << 31;
#ifdef ULY_EMU
    const int64_t rows = 7;
#else
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    const int64_t rows = free_bytes > ((size_t)17 << 30) ? two31 / SK + 1 : 7;
    if (rows == 7) printf("   (%zu bytes free: n = %lld, below 2^31)\n", free_bytes,
                          (long long)(rows * SK));
#endif
    const int64_t n = rows * SK;
    float *x, *dsum;
    __nv_bfloat16 *y, *p;
    cudaMalloc((void **)&x, (size_t)n * 4), cudaMalloc((void **)&y, (size_t)n * 2);
    cudaMalloc((void **)&p, (size_t)n * 2), cudaMalloc((void **)&dsum, (size_t)rows * 4);
    CHECK(x && y && p && dsum, "cudaMalloc of %lld elements", (long long)n);
    cudaMemset(dsum, 0, (size_t)rows * 4);
    ULY_LAUNCH(fill_ints<float>, uly__lt_grid(n), dim3(ULY__LT_THREADS), 0, 0, x, n, 251, 0);
    ULY_LAUNCH(fill_ints<__nv_bfloat16>, uly__lt_grid(n), dim3(ULY__LT_THREADS), 0, 0, p, n, 1, 1);
    const int64_t at[] = {0, 1, n / 2, two31 - 1, two31, two31 + 1, two31 + 251, n - 2, n - 1};
    for (int kernel = 0; kernel < 2; kernel++) {
        cudaMemset(y, 0xff, (size_t)n * 2);
        if (kernel == 0)
            ULY_LAUNCH(uly__lt_store<__nv_bfloat16>, uly__lt_grid(n), dim3(ULY__LT_THREADS), 0, 0,
                       (const float *)x, y, SK, rows, SK);
        else
            ULY_LAUNCH(uly__lt_softmax_grad<__nv_bfloat16>, uly__lt_grid(n),
                       dim3(ULY__LT_THREADS), 0, 0, (const __nv_bfloat16 *)p, (const float *)x,
                       (const float *)dsum, (int64_t)0, y, n, (int)rows, (int)SK, SK, 1.f);
        CHECK(cudaDeviceSynchronize() == cudaSuccess, "kernel %d", kernel);
        for (int64_t e : at) {
            if (e < 0 || e >= n) continue;
            __nv_bfloat16 got;
            cudaMemcpy(&got, y + e, 2, cudaMemcpyDeviceToHost);
            CHECK(__bfloat162float(got) == (float)(e % 251), "%s: element %lld is %g, want %d",
                  kernel ? "uly__lt_softmax_grad" : "uly__lt_store", (long long)e,
                  __bfloat162float(got), (int)(e % 251));
        }
    }
    cudaFree(x), cudaFree(y), cudaFree(p), cudaFree(dsum);
}

int main(void) { return uly_run_tests(); }
