/* test_flash.cu - the flash attention kernels of ulysses_cuda.cuh against two references.

   For every case the inputs are random values already rounded to the dtype, and three things
   are computed from them:
     ref64   attention forward and backward in fp64, from the formulas (below);
     lowp    the same steps with every intermediate tensor rounded to the dtype, as a plain
             bf16/fp16 attention computes it (S, P, O, dP, dS, dQ, dK, dV);
     cpu     ulysses.h's fp32 reference, uly_cpu_attention.
   The accuracy rule is FlashAttention's own: for each output, the kernel's max error against
   ref64 is at most twice lowp's max error plus 1e-3; the kernel also agrees with cpu within the
   same bound. lse must be within 1e-3 (plus 1e-6 relative) of ref64, and +inf exactly where no
   key is kept.
   Builds under the CUDA emulator (make test) and with nvcc for a GPU (make test-gpu).
   ULY_TEST_FILTER selects tests by name, e.g. ULY_TEST_FILTER=d128; ULY_FLASH_VERBOSE=1 prints
   every case's errors. The harness and the references are in flash_case.h. */
#include "emu/cuda_emu.h"
#define ULYSSES_IMPLEMENTATION
#include "../ulysses_cuda.cuh"
#include "check.h"
#include "flash_case.h"

/* ---------------------------------------------------------------------------------------------
   Tests */

static void matrix(uly_dtype dt, int64_t D) {
    for (const shape &s : shapes) check_case(make_case(s, D, dt));
}

TEST(matrix_bf16_d64) { matrix(ULY_BF16, 64); }
TEST(matrix_bf16_d128) { matrix(ULY_BF16, 128); }
TEST(matrix_f16_d64) { matrix(ULY_F16, 64); }
TEST(matrix_f16_d128) { matrix(ULY_F16, 128); }

/* Length 1000 (8 query blocks, a tail of 104) for a few configurations. */
TEST(long_1000_bf16_d128_causal) { check_case(make_case({1, 1000, 1000, 1, 1, 1}, 128, ULY_BF16)); }
TEST(long_1000_f16_d64) { check_case(make_case({1, 1000, 1000, 2, 1, 0}, 64, ULY_F16)); }
TEST(long_1000_bf16_d64_causal_sq_lt_sk) {
    check_case(make_case({1, 300, 1000, 1, 1, 1}, 64, ULY_BF16));
}

/* Padded heads, rows and batches: every stride differs from the dense one. */
TEST(strided_inputs) {
    for (int64_t D : {64, 128})
        for (uly_dtype dt : {ULY_BF16, ULY_F16}) {
            fcase c = make_case({2, 129, 65, 4, 2, 1}, D, dt);
            c.strided = 1;
            check_case(c);
        }
}

/* An SP rank holding global query heads 1..3 of groups of 2: local heads 0 | 1, 2 read local kv
   heads 0 | 1, so one group is split across ranks. */
TEST(gqa_group_split_across_ranks) {
    for (int64_t D : {64, 128}) {
        fcase c = make_case({1, 65, 65, 3, 2, 1}, D, ULY_BF16);
        c.q_head0 = 1, c.kv_group = 2;
        check_case(c);
    }
}

/* Sq > Sk, causal: rows 0 .. Sq - Sk - 1 keep no key. */
TEST(fully_masked_rows_are_zero_with_inf_lse) {
    for (int deterministic : {0, 1}) {
        fcase c = make_case({1, 150, 20, 2, 1, 1}, 64, ULY_BF16);
        c.deterministic = deterministic;
        const run_out r = check_case(c);
        if (!r.ok) continue;
        int bad = 0;
        for (int64_t h = 0; h < c.H; h++)
            for (int64_t i = 0; i < c.Sq - c.Sk; i++) {
                bad += !(std::isinf(r.lse[h * c.Sq + i]) && r.lse[h * c.Sq + i] > 0);
                for (int64_t d = 0; d < c.D; d++)
                    bad += r.o[(i * c.H + h) * c.D + d] != 0 || r.dq[(i * c.H + h) * c.D + d] != 0;
            }
        CHECK(bad == 0, "%d values of fully masked rows are not 0 (lse +inf)", bad);
        for (const field &f : fields)
            for (float x : r.*f.got) bad += std::isnan(x) || std::isinf(x);
        CHECK(bad == 0, "%d outputs are NaN or inf", bad);
    }
}

/* Logits of magnitude ~1e4 (q, k uniform in [-170, 170), D = 64): exp never overflows. */
TEST(large_logits_do_not_overflow) {
    for (int causal : {0, 1}) {
        fcase c = make_case({1, 70, 70, 1, 1, causal}, 64, ULY_BF16);
        c.magnitude = 170;
        const run_out r = check_case(c);
        int bad = 0;
        for (const field &f : fields)
            for (float x : r.*f.got) bad += !std::isfinite(x);
        CHECK(bad == 0, "%d outputs are not finite", bad);
    }
}

/* Deterministic mode: three runs (each launch gets its own emulator schedule, and blocks run
   on several threads) give bitwise-identical gradients; GQA so dK/dV sum over a group. */
TEST(deterministic_is_bitwise_stable) {
    for (int64_t D : {64, 128}) {
        fcase c = make_case({2, 129, 130, 4, 1, 1}, D, ULY_BF16);
        c.deterministic = 1;
        const inputs in = make_inputs(c, c.B * c.Sq, c.B * c.Sk);
        const std::vector<int> cq = dense_cu(c.B, c.Sq), ck = dense_cu(c.B, c.Sk);
        const run_out first = run_attn(c, cq, ck, false, in, uly_flash_attention());
        check_outputs(c, first, reference(c, cq, ck, false, in, false),
                      reference(c, cq, ck, false, in, true), NULL);
        for (int run = 1; run < 3; run++) {
            const run_out again = run_attn(c, cq, ck, false, in, uly_flash_attention());
            for (const field &f : fields)
                CHECK(memcmp((again.*f.got).data(), (first.*f.got).data(),
                             (first.*f.got).size() * 4) == 0,
                      "D=%lld run %d: %s differs bitwise from run 0", (long long)D, run, f.name);
        }
    }
}

#ifdef ULY_EMU
/* Every ldmatrix of every kernel (forward; backward with atomic and with deterministic dQ) reads
   each 8 x 8 matrix in one shared-memory wavefront: the tiles' swizzle leaves no bank conflict. */
TEST(ldmatrix_reads_have_no_bank_conflicts) {
    for (int64_t D : {64, 128})
        for (int det : {0, 1}) {
            fcase c = make_case({1, 130, 130, 2, 1, 1}, D, ULY_BF16);
            c.deterministic = det;
            const unsigned long long before = uly_emu_ldmatrix_conflicts();
            check_case(c);
            const unsigned long long extra = uly_emu_ldmatrix_conflicts() - before;
            CHECK(extra == 0, "D=%lld deterministic=%d: %llu extra ldmatrix wavefronts",
                  (long long)D, det, extra);
        }
}
#endif

/* Packed documents: lengths 1 and several tiles, Sq != Sk per document, causal within each. */
TEST(varlen_documents) {
    const std::vector<int> cq = {0, 1, 131, 195, 212, 212}, ck = {0, 1, 131, 260, 277, 300};
    for (int64_t D : {64, 128})
        for (int causal : {0, 1}) {
            fcase c = make_case({1, cq.back(), ck.back(), 4, 2, causal}, D, ULY_BF16);
            c.strided = causal;
            const inputs in = make_inputs(c, cq.back(), ck.back());
            const run_out got = run_attn(c, cq, ck, true, in, uly_flash_attention());
            if (got.ok)
                check_outputs(c, got, reference(c, cq, ck, true, in, false),
                              reference(c, cq, ck, true, in, true), NULL);
        }
}

/* What the kernels do not take is a named error, not a wrong answer. */
TEST(rejects_what_the_kernels_do_not_take) {
    alignas(16) static uint16_t buf[4 * 96 + 8];
    float lse[4];
    uly_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = a.k = a.v = a.o = uly_dense(buf, ULY_BF16, 1, 4, 1, 96);
    a.lse = lse;
    const uly_attn fa = uly_flash_attention();
    uly_status st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "q.d"), "D = 96: %s", st.msg);
    a.q = a.k = a.v = a.o = uly_dense(buf, ULY_F32, 1, 2, 1, 64);
    st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "f32"), "fp32: %s", st.msg);
    a.q = a.k = a.v = a.o = uly_dense(buf + 1, ULY_BF16, 1, 4, 1, 64);
    st = fa.fwd(fa.ctx, &a);
    CHECK(st.code == ULY_EUNSUPPORTED && strstr(st.msg, "16-byte"), "misaligned: %s", st.msg);
}

int main(void) { return uly_run_tests(); }
